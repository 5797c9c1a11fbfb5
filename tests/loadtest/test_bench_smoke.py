"""The offload benchmark's CPU smoke mode: it runs, and dloserve's output equals resident."""

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


def test_fp8_bench_cpu_smoke(tmp_path: Path) -> None:
    """bf16/fp8 x resident/DLO on the tiny preset cast to bf16, so scaled_mm really runs."""
    report = _run("bench_fp8.py", ["--device", "cpu", "--preset", "tiny", "--layers", "3", "--tokens", "64",
                                   "--reps", "1", "--dtype", "bfloat16"], tmp_path)
    assert set(report["runs"]) == {"bf16-resident", "bf16-dlo", "fp8-resident", "fp8-dlo"}
    assert all("error" not in r for r in report["runs"].values())
    rows = {(r["run"], r["compute"]): r for r in report["rows"]}
    assert set(rows) == {("bf16-resident", "bf16"), ("bf16-dlo", "bf16"), ("fp8-resident", "upcast"),
                         ("fp8-resident", "scaled_mm"), ("fp8-dlo", "upcast"), ("fp8-dlo", "scaled_mm")}
    assert rows[("bf16-dlo", "bf16")]["bitwise_equal_resident"] is True
    assert rows[("bf16-dlo", "bf16")]["rel_error_vs_bf16"] == 0.0
    for compute in ("upcast", "scaled_mm"):
        r = rows[("fp8-dlo", compute)]
        assert r["bitwise_equal_resident"] is True, compute
        assert 0 < r["rel_error_vs_bf16"] < 0.1
        assert r["block_gb"] < 0.75 * rows[("bf16-dlo", "bf16")]["block_gb"]  # tiny: many fp32 norms
        assert report["runs"]["fp8-dlo"]["computes"][compute]["scaled_mm_ran"] == (compute == "scaled_mm")


def test_encode_bench_cpu_smoke(tmp_path: Path) -> None:
    """Thread counts and the streamed encode at a toy size: one file per configuration,
    streamed bytes equal to encode_mp4's, x264's hold-back counted."""
    report = _run("bench_encode.py", ["--parts", "threads,stream", "--size", "64x48x9", "--threads", "1,2",
                                      "--reps", "2", "--decode-s", "0,0.2"], tmp_path)
    rows = report["threads"]["rows"]
    assert {(r["kind"], r["threads"]) for r in rows} >= {("frame", 1), ("frame", 2), ("slice", 2)}
    assert all(r["distinct_sha256"] == 1 and r["x264"]["threads"] for r in rows)
    assert [r["role"] for r in rows if r["role"]] == ["before", "before"]  # X264_THREADS is not in 1,2
    assert all(r["bytes_equal"] and r["held_back_frames"] == 9 for r in report["stream"]["rows"])


def test_encode_determinism_smoke_and_its_fault(tmp_path: Path) -> None:
    """The check passes on the service's settings and fails with the thread count taken
    from the CPUs (a process pinned to one CPU then writes other bytes)."""
    import os

    args = ["--processes", "3", "--rounds", "1", "--full-reps", "0", "--load", "0",
            "--inputs", "noise-96x96x9,smooth-96x96x9"]
    report = _run("encode_determinism.py", args, tmp_path)
    assert report["one_file_per_input"] and report["total_encodes"] == 6
    if len(os.sched_getaffinity(0)) > 1:  # pinning changes nothing on a one-CPU host
        proc = subprocess.run([sys.executable, str(ROOT / "loadtest" / "encode_determinism.py"), *args,
                               "--fault", "auto-threads"], capture_output=True, text=True, timeout=400,
                              env=_env())
        assert proc.returncode == 1, proc.stdout


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


def test_experts_bench_cpu_smoke(tmp_path: Path) -> None:
    """Two experts on the tiny Wan2.2 model: every run's outputs equal resident's per expert;
    with ``expect`` no prefetched fill is dropped, without it every expert-1 forward drops one;
    ranks offset into different experts hold ticks; host PSS is reported against the target."""
    report = _run("bench_experts.py", ["--smoke"], tmp_path, timeout=900)  # six runs, nine processes
    assert {"command", "machine", "date"} <= set(report) and "--smoke" in report["command"]
    rows = {r["run"]: r for r in report["summary"]}
    assert set(rows) == {"resident", "dp1", "dp1-noexpect", "dp2-allgather", "dp2-offset", "dp2-ranklocal"}
    plan = report["runs"]["resident"]["ranks"][0]["sizes"]["32x32x5"]["plan"]
    assert 0 in plan and 1 in plan  # the request really switches experts
    for name, r in rows.items():
        assert r["distinct_outputs_expert0"] == r["distinct_outputs_expert1"] == 1, name
        if name != "resident":
            assert r["bitwise_equal_resident"] is True, name
            assert r["host_pss_gb"] > 0 and r["pss_target_gb"] > r["checkpoint_gb"], name
    assert rows["dp1"]["prefetch_redirects"] == rows["dp2-allgather"]["prefetch_redirects"] == 0
    assert rows["dp1-noexpect"]["prefetch_redirects"] == plan.count(1)
    assert rows["dp2-allgather"]["ticks"] * 2 == rows["dp2-allgather"]["forwards"] == 2 * len(plan)
    assert rows["dp2-offset"]["held_ticks"] > 0 and rows["dp2-offset"]["ticks"] > len(plan)
    assert rows["dp2-ranklocal"]["held_ticks"] == 0 and rows["dp2-ranklocal"]["prefetch_redirects"] == 0
    assert len(rows["dp1"]["switch_ms"]) >= 1


def test_state_bench_cpu_smoke(tmp_path: Path, demo_model: str) -> None:
    """The tap alone (the latents, and with UniPC's loop state) and a real request on the demo
    model's own UniPC with and without its state kept: the same bytes, a state for every step
    but the last, each step's time on both sides."""
    args = ["--model", demo_model, "--size", "32x32x5", "--steps", "3", "--rounds", "1", "--reps", "2",
            "--shape", "1,16,2,4,4", "--dtypes", "float32", "--schedulers", "none,unipc"]
    report = _run("bench_state.py", args, tmp_path)
    tap, unipc = report["runs"]
    assert tap["bytes"] == tap["state_bytes"] == 16 * 2 * 4 * 4 * 4 and tap["store_ms_median"] > 0
    # UniPC's state: two model outputs and the last sample besides the latents, its tables, the generator
    assert unipc["state_bytes"] > 4 * unipc["bytes"] and unipc["file_bytes"] > unipc["state_bytes"]
    st = report["steps"]
    assert st["summary"]["bytes_equal"] and st["summary"]["states_per_run"] == 2
    assert [(r["keep"], r["states"], len(r["step_ms"])) for r in st["runs"]] == [(False, 0, 2), (True, 2, 2)]
    assert st["summary"]["take_ms_median"] > 0 and st["summary"]["landed_ms_median"] > 0


def test_sizes_bench_cpu_smoke(tmp_path: Path, demo_model: str) -> None:
    """The marked warm-up runs every other size in its graph; the static one compiles again."""
    report = _run("bench_sizes.py", ["--device", "cpu", "--model", demo_model, "--probe", "32x32x5",
                                     "--sizes", "48x32x9,32x48x5"], tmp_path)
    marked, static = report["variants"]["marked"], report["variants"]["static"]
    assert marked["compile"]["dynamic_dims"] >= 3 and static["compile"]["dynamic_dims"] == 0
    assert [s["first"]["new_graphs"] for s in marked["sizes"]] == [0, 0]
    assert static["sizes"][0]["first"]["new_graphs"] >= 1
    assert all(s["again"]["new_graphs"] == 0 for v in (marked, static) for s in v["sizes"])
    assert set(report["first_runs_extra_s"]) == {"marked", "static"}
