"""The benchmarks' harness (loadtest/reporting.py): every benchmark's JSON starts with the
command, the date and the machine from it, and taking the machine's facts imports no torch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

LOADTEST = Path(__file__).resolve().parents[2] / "loadtest"
OWN = {"reporting.py"}  # the harness itself


def test_the_header_names_command_date_and_machine_without_importing_torch() -> None:
    code = ("import json, sys, reporting; h = reporting.header('cpu', note=1); "
            "print(json.dumps({**h, 'torch_imported': 'torch' in sys.modules}))")
    r = subprocess.run([sys.executable, "-c", code, "--flag"], cwd=LOADTEST, capture_output=True, text=True,
                       timeout=120, check=True)
    h = json.loads(r.stdout)
    assert h["command"].endswith("-c --flag") and h["date"].endswith("+00:00")
    assert h["machine"]["cpus"] and h["machine"]["device"] == "cpu" and h["machine"]["note"] == 1
    assert not h["torch_imported"] and "torch" not in h["machine"]
    assert isinstance(h["machine"]["bytecode"]["torch_cached"], bool)  # found, not imported
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    for flags, writes in (([], True), (["-B"], False)):  # python -B: no bytecode kept
        r = subprocess.run([sys.executable, *flags, "-c", code], cwd=LOADTEST, capture_output=True,
                           text=True, timeout=120, check=True, env=env)
        assert json.loads(r.stdout)["machine"]["bytecode"]["writes"] is writes


def test_no_benchmark_writes_its_own_machine_facts_or_date() -> None:
    """The harness is the one place: a script that takes the host's name or stamps a date
    itself, or imports another script's private helpers, has its own copy again."""
    own = re.compile(r"platform\.node\(\)|def machine\(|\"date\": (dt|time)\."
                     r"|^from (?!__future__)\w+ import [^#\n]*\b_\w", re.M)
    found = [p.name for p in sorted(LOADTEST.glob("*.py")) if p.name not in OWN and own.search(p.read_text())]
    assert found == []


def test_results_are_written_by_the_harness() -> None:
    """A result file is written by ``write_report`` (its folder made, one JSON layout)."""
    own = re.compile(r"write_text\(json\.dumps\(\w+, indent=")
    found = [p.name for p in sorted(LOADTEST.glob("*.py"))
             if p.name not in OWN and own.search(p.read_text())]
    assert found == []


def test_results_go_to_out_else_to_loadtest_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``$OUT`` wins over loadtest/results/ (what a lent machine writes there comes back)."""
    from loadtest import reporting

    report = {"date": "2026-12-05T10:00:00+00:00", "machine": {"gpu": "NVIDIA H200"}}
    monkeypatch.delenv("OUT", raising=False)
    kind = reporting.machine_kind(report, "cuda")
    assert reporting.result_path(report, kind, "lora") == reporting.RESULTS / "h200-lora-2026-12-05.json"
    monkeypatch.setenv("OUT", str(tmp_path))
    assert reporting.result_path(report, "cpu") == tmp_path / "cpu-2026-12-05.json"
