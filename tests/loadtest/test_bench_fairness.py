"""The fairness benchmark's small run: it runs, and the others' wait is within one job's time
with fair share while one shared queue makes them wait behind the flood."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fairness_bench_small_run(tmp_path: Path) -> None:
    out = tmp_path / "fairness.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "loadtest" / "bench_fairness.py"), "--out", str(out), "--runs", "2",
         "--flood", "20", "--horizon-s", "120", "--job-s", "10"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"continuous", "waves"}
    for name, r in results.items():
        before, after = r["before"], r["after"]
        assert before["n"] == after["n"] == 4, name  # key-b and key-c, two runs
        assert after["max_s"] <= 10.0 and r["after_within_bound"], (name, after)
        # 20 flooding clients on 2 ranks: ~18 queued ahead, ~90 s behind them in one queue
        assert before["mean_s"] > 3 * 10.0, (name, before)
        assert after["jobs_per_hour"] == before["jobs_per_hour"], name  # fairness costs no throughput
