"""Step caches per request: diffusers' own hooks give the frames; skipped blocks move no bytes.

The reference is ``WanPipeline.from_pretrained`` with ``transformer.enable_cache(config)``
(First Block Cache, MagCache), resident. dloserve enables the same hooks on its own
meta-built transformer for one request, resident or streamed, and tells the offload what
they skip. On CPU in fp32 the frames are compared bitwise. The demo weights are noise, so the
thresholds here are chosen to make the caches skip, not to look good.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from loadtest.ranks import run_ranks
from service.config import EngineConfig, FlagError, OffloadConfig, OffloadMode, step_cache
from service.config.cache import CacheSpec, parse_spec
from service.models.cache import diffusers_config
from service.models.pipeline import PipelineRunner
from service.models.request import GenerationRequest, RequestError
from service.models.video import to_uint8
from tests.models.aligned import aligned_denoisers

STEPS = 4
A = GenerationRequest(prompt="a red fox running through snow", seed=7, num_inference_steps=STEPS)
B = GenerationRequest(prompt="a lighthouse at dusk", negative_prompt="blurry", seed=11,
                      num_inference_steps=STEPS)
FBC = CacheSpec("first_block", threshold=5.0)  # noise weights: a loose threshold makes it skip
MAG = CacheSpec("mag", threshold=0.5, max_skip_steps=2, retention_ratio=0.2,
                mag_ratios=(1.0, 0.99, 0.98, 0.97))


def sha(frames: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(frames).tobytes()).hexdigest()


def diffusers_frames(model: str, spec: CacheSpec | None, req: GenerationRequest) -> np.ndarray:
    from diffusers import WanPipeline

    pipe = aligned_denoisers(WanPipeline.from_pretrained(model))
    pipe.set_progress_bar_config(disable=True)
    if spec is not None:
        pipe.transformer.enable_cache(diffusers_config(spec, req.num_inference_steps))
    out = pipe(prompt=req.prompt, negative_prompt=req.negative_prompt, height=req.height, width=req.width,
               num_frames=req.num_frames, num_inference_steps=req.num_inference_steps,
               guidance_scale=req.guidance_scale, generator=torch.Generator().manual_seed(req.seed),
               output_type="np")
    return to_uint8(np.asarray(out.frames[0]))


def test_specs_are_checked_naming_the_field() -> None:
    assert parse_spec("first_block") == CacheSpec("first_block")
    assert parse_spec("first_block:threshold=0.1") == CacheSpec("first_block", threshold=0.1)
    assert parse_spec('{"method": "mag", "mag_ratios": [1, 0.9]}').mag_ratios == (1, 0.9)
    bad = [
        ({"method": "tea"}, "cache.method"),
        ({"threshold": 0.1}, "cache.method"),
        ({"method": "first_block", "threshold": -1}, "cache.threshold"),
        ({"method": "first_block", "threshold": True}, "cache.threshold"),
        ({"method": "first_block", "max_skip_steps": 2}, "cache.max_skip_steps"),
        ({"method": "first_block", "speed": 2}, "cache.speed"),
        ({"method": "mag"}, "cache.mag_ratios"),
        ({"method": "mag", "mag_ratios": [1.0, float("nan")]}, "cache.mag_ratios[1]"),
        ({"method": "mag", "mag_ratios": [1.0], "max_skip_steps": 1.5}, "cache.max_skip_steps"),
        ("first_block", None),
    ]
    for obj, field in bad:
        if field is None:
            GenerationRequest(prompt="x", cache=obj).check()
            continue
        with pytest.raises(RequestError) as e:
            GenerationRequest(prompt="x", cache=obj).check()
        assert e.value.field == field, obj
    # the server default: a flag, checked once, a CacheSpec (no JSON string to parse back)
    assert EngineConfig(step_cache=step_cache("first_block:threshold=0.1")).step_cache \
        == CacheSpec("first_block", threshold=0.1)
    assert EngineConfig(step_cache=step_cache("none")).step_cache is None
    with pytest.raises(FlagError, match="--cache: cache.method"):
        EngineConfig(step_cache=step_cache("tea"))
    # not part of the compatibility key: cached and uncached requests share a group
    assert replace(A, cache=FBC).compat_key() == A.compat_key()


@pytest.mark.parametrize("spec", [FBC, MAG], ids=["first_block", "mag"])
def test_resident_equals_diffusers_with_the_same_hook(demo_model: str, resident: PipelineRunner,
                                                      spec: CacheSpec) -> None:
    ours = resident.frames(replace(A, cache=spec))
    assert np.array_equal(ours, diffusers_frames(demo_model, spec, A))
    plain = resident.frames(A)
    assert not np.array_equal(ours, plain)  # it did skip: the frames changed
    assert resident.transformer._cache_config is None  # hooks gone after the request
    # threshold 0: never skips, the bytes of the uncached request
    assert np.array_equal(resident.frames(replace(A, cache=replace(spec, threshold=0.0))), plain)


@pytest.mark.parametrize("mode", [OffloadMode.ALLGATHER, pytest.param(OffloadMode.RANK_LOCAL,
                                                                      marks=pytest.mark.e2e)])
def test_streamed_skips_move_no_bytes(demo_model: str, resident: PipelineRunner, mode: OffloadMode) -> None:
    want = {name: sha(resident.frames(replace(A, cache=spec))) for name, spec in (("fbc", FBC), ("mag", MAG))}
    plain = sha(resident.frames(A))
    runners = {name: PipelineRunner.load(demo_model, "cpu", config=EngineConfig(offload=OffloadConfig(mode),
                                                                                step_cache=step_cache(cache)))
               for name, cache in (("plain", None), ("cached", "first_block:threshold=5.0"))}
    try:
        stats = {}
        for name, runner in runners.items():
            got = sha(runner.frames(A))  # the server default applies
            assert got == (want["fbc"] if name == "cached" else plain), (name, mode)
            assert sha(runner.frames(replace(A, cache=CacheSpec()))) == plain  # "none" opts out
            if name == "cached":
                assert sha(runner.frames(replace(A, cache=MAG))) == want["mag"]
            else:
                assert sha(runner.frames(A)) == plain
            stats[name] = runner.offload_stats()
        p, c = stats["plain"], stats["cached"]
        assert c["skips"] > 0 and c["blocks_skipped"] > 0 and p["skips"] == 0
        assert c["forwards"] == p["forwards"]
        # every fill the cached runner did not make is counted as skipped, nothing else
        assert p["fill_bytes"] - c["fill_bytes"] == c["fill_bytes_skipped"] > 0
        if mode is OffloadMode.ALLGATHER:
            assert c["skip_overruled"] == 0  # alone, a rank's decision is the group's
    finally:
        for runner in runners.values():
            runner.close()


def _mixed(rank: int, world: int, model: str, out: str) -> None:
    """Rank 0 runs A with a cache and B without; rank 1 the opposite; then both uncached."""
    results: dict[str, list] = {}
    for name, mode in (("allgather2", OffloadMode.ALLGATHER), ("ranklocal2", OffloadMode.RANK_LOCAL)):
        runner = PipelineRunner.load(model, "cpu", config=EngineConfig(offload=OffloadConfig(mode)),
                                     group=None if
                                     mode is OffloadMode.RANK_LOCAL else torch.distributed.group.WORLD)
        mine = [replace(A, cache=FBC), B] if rank == 0 else [B, replace(A, cache=MAG)]
        results[name] = [sha(runner.frames(req)) for req in mine]
        st = runner.offload_stats()
        results[name + "-stats"] = [st["skips"], st["skip_overruled"], st["gathered_bytes"]]
        runner.close()
    Path(out, f"{rank}.json").write_text(json.dumps(results))


@pytest.mark.e2e
def test_dp2_group_with_one_cached_and_one_uncached_request(demo_model: str, resident: PipelineRunner,
                                                            tmp_path: Path) -> None:
    want_a_fbc, want_b = sha(resident.frames(replace(A, cache=FBC))), sha(resident.frames(B))
    want_a_mag = sha(resident.frames(replace(A, cache=MAG)))
    run_ranks(_mixed, 2, demo_model, str(tmp_path), timeout=None)
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    for name in ("allgather2", "ranklocal2"):
        assert got[0][name] == [want_a_fbc, want_b], name
        assert got[1][name] == [want_b, want_a_mag], name
    ag0, ag1 = got[0]["allgather2-stats"], got[1]["allgather2-stats"]
    assert ag0[0] == ag1[0] == 0  # the other rank always needed the blocks: nothing skipped
    assert ag0[1] > 0 and ag1[1] > 0  # each cached rank replayed the blocks it did not need
    assert ag0[2] == ag1[2] > 0
    assert got[0]["ranklocal2-stats"][0] > 0 and got[1]["ranklocal2-stats"][0] > 0  # alone, each skips


def test_cache_flag_is_shared_and_checked() -> None:
    from service.cli import build_parser
    from service.config.args import EngineArgs

    def step_cache_of(argv: list[str]) -> CacheSpec | None:
        args = p.parse_args(["generate", "--prompt", "x", *argv])
        return EngineArgs.from_namespace(args).to_config().step_cache

    p = build_parser()
    assert step_cache_of(["--cache", "first_block:threshold=0.2"]) == CacheSpec("first_block", threshold=0.2)
    assert step_cache_of(["--cache-default", "none"]) is None
    with pytest.raises(FlagError, match="--cache: cache.threshold"):
        step_cache_of(["--cache", "first_block:threshold=-1"])
    with pytest.raises(FlagError, match="--cache"):
        step_cache_of(["--cache", "first_block", "--usp", "2", "--enable-distributed-layerwise-offload"])


def test_a_two_expert_model_refuses_a_cache_before_any_compute() -> None:
    """Wan2.2 A14B: diffusers' hooks would sit on one expert; the request is refused naming
    cache.method (validate, before a forward), and --cache as the server default fails the load."""
    from service.models.demo import ensure_demo_model

    two = str(ensure_demo_model("wan22-t2v-tiny"))
    runner = PipelineRunner.load(two, "cpu",
                                 config=EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER)))
    try:
        runner.validate(A)  # no cache: served
        with pytest.raises(RequestError, match="two-expert") as e:
            runner.validate(replace(A, cache=FBC))
        assert e.value.field == "cache.method"
        assert runner.handle is not None and not runner.handle._decide_at  # no decision points set
    finally:
        runner.close()
    with pytest.raises(ValueError, match="--cache: step caches are not supported on a two-expert"):
        PipelineRunner.load(two, "cpu", config=EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER),
                                                            step_cache=step_cache("first_block")))
