"""What the offline benchmarks share: the ``--tokens`` list, the machine's kind in a result's
name, and writing the JSON report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def token_list(text: str) -> list[int]:
    """``--tokens 4096,32760`` -> [4096, 32760]."""
    return [int(t) for t in text.split(",")]


def check_tokens(p: argparse.ArgumentParser, tokens: list[int], shapes: dict[int, Any]) -> None:
    """Exit 2 naming a token count the benchmark has no input shape for."""
    for t in tokens:
        if t not in shapes:
            p.error(f"--tokens: {t} is not one of {sorted(shapes)}")


def machine_kind(report: dict[str, Any], device: str) -> str:
    """``h200`` on an H200, else the device (the prefix of a result's file name)."""
    return "h200" if "H200" in report["machine"].get("gpu", "") else device


def write_report(report: dict[str, Any], out: str | Path) -> Path:
    """The report as indented JSON at ``out`` (its folder made)."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path
