"""loadtest/quality.py cannot rot: one prompt per setting on the noise preset (fast), the report's
shape, and the thresholds' verdicts."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest import quality


def test_a_quick_run_writes_a_scored_report_and_dlo_matches_exact(demo_model: str, tmp_path: Path) -> None:
    out = tmp_path / "q.json"
    assert quality.main(["--settings", "exact,dlo,half-steps", "--seeds", "0", "--limit", "2",
                         "--model", demo_model, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["command"] and report["date"] and report["machine"]["cpus"]
    results = report["results"]
    # the noise preset has no defaults file: our request's (2 steps, 32x32)
    assert results["exact"]["summary"]["clips"] == 2 and results["exact"]["request"]["steps"] == 2
    assert results["half-steps"]["request"]["steps"] == 1
    assert results["dlo"]["digests"] == results["exact"]["digests"]  # offload: the same frames
    assert not any("dlo" in m for m in report["misses"])


def test_the_verdicts_name_each_missed_threshold() -> None:
    def summary(colour: float, motion: float) -> dict:
        return {"summary": {"colour": colour, "motion": motion}, "digests": ["a"]}

    good = {"exact": summary(0.95, 0.9), "fp8": summary(0.94, 0.89), "dlo": summary(0.95, 0.9),
            "lora": summary(0.8, 1.0)}
    assert quality.verdicts(good) == []
    bad = {"exact": summary(0.85, 0.8), "fp8": summary(0.8, 0.8), "lora": summary(0.5, 1.0),
           "dlo": {"summary": {}, "digests": ["b"]}}
    misses = quality.verdicts(bad)
    assert any(m.startswith("exact colour") for m in misses)
    assert any(m.startswith("exact motion") for m in misses)
    assert any(m.startswith("fp8 colour") for m in misses) and "dlo frames differ from exact's" in misses
    assert any(m.startswith("lora colour") for m in misses)


def test_attention_settings_that_cannot_run_here_are_not_measured(demo_model: str, tmp_path: Path) -> None:
    """On this CPU the --attention kernels cannot run: the report says so and why, scores nothing
    for them (not a copy of exact's) and judges nothing."""
    out = tmp_path / "q.json"
    assert quality.main(["--settings", "exact,attn-fp8,attn-fa4", "--seeds", "0", "--limit", "1",
                         "--model", demo_model, "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert results["attn-fp8"] == {"setting": "attn-fp8", "not_measured": "cuDNN's FP8 attention "
                                   "(nvidia-cudnn-frontend) needs a CUDA GPU (this server computes on cpu)"}
    assert "summary" not in results["attn-fa4"] and "CUDA GPU" in results["attn-fa4"]["not_measured"]
    assert quality.verdicts({"exact": results["exact"], "attn-fp8": results["attn-fp8"]}) == \
        quality.verdicts({"exact": results["exact"]})
    bad = {"exact": {"summary": {"colour": 0.99, "motion": 0.9}},
           "bf16": {"summary": {"colour": 0.95, "motion": 0.9}},
           "attn-fp8": {"summary": {"colour": 0.90, "motion": 0.9}}}  # held against bf16, as it computes
    assert quality.verdicts(bad) == ["attn-fp8 colour 0.900 more than 0.02 under bf16's 0.950"]


def test_a_setting_is_compared_with_its_reference_frames() -> None:
    """psnr_db: identical clips are 99 dB, a clip one grey level off everywhere 48.1 dB; the
    attention settings' reference is bf16 (they compute in bfloat16), the others' exact."""
    import numpy as np

    a = np.full((2, 4, 4, 3), 100, dtype=np.uint8)
    assert quality.psnr_db([a], [a]) == 99.0
    assert round(quality.psnr_db([a + 1], [a]), 1) == 48.1
    assert quality.reference("attn-fp8") == quality.reference("attn-fa4") == "bf16"
    assert quality.reference("fp8") == quality.reference("bf16") == "exact"
