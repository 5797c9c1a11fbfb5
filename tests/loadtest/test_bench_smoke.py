"""The living benchmarks' CPU smoke modes, so none of them rots: each runs end to end and
checks what it measures (dloserve's output equals resident, the streamed encode's bytes, ...)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # each runs a benchmark script end to end in its own processes
ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, args: list[str], tmp_path: Path, timeout: float = 400) -> dict:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "loadtest" / script), *args, "--out", str(out)],
        capture_output=True, text=True, timeout=timeout, env={**_env(), "TMPDIR": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "HF_HUB_OFFLINE": "1"}


def test_offload_bench_cpu_smoke(tmp_path: Path) -> None:
    report = _run("bench_offload.py", ["--device", "cpu", "--preset", "tiny", "--layers", "3",
                                       "--tokens", "64", "--reps", "2"], tmp_path)
    strategies = report["strategies"]
    assert set(strategies) == {"resident", "dlo", "dlo-ranklocal"}
    for name in ("dlo", "dlo-ranklocal"):
        w = strategies[name]["workloads"]["64"]
        assert w["bitwise_equal_resident"] is True, name
        assert w["median_ms"] > 0
        assert strategies[name]["offload_stats"]["forwards"] == 3  # warm-up + 2 timed
    assert report["machine"]["torch"] == __import__("torch").__version__


def test_sp_bench_cpu_smoke(tmp_path: Path) -> None:
    """One SP2 DLO run on gloo (the GPU run adds dp1 and sp2-resident to compare with)."""
    report = _run("bench_sp.py", ["--device", "cpu", "--preset", "tiny", "--layers", "3", "--tokens", "64",
                                  "--reps", "1", "--gen", "none", "--runs", "sp2-dlo"], tmp_path)
    ranks = report["runs"]["sp2-dlo"]["ranks"]
    assert len(ranks) == 2 and ranks[0]["workloads"]["64"]["sha256"] == ranks[1]["workloads"]["64"]["sha256"]
    assert ranks[0]["host_shard_bytes"] > 0 and report["summary"][0]["ms_per_forward"] > 0



def test_encode_bench_cpu_smoke(tmp_path: Path) -> None:
    """Every part at a toy size: the default at equal quality to itself and more threads
    giving other bytes; the streamed encode through a real rank and beside a real chunked VAE
    decode giving the bytes of decode-then-encode."""
    report = _run("bench_encode.py", [
        "--parts", "settings,overlap,decode", "--decode-size", "64x48x9", "--reps", "1",
        "--settings-clips", "demo", "--demo-clips", "1", "--presets", "ultrafast,medium", "--crfs", "18",
        "--requests", "2", "--request-size", "64x64x5", "--steps", "1"], tmp_path, timeout=900)
    s = report["settings"]
    assert s["equal_quality"]["medium"]["crf"] == 18  # the default equals itself
    assert s["more_threads"]["demo"]["same_bytes"] is False  # the thread count is part of the bytes
    o = report["overlap"]
    assert o["bytes_equal"] and not any(r["errors"] for rs in o["runs"].values() for r in rs)
    d = report["decode"]
    assert d["bytes_equal"] and d["chunks"] == 3  # 9 frames: 1 + 4 + 4


def test_batch_bench_cpu_smoke(tmp_path: Path) -> None:
    """Two requests of one key (4 and 3 steps, CFG: two forwards a step on the CPU) alone and
    batched through a real rank: fewer forwards batched, each request's frames close to its run
    alone, no errors (the frames are taken from the rank's streamed chunks: reading only the
    whole clip runner.frames returns, the benchmark found none since the streamed decode)."""
    report = _run("batch_bench.py", ["--requests", "2", "--steps", "4", "--cap", "2"], tmp_path, timeout=600)
    row = report["results"][0]
    assert row["off"]["forwards"] == 2 * (4 + 3) and row["on"]["forwards"] < row["off"]["forwards"]
    assert not row["off"]["errors"] and not row["on"]["errors"]
    assert row["on"]["batch_size"] == {"r0": 2, "r1": 2} and row["psnr_min_db"] >= 45


def test_lora_bench_cpu_smoke(tmp_path: Path) -> None:
    """A LoRA on every Linear, resident and DLO: it changes the output, the same in both, and
    the output without it is the base model's again afterwards."""
    report = _run("bench_lora.py", ["--smoke"], tmp_path)
    runs = report["strategies"]
    assert set(runs) == {"resident", "dlo"}
    res, dlo = runs["resident"]["tokens"]["64"], runs["dlo"]["tokens"]["64"]
    for w in (res, dlo):
        assert w["lora_changes_output"] and w["unchanged_after"] and w["ratio"] > 0
    assert res["sha256"] == dlo["sha256"] and res["lora_sha256"] == dlo["lora_sha256"]
    assert runs["dlo"]["adapter"]["factor_bytes"] > 0 and runs["dlo"]["adapter"]["misses"] == 1


def test_cache_bench_cpu_smoke(tmp_path: Path) -> None:
    """Every cache setting runs through DLO; the loose first_block threshold skips and moves
    fewer bytes, settings that skip nothing give the uncached frames, and the DP2 group agrees."""
    report = _run("bench_cache.py", ["--smoke", "--dp2"], tmp_path)
    runs = report["dp1"]
    assert set(runs) == {"none", "first_block@0.05", "first_block@5.0", "mag@0.06", "mag@0.24"}
    loose = runs["first_block@5.0"]
    assert loose["skips"] > 0 and loose["fill_bytes"] < runs["none"]["fill_bytes"]
    assert not loose["frames_equal_uncached"]
    assert runs["none"]["skips"] == 0 and runs["none"]["forward_count"] == 8  # 4 steps, CFG
    d = report["dp2"]
    assert [r["skips"] for r in d["rank0_cached"]["ranks"]] == [0, 0]  # rank 1 always needed them
    assert d["both_cached"]["ranks"][0]["skips"] > 0 and d["both_cached"]["agree_ms_per_decision"] > 0
