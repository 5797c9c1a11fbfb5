"""The benchmarks' harness (loadtest/reporting.py): every benchmark's JSON starts with the
command, the date and the machine from it, and taking the machine's facts imports no torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

LOADTEST = Path(__file__).resolve().parents[2] / "loadtest"
# The harness itself; bench_compute.py (the lead's) takes the machine through bench_offload still.
OWN = {"reporting.py", "bench_compute.py"}


def test_the_header_names_command_date_and_machine_without_importing_torch() -> None:
    code = ("import json, sys, reporting; h = reporting.header('cpu', note=1); "
            "print(json.dumps({**h, 'torch_imported': 'torch' in sys.modules}))")
    r = subprocess.run([sys.executable, "-c", code, "--flag"], cwd=LOADTEST, capture_output=True, text=True,
                       timeout=120, check=True)
    h = json.loads(r.stdout)
    assert h["command"].endswith("-c --flag") and h["date"].endswith("+00:00")
    assert h["machine"]["cpus"] and h["machine"]["device"] == "cpu" and h["machine"]["note"] == 1
    assert not h["torch_imported"] and "torch" not in h["machine"]


def test_no_benchmark_writes_its_own_machine_facts_or_date() -> None:
    """The harness is the one place: a script that takes the host's name or stamps a date
    itself, or imports bench_offload's private helpers, has its own copy again."""
    own = re.compile(r"platform\.node\(\)|def machine\(|\"date\": (dt|time)\."
                     r"|from bench_offload import .*\b_")
    found = [p.name for p in sorted(LOADTEST.glob("*.py")) if p.name not in OWN and own.search(p.read_text())]
    assert found == []
