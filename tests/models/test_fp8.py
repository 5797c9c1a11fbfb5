"""``--quantization fp8`` end to end on the tiny demo pipeline (real diffusers Wan classes).

The MP4 bytes are the same resident and offloaded (AllGather and rank-local, DP1 and DP2 on
spawned gloo ranks), for the weights quantized at load and for ``dloserve quantize``'s folder;
the folder's weights are those the load quantizes, bit for bit. The frames' PSNR against the
unquantized pipeline is printed (the demo weights are noise: the figure says how far fp8 moves
the output, not how good a video looks).

The two sources give the same bytes too, ``dloserve generate`` included: the folder holds the
layers fp8 leaves alone at other file offsets than the original, and a CPU BLAS picks its
kernel by alignment (MKL with AVX-512 on an AMD EPYC host: as mapped, at 48x64x9 the last
bits differed), so a view the CPU computes with is on a 64-byte boundary in both
(offload/checkpoint.py ``compute_aligned``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from loadtest.ranks import run_ranks
from service.cli import main as cli_main
from service.config import EngineConfig, FlagError, ModelConfig, OffloadConfig, OffloadMode
from service.config.args import GENERATE, EngineArgs
from service.config.engine import from_offload_mapping, offload_mapping
from service.models.pipeline import PipelineRunner
from service.models.request import GenerationRequest

REQ = GenerationRequest(prompt="a red fox running through snow", seed=7)  # CFG: 4 forwards


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.fixture(scope="module")
def fp8_model(demo_model: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    dst = tmp_path_factory.mktemp("fp8") / "model"
    assert cli_main(["quantize", demo_model, str(dst), "--quiet"]) == 0
    return str(dst)


def _frames(model: str, cfg: EngineConfig) -> tuple[np.ndarray, dict | None, dict]:
    runner = PipelineRunner.load(model, "cpu", config=cfg)
    try:
        return runner.frames(REQ), runner.offload_stats(), runner.describe()
    finally:
        runner.close()


def test_quantize_writes_the_same_layout(demo_model: str, fp8_model: str) -> None:
    src, dst = Path(demo_model), Path(fp8_model)
    fp8 = EngineConfig(model=ModelConfig(quantization="fp8"))
    online = PipelineRunner.load(demo_model, "cpu", config=fp8)
    stored = PipelineRunner.load(fp8_model, "cpu", config=fp8)
    try:  # the folder's transformer is the one the load quantizes, every tensor bit for bit
        a, b = online.transformer.state_dict(), stored.transformer.state_dict()
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype, key
            assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), key
    finally:
        online.close()
        stored.close()
    files = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(dst) for p in dst.rglob("*") if p.is_file())
    for rel in files:
        if rel.parts[0] != "transformer" or rel.suffix != ".safetensors":
            assert (src / rel).read_bytes() == (dst / rel).read_bytes(), rel
    head = (dst / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()
    header = json.loads(head[8 : 8 + int.from_bytes(head[:8], "little")])
    assert header["blocks.0.ffn.net.0.proj.weight"]["dtype"] == "F8_E4M3"
    assert header["blocks.0.ffn.net.0.proj.weight_scale"]["dtype"] == "F32"
    assert header["blocks.0.ffn.net.0.proj.bias"]["dtype"] == "F32"  # biases as stored
    assert header["condition_embedder.text_embedder.linear_1.weight"]["dtype"] == "F32"  # not a block
    assert header["blocks.0.scale_shift_table"]["dtype"] == "F32"
    assert cli_main(["quantize", demo_model, fp8_model, "--quiet"]) == 2  # not an empty folder


def test_fp8_strategies_give_one_output(demo_model: str, fp8_model: str, resident: PipelineRunner) -> None:
    runs = {
        "resident-online": (demo_model, EngineConfig(model=ModelConfig(quantization="fp8"))),
        "resident-prequantized": (fp8_model, EngineConfig(model=ModelConfig(quantization="fp8"))),
        "allgather-online": (demo_model, EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER),
                                                      model=ModelConfig(quantization="fp8"))),
        "allgather-prequantized": (fp8_model, EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER),
                                                           model=ModelConfig(quantization="fp8"))),
        "ranklocal-prequantized": (fp8_model, EngineConfig(offload=OffloadConfig(OffloadMode.RANK_LOCAL),
                                                           model=ModelConfig(quantization="fp8"))),
    }
    frames, digests = {}, {}
    for name, (model, cfg) in runs.items():
        frames[name], stats, info = _frames(model, cfg)
        digests[name] = sha(frames[name].tobytes())
        assert info["quantization"] == "fp8"
        if stats is not None:
            assert stats["quantization_source"] == name.split("-")[1]
            assert "torch.float8_e4m3fn" in stats["block_bytes_by_dtype"]
    assert len(set(digests.values())) == 1, digests  # one output, whatever the strategy and the source
    ref = resident.frames(REQ)
    assert digests["resident-online"] != sha(ref.tobytes())  # quantization changed something
    print(f"tiny demo, fp8 vs fp32 frames: PSNR {psnr(frames['allgather-online'], ref):.1f} dB")
    assert psnr(frames["allgather-online"], ref) > 25


def test_a_quantize_folder_and_fp8_at_load_generate_the_same_bytes(tmp_path: Path) -> None:
    """``dloserve generate`` on the folder and on its source with ``--quantization fp8``, at a
    size whose frames differed in the last bits while the views kept the files' alignment."""
    from service.models.demo import ensure_demo_model

    src, folder = str(ensure_demo_model("tiny")), str(tmp_path / "fp8")
    assert cli_main(["quantize", src, folder, "--quiet"]) == 0
    size = ["--height", "48", "--width", "64", "--num-frames", "9", "--prompt", "a cat", "--seed", "7",
            "--quiet"]
    outs = {}
    for name, args in (("online", ["--model", src, "--quantization", "fp8"]),
                       ("folder", ["--model", folder])):
        outs[name] = tmp_path / f"{name}.mp4"
        assert cli_main(["generate", *args, *size, "--out", str(outs[name])]) == 0
    assert outs["online"].read_bytes() == outs["folder"].read_bytes()


def test_fp8_in_bf16_serving(demo_model: str) -> None:
    """bf16 serving: fp32-kept modules stay fp32, scales fp32, block Linears compute in bf16."""
    got = {}
    runs = {"resident": EngineConfig(model=ModelConfig(dtype="bfloat16", quantization="fp8")),
            "allgather": EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER),
                                      model=ModelConfig(dtype="bfloat16", quantization="fp8"))}
    for name, cfg in runs.items():
        frames, stats, _ = _frames(demo_model, cfg)
        got[name] = sha(frames.tobytes())
        if stats is not None:
            assert set(stats["block_bytes_by_dtype"]) == {"torch.float8_e4m3fn", "torch.bfloat16",
                                                          "torch.float32"}
    assert got["resident"] == got["allgather"]


def _dp2(rank: int, world: int, src: str, fp8: str) -> dict:
    out = {}
    for name, model, allgather in (("allgather-online", src, True), ("ranklocal-prequantized", fp8, False)):
        mode = OffloadMode.ALLGATHER if allgather else OffloadMode.RANK_LOCAL
        runner = PipelineRunner.load(model, "cpu", config=EngineConfig(offload=OffloadConfig(mode),
                                                                       model=ModelConfig(quantization="fp8")),
                                     group=dist.group.WORLD)
        if rank == 1:  # rank 1 runs the request, rank 0 idle-replays its gathers
            out[name] = sha(runner.generate(REQ))
        else:
            runner.idle(REQ)
        out[name + "-stats"] = runner.offload_stats()
        runner.close()
    return out


@pytest.mark.e2e  # spawned DP2 ranks (tests/offload/test_fp8.py keeps a DP2 gloo check fast)
def test_dp2_spawned_ranks_match_dp1(demo_model: str, fp8_model: str) -> None:
    res = run_ranks(_dp2, 2, demo_model, fp8_model, timeout=None)
    want = {}  # each source's DP1 output (one source's against the other's: test_fp8_strategies_...)
    for name, model in (("allgather-online", demo_model), ("ranklocal-prequantized", fp8_model)):
        runner = PipelineRunner.load(model, "cpu", config=EngineConfig(model=ModelConfig(quantization="fp8")))
        try:
            want[name] = sha(runner.generate(REQ))
        finally:
            runner.close()
    assert res[1]["allgather-online"] == want["allgather-online"]
    assert res[1]["ranklocal-prequantized"] == want["ranklocal-prequantized"]
    ag = res[0]["allgather-online-stats"]
    assert ag["idle_forwards"] == REQ.forwards() and ag["gathered_bytes"] > 0 and ag["world_size"] == 2


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p, GENERATE)
    return p.parse_args(list(argv))


def _config(*argv: str) -> EngineConfig:
    return EngineArgs.from_namespace(_args(*argv)).to_config()


def test_the_flag() -> None:
    resident = _config("--quantization", "fp8")  # resident fp8 is fine
    assert resident == EngineConfig(model=ModelConfig(quantization="fp8"))
    assert EngineConfig(**from_offload_mapping(offload_mapping(resident), OffloadMode.AUTO)) == resident
    cfg = _config("--quantization", "fp8", "--enable-distributed-layerwise-offload",
                  "--dlo-mode", "rank-local")
    assert (cfg.model.quantization, cfg.offload.mode.gathers) == ("fp8", False)
    with pytest.raises(FlagError, match="--quantization"):
        _config("--quantization", "fp8", "--enable-distributed-layerwise-offload",
                "--sequence-parallel-size", "2")
    with pytest.raises(SystemExit):
        _args("--quantization", "int8")


def test_auto_mode_probes_the_fp8_blocks(fp8_model: str) -> None:
    """The load-time probe runs the quantized transformer and times fp8-sized blocks."""
    cfg = EngineConfig(offload=OffloadConfig(OffloadMode.AUTO, probe_shape=(32, 32, 5)),
                       model=ModelConfig(quantization="fp8"))
    runner = PipelineRunner.load(fp8_model, "cpu", config=cfg)
    try:
        choice = runner.config.choice
        assert choice is not None and choice.timings is not None
        stats = runner.offload_stats()
        assert choice.timings.block_bytes == stats["largest_block_bytes"]
        assert stats["quantization_source"] == "prequantized" and stats["mode"] == choice.mode.value
    finally:
        runner.close()


def test_a_quantized_folder_is_fp8_without_the_flag(demo_model: str, fp8_model: str, tmp_path: Path) -> None:
    """The folder carries its quantization (issue 34): --quantization auto (the default) reads
    it as fp8, the same frames as asking for fp8; none is refused before anything loads,
    naming the flag; an unquantized folder stays as stored."""
    from service.models.registry import load_adapter

    assert _config().model.quantization is None  # auto
    assert _config("--quantization", "none").model.quantization == "none"
    own, stats, described = _frames(fp8_model, EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER)))
    asked, _, _ = _frames(fp8_model, EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER),
                                                  model=ModelConfig(quantization="fp8")))
    assert np.array_equal(own, asked)
    assert stats["quantization"] == "fp8" and stats["quantization_source"] == "prequantized"
    assert described["quantization"] == "fp8"
    fp8, plain = load_adapter(fp8_model), load_adapter(demo_model)
    assert (fp8.stored_quantization(), plain.stored_quantization()) == ("fp8", None)
    refuse = EngineConfig(model=ModelConfig(quantization="none"))
    assert "drop the flag" in (refuse.probe_problem(fp8, "cpu") or "")
    assert EngineConfig(model=ModelConfig(quantization="none")).probe_problem(plain, "cpu") is None
    assert EngineConfig().probe_problem(fp8, "cpu") is None
    out = tmp_path / "x.mp4"
    assert cli_main(["generate", "--model", fp8_model, "--prompt", "x", "--quantization", "none",
                     "--out", str(out)]) == 2
    assert not out.exists()
