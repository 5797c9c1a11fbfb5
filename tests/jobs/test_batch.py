"""The batch job as its own process on the session's Ray cluster: run, then resume."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.jobs.batch import read_prompts, sha256
from service.models.request import GenerationRequest

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    {"id": "fox", "prompt": "a red fox", "seed": 1},
    {"id": "owl", "prompt": "an owl at night", "seed": 2},
    {"prompt": "nine frames of rain", "seed": 3, "num_frames": 9},
]


def run_batch(ray_cluster: dict, prompts: Path, out: Path, model: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "service.jobs.batch", "--prompts", str(prompts), "--out", str(out),
           "--model", model,  # the noise preset, as `resident` (the trained default has other defaults)
           "--data-parallel-size", "2", "--cpus-per-rank", "0.5", "--address", ray_cluster["address"],
           # auto mode with every component offloaded; on CPU the probe's compute (tens of ms
           # per block) dwarfs a fill (well under 1 ms), so auto must pick rank-local
           "--dlo-mode", "auto", "--dlo-components", "dit,text_encoder,vae", "--dlo-probe-size", "32x32x5"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.e2e  # the batch job as its own process: load, run, run again
def test_batch_runs_three_then_skips_all_three(ray_cluster: dict, tmp_path: Path, resident,  # noqa: ANN001
                                               demo_model: str) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    out = tmp_path / "out"
    first = run_batch(ray_cluster, prompts, out, demo_model)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "3 to run" in first.stdout and "3 completed, 0 failed" in first.stdout
    assert "videos" in first.stderr  # the tqdm bar
    assert "--dlo-mode auto chose rank-local: compute covers the rank-local fill" in first.stdout
    manifest = [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()]
    assert sorted(e["id"] for e in manifest) == ["fox", "item-00003", "owl"]
    for e in manifest:
        assert e["status"] == "completed" and sha256(out / e["file"]) == e["sha256"]
        stages = {"queue_s", "text_encode_s", "denoise_s", "decode_s", "encode_s", "store_s"}
        assert stages <= set(e["timings"]), e
    assert (out / "fox.mp4").read_bytes() == resident.generate(GenerationRequest(prompt="a red fox", seed=1))

    second = run_batch(ray_cluster, prompts, out, demo_model)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "3 already done (skipped), 0 to run" in second.stdout
    assert len((out / "manifest.jsonl").read_text().splitlines()) == 3


def test_bad_prompt_file_is_rejected_before_any_worker(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": "x", "colour": 1}\n')
    try:
        read_prompts(bad)
    except ValueError as e:
        assert "bad.jsonl:2" in str(e) and "colour" in str(e)
    else:
        raise AssertionError("no error")
    r = subprocess.run([sys.executable, "-m", "service.jobs.batch", "--prompts", str(bad),
                        "--out", str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "colour" in r.stderr


def test_unsplittable_item_is_rejected_before_ray(tmp_path: Path, demo_model: str, capsys) -> None:  # noqa: ANN001
    """--sequence-parallel-size 2: a 27-token item (48x48x9) fails the file, naming it and the field."""
    from service.jobs.batch import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "ok", "prompt": "a", "height": 48, "width": 48}\n'
                       '{"id": "odd", "prompt": "b", "height": 48, "width": 48, "num_frames": 9}\n')
    out = tmp_path / "o"
    assert main(["--prompts", str(prompts), "--out", str(out), "--model", demo_model,
                 "--sequence-parallel-size", "2"]) == 2
    assert "item odd: num_frames: " in capsys.readouterr().err
    assert not out.exists()  # nothing started, not even the output folder


def test_a_lines_priority_is_read_and_one_out_of_range_fails_the_file(tmp_path: Path, demo_model: str,
                                                                     capsys) -> None:  # noqa: ANN001
    from service.jobs.batch import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "first", "prompt": "a", "priority": -3}\n{"id": "later", "prompt": "b"}\n')
    assert [(i, r.priority) for i, r in read_prompts(prompts)] == [("first", -3), ("later", 0)]
    prompts.write_text('{"id": "ok", "prompt": "a"}\n{"id": "pushy", "prompt": "b", "priority": -101}\n')
    out = tmp_path / "o"
    assert main(["--prompts", str(prompts), "--out", str(out), "--model", demo_model]) == 2
    assert "item pushy: priority: must be in [-100, 100]" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.e2e  # the batch job as its own process on DP2, then the resident reference
def test_batch_image_lines_two_experts_equal_resident(ray_cluster: dict, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Wan2.2 A14B I2V (tiny): image lines by relative path and by fsspec URL, DP2 AllGather;
    each MP4 is the resident pipeline's (which `dloserve generate --image` is: test_images_http)."""
    from service.models.demo import ensure_demo_model
    from service.models.pipeline import PipelineRunner
    from tests.api.test_images import png

    model = str(ensure_demo_model("wan22-i2v-tiny"))
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png(56, 40, seed=3))
    (tmp_path / "b.png").write_bytes(png(40, 40, seed=4))
    lines = [{"id": "rel", "prompt": "a red fox", "seed": 1, "image": "img/a.png", "guidance_scale_2": 2.0},
             {"id": "url", "prompt": "an owl", "seed": 2, "num_inference_steps": 3,
              "image": (tmp_path / "b.png").as_uri()}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "service.jobs.batch", "--prompts", str(prompts), "--out", str(out),
           "--model", model, "--data-parallel-size", "2", "--cpus-per-rank", "0.5", "--dlo-mode", "allgather",
           "--address", ray_cluster["address"]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = {e["id"]: e for e in map(json.loads, (out / "manifest.jsonl").read_text().splitlines())}
    runner = PipelineRunner.load(model, "cpu")
    try:
        for item_id, req in read_prompts(prompts):
            assert manifest[item_id]["status"] == "completed"
            assert manifest[item_id]["request"]["image_sha256"] == hashlib.sha256(req.image).hexdigest()
            assert (out / f"{item_id}.mp4").read_bytes() == runner.generate(req), item_id
    finally:
        runner.close()
    # main() in this process: the refusal comes before any work (a subprocess: ~5 s of imports;
    # the batch job's real exit code 2 is test_bad_prompt_file_is_rejected_before_any_worker's)
    from service.jobs.batch import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "image": "img/missing.png"}\n')
    capsys.readouterr()
    assert main(["--prompts", str(bad), "--out", str(tmp_path / "o"), "--model", model]) == 2
    assert "bad.jsonl:1: image: cannot read" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_batch_images_stay_under_the_prompts_folder_or_image_root(tmp_path: Path) -> None:
    """A prompts file cannot make the job read (or quote) a file outside its folder."""
    from tests.api.test_images import png

    inside, outside = tmp_path / "job", tmp_path / "elsewhere"
    inside.mkdir()
    outside.mkdir()
    (outside / "a.png").write_bytes(png(40, 40))
    (outside / "secret.png").write_text("SECRET-TOKEN-0123456789")
    (inside / "link.png").symlink_to(outside / "a.png")
    (inside / "big.png").write_bytes(png(40, 40) + b"\0" * (16 * 2**20))
    (inside / "notes.png").write_text("SECRET-TOKEN-0123456789")
    prompts = inside / "p.jsonl"

    def error_of(image: str, root: str | None = None) -> str:
        prompts.write_text(json.dumps({"prompt": "x", "image": image}) + "\n")
        try:
            read_prompts(prompts, root)
        except ValueError as e:
            return str(e)
        return ""

    for image in ("../elsewhere/a.png", str(outside / "a.png"), (outside / "a.png").as_uri(), "link.png",
                  "/etc/passwd", "https://example.com/a.png"):
        assert "is outside" in error_of(image), image
    assert "over the limit" in error_of("big.png")
    for image, root in (("notes.png", None), ("../elsewhere/secret.png", str(outside))):
        message = error_of(image, root)
        assert "not a PNG" in message and "SECRET" not in message, message
    assert error_of("../elsewhere/a.png", str(outside)) == ""  # --image-root lets it in
