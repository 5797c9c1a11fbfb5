"""``dloserve`` as a user runs it: the e2e tests in subprocesses, the two fast ones through
the command's ``main()`` in this process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.cli import main as cli_main
from service.models.request import GenerationRequest
from service.models.video import decode_mp4

ROOT = Path(__file__).resolve().parents[1]


def dloserve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """``dloserve ARGS`` through main() in this process, which must exit 2; its stderr. The
    refusals below come before any work, so a subprocess (~5 s of imports each) showed nothing
    more: test_bad_request_fails_before_work keeps one real process's exit code 2."""
    capsys.readouterr()
    try:
        rc = cli_main(list(args))
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err[-3000:]
    return err


# The two fast tests call the command's main() in this process: a subprocess spent ~15 s of
# make test's time importing torch and diffusers again, for what the e2e tests below (each a
# real `dloserve` subprocess) show already; the command's own code paths are the same.
def test_generate_with_no_model_uses_the_trained_demo_and_its_defaults(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "circle.mp4"
    # No --model: the committed trained model, at the request its folder names as default
    # (64x64, 17 frames); --steps still wins over the folder's 20.
    assert cli_main(["generate", "--prompt", "a red circle moving right on a black background", "--seed", "1",
                     "--steps", "4", "--out", str(out)]) == 0, capsys.readouterr().err[-3000:]
    r = capsys.readouterr()
    assert "denoising" in r.err  # the progress bar over steps
    assert f"wrote {out}" in r.out and "resident, DP1" in r.out and "17 frames 64x64" in r.out
    assert decode_mp4(out.read_bytes()).shape == (17, 64, 64, 3)


@pytest.mark.e2e  # two spawned rank processes; the engine's DP2 equality is in tests/engine/test_local.py
def test_generate_dlo_two_ranks_matches_resident(tmp_path: Path, demo_model: str, resident) -> None:  # noqa: ANN001
    """N=2 local processes (gloo), AllGather DLO: the bytes of the in-process resident run."""
    out = tmp_path / "b.mp4"
    r = dloserve(
        "generate", "--model", demo_model, "--prompt", "a cat", "--seed", "2", "--quiet", "--out", str(out),
        "--data-parallel-size", "2", "--enable-distributed-layerwise-offload", "--dlo-mode", "allgather",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "allgather, DP2" in r.stdout
    assert out.read_bytes() == resident.generate(GenerationRequest(prompt="a cat", seed=2))


def test_generate_with_offload_is_auto_by_default_and_says_what_it_chose(
        tmp_path: Path, demo_model: str, resident, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    out = tmp_path / "auto.mp4"
    assert cli_main(["generate", "--model", demo_model, "--prompt", "a cat", "--seed", "2", "--quiet",
                     "--out", str(out), "--enable-distributed-layerwise-offload"]) == 0, \
        capsys.readouterr().err[-3000:]
    stdout = capsys.readouterr().out
    # the probe ran at the request's own size; on CPU compute covers any fill
    assert "[auto: rank-local (compute covers the rank-local fill" in stdout, stdout
    assert out.read_bytes() == resident.generate(GenerationRequest(prompt="a cat", seed=2))


@pytest.mark.e2e  # `dloserve` subprocesses
def test_bad_request_fails_before_work(tmp_path: Path, demo_model: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x.mp4"
    r = dloserve("generate", "--model", demo_model, "--prompt", "a cat", "--height", "40", "--out", str(out))
    assert r.returncode == 2 and "height: must be a multiple of 16" in r.stderr
    assert not out.exists()
    assert "model_index.json" in refused(capsys, "generate", "--model", str(tmp_path), "--prompt", "a cat")


@pytest.mark.e2e  # with the other `dloserve` tests (main() in this process: ~1 s)
def test_sequence_parallel_refuses_before_any_process(tmp_path: Path, demo_model: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """48x48x9 on the demo model is 3 x 3 x 3 = 27 tokens: not two equal halves."""
    out = tmp_path / "x.mp4"
    err = refused(capsys, "generate", "--model", demo_model, "--prompt", "a cat", "--height", "48",
                  "--width", "48", "--num-frames", "9", "--sequence-parallel-size", "2",
                  "--enable-distributed-layerwise-offload", "--out", str(out))
    assert "num_frames: " in err and "27 tokens" in err, err[-2000:]
    assert not out.exists()
    err = refused(capsys, "generate", "--prompt", "a cat", "--usp", "2", "--data-parallel-size", "2")
    assert "one SP group" in err, err[-2000:]
    err = refused(capsys, "generate", "--model", demo_model, "--prompt", "a cat", "--usp", "2",
                  "--enable-distributed-layerwise-offload", "--dlo-resident-layers", "1", "--out", str(out))
    assert "--dlo-resident-layers: not yet with --sequence-parallel-size" in err, err[-2000:]
    assert not out.exists()


@pytest.mark.e2e  # with the other `dloserve` tests (main() in this process: ~1 s)
def test_demo_model_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["demo-model", str(tmp_path / "m"), "--preset", "tiny", "--layers", "2"]) == 0, \
        capsys.readouterr().err[-3000:]
    assert (tmp_path / "m" / "model_index.json").is_file()
    assert (tmp_path / "m" / "transformer" / "diffusion_pytorch_model.safetensors").is_file()


@pytest.mark.e2e  # two ranks as processes, then the resident reference
def test_generate_image_to_video_and_bad_images(tmp_path: Path, demo_model: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """--image on a Wan2.2 A14B I2V model, DP2 AllGather: the resident bytes; images the model
    cannot take, or that are not images, exit 2 naming --image before any process starts."""
    from service.models.demo import ensure_demo_model
    from service.models.pipeline import PipelineRunner
    from tests.api.test_images import png

    model = str(ensure_demo_model("wan22-i2v-tiny"))
    image = tmp_path / "a.png"
    image.write_bytes(png(56, 40, seed=3))
    out = tmp_path / "i2v.mp4"
    r = dloserve("generate", "--model", model, "--prompt", "a fox", "--seed", "4", "--quiet",
                 "--out", str(out), "--image", str(image), "--data-parallel-size", "2",
                 "--enable-distributed-layerwise-offload", "--dlo-mode", "allgather")
    assert r.returncode == 0, r.stderr[-3000:]
    runner = PipelineRunner.load(model, "cpu")
    try:
        want = runner.generate(GenerationRequest(prompt="a fox", seed=4, image=image.read_bytes()))
    finally:
        runner.close()
    assert out.read_bytes() == want
    (tmp_path / "t.gif").write_bytes(b"GIF89a" + bytes(30))
    for args, text in (([str(image)], "takes no image"),
                       ([str(tmp_path / "t.gif")], "not a PNG, JPEG or WebP")):
        err = refused(capsys, "generate", "--model", demo_model, "--prompt", "x",
                      "--out", str(tmp_path / "x.mp4"), "--image", *args)
        assert "--image: " in err and text in err, err
    err = refused(capsys, "generate", "--model", model, "--prompt", "x", "--out", str(tmp_path / "x.mp4"))
    assert "--image: wan22-i2v is image-to-video" in err, err
    assert not (tmp_path / "x.mp4").exists()
