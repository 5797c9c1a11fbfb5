"""Render the README's benchmark tables from loadtest/results/*.json.

    python loadtest/report.py loadtest/results/h200-2026-11-30.json loadtest/results/h200x2-2026-11-30.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench_dp import dp_table
from bench_offload import table
from serve_bench import serve_table, summarize


def render(path: Path) -> str:
    report = json.loads(path.read_text())
    if "designs" in report:
        summarize(report)
        cmds = "; ".join(f"`{c['command']}`" for c in report["commands"])
        return f"From `{path.as_posix()}` ({cmds}):\n\n{serve_table(report)}\n"
    body = dp_table(report) if "runs" in report else table(report)
    return f"From `{path.as_posix()}` (`{report['command']}`):\n\n{body}\n"


if __name__ == "__main__":
    print("\n".join(render(Path(p)) for p in sys.argv[1:]))
