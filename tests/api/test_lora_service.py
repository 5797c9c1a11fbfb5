"""Adapters through the service (fake executor, in-process job store) and ``dloserve generate``.

Registration at start and at run time, owner rules with API keys, resolution of a request's
names to checked files, refusals (4xx-shaped errors naming adapter and key) before anything
reaches a rank, and the compatibility key that ignores the adapter set.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from service.api.jobs import JobStore
from service.api.schemas import BodyError
from service.api.service import ServiceConfig, VideoService
from service.models.demo.lora import write_demo_lora
from service.models.lora_ref import LoraError
from tests.fakes import FakeExecutor
from tests.test_cli import dloserve

BODY = {"prompt": "a red fox", "seed": 1, "num_inference_steps": 2}


@pytest.fixture(scope="module")
def lora_dir(demo_model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("loras")
    write_demo_lora(demo_model, d / "style.safetensors", rank=4)
    write_demo_lora(demo_model, d / "distill.safetensors", rank=2, layout="kohya", seed=3)
    t = load_file(d / "style.safetensors")
    key = "transformer.blocks.1.attn2.to_k.lora_B.weight"
    t[key] = t[key][:-1]  # one row short: the wrong shape for this model
    save_file(t, d / "bad.safetensors")
    return d


def make(demo_model: str, tmp: Path, **cfg: object) -> tuple[VideoService, FakeExecutor, JobStore]:
    ex = FakeExecutor((1,), {})
    store = JobStore(str(tmp), {}, 3600.0, 100, 30.0)
    svc = VideoService(ServiceConfig(model=demo_model, results_url=str(tmp), **cfg), executor=ex,
                       store=store, node_id="node-1")
    return svc, ex, store


@pytest.fixture
def service(demo_model: str, lora_dir: Path, tmp_path: Path) -> Iterator[tuple[VideoService, FakeExecutor]]:
    svc, ex, store = make(demo_model, tmp_path, loras={"style": str(lora_dir / "style.safetensors")},
                          lora_dir=[str(lora_dir)])
    try:
        yield svc, ex
    finally:
        svc.close()
        store.close()


def test_request_names_resolve_to_checked_files(service, lora_dir: Path) -> None:  # noqa: ANN001
    svc, ex = service
    [entry] = svc.list_loras()
    digest = hashlib.sha256((lora_dir / "style.safetensors").read_bytes()).hexdigest()
    assert entry.public()["sha256"] == digest and entry.public()["layout"] == "peft"
    assert "source" not in entry.public()  # the server's paths are not told
    plain = svc.create(dict(BODY))
    styled = svc.create({**BODY, "loras": [{"name": "style", "scale": 0.5}]})
    ex.wait_assigned(plain.id)
    ex.run(plain.id)  # one rank: the next job starts when this one ends
    ex.wait_assigned(styled.id)
    reqs = {job: req for _, _, job, req in ex.assigned}
    [ref] = reqs[styled.id].loras
    want = ("style", 0.5, str(lora_dir / "style.safetensors"), digest)
    assert (ref.name, ref.scale, ref.source, ref.sha256) == want
    assert reqs[plain.id].loras == ()
    assert reqs[plain.id].compat_key() == reqs[styled.id].compat_key()  # not in the key


def test_the_video_object_says_which_adapters_and_cache_it_asked_for(service) -> None:  # noqa: ANN001
    """So a client (the playground's remix) can ask for the same again."""
    from service.api.service import video_object

    svc, _ = service
    cache = {"method": "first_block", "threshold": 0.1}
    asked = svc.create({**BODY, "loras": [{"name": "style", "scale": 0.5}], "cache": cache})
    plain = svc.create(dict(BODY))
    for rec in (asked, plain):  # as accepted and as the store reads it back
        assert svc.store.get(rec.id).loras == rec.loras
    v = video_object(svc.store.get(asked.id))
    assert v["loras"] == [{"name": "style", "scale": 0.5, "expert": None}]
    assert {k: x for k, x in v["cache"].items() if x is not None} == cache
    assert video_object(svc.store.get(plain.id))["loras"] == [] and video_object(plain)["cache"] is None


def test_refusals_name_the_adapter(service, lora_dir: Path, tmp_path: Path) -> None:  # noqa: ANN001
    svc, ex = service
    with pytest.raises(BodyError) as e:
        svc.create({**BODY, "loras": [{"name": "nope"}]})
    assert e.value.field == "loras[0].name" and "unknown adapter 'nope'" in e.value.message
    with pytest.raises(BodyError) as e:
        svc.create({**BODY, "loras": [{"name": "style", "scale": 99}]})
    assert e.value.field == "loras[0].scale"
    with pytest.raises(BodyError) as e:
        svc.create({**BODY, "loras": [{"name": "style", "weight": 1}]})
    assert e.value.field.startswith("loras.0")
    with pytest.raises(LoraError) as le:
        svc.add_lora("bad", str(lora_dir / "bad.safetensors"))
    assert le.value.adapter == "bad" and le.value.key == "transformer.blocks.1.attn2.to_k.lora_B.weight"
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes((lora_dir / "style.safetensors").read_bytes())
    with pytest.raises(PermissionError, match="--lora-dir"):
        svc.add_lora("x", str(outside))
    with pytest.raises(KeyError, match="already registered"):
        svc.add_lora("style", str(lora_dir / "distill.safetensors"))
    assert [e.name for e in svc.list_loras()] == ["style"]
    assert not ex.assigned  # nothing reached a rank


def test_register_use_delete_at_run_time(service, lora_dir: Path) -> None:  # noqa: ANN001
    svc, ex = service
    entry = svc.add_lora("distill", str(lora_dir / "distill.safetensors"))
    assert entry.public()["layout"] == "wan" and entry.public()["bias"] is True
    rec = svc.create({**BODY, "num_inference_steps": 4, "guidance_scale": 1.0,
                      "loras": [{"name": "distill"}, {"name": "style", "scale": -0.25}]})
    assert svc.delete_lora("distill")
    assert not svc.delete_lora("distill")
    ex.wait_assigned(rec.id)
    req = next(r for _, _, j, r in ex.assigned if j == rec.id)
    assert [r.name for r in req.loras] == ["distill", "style"] and all(r.resolved for r in req.loras)
    with pytest.raises(BodyError, match="unknown adapter 'distill'"):
        svc.create({**BODY, "loras": [{"name": "distill"}]})


def keyed(demo_model: str, lora_dir: Path, tmp: Path, **cfg: object) -> tuple[VideoService, FakeExecutor,
                                                                           JobStore]:
    return make(demo_model, tmp, loras={"style": str(lora_dir / "style.safetensors")},
                lora_dir=[str(lora_dir)], api_key_hashes=[hashlib.sha256(b"k").hexdigest()], **cfg)


def test_owners_see_their_own(demo_model: str, lora_dir: Path, tmp_path: Path) -> None:
    svc, _, store = keyed(demo_model, lora_dir, tmp_path)
    try:
        svc.add_lora("mine", str(lora_dir / "distill.safetensors"), owner="alice")
        assert {e.name for e in svc.list_loras("alice")} == {"style", "mine"}
        assert {e.name for e in svc.list_loras("bob")} == {"style"}
        with pytest.raises(BodyError, match="unknown adapter 'mine'"):
            svc.create({**BODY, "loras": [{"name": "mine"}]}, "bob")
        assert not svc.delete_lora("mine", "bob") and not svc.delete_lora("style", "alice")
        assert svc.delete_lora("mine", "alice")
    finally:
        svc.close()
        store.close()


def test_adapter_names_are_per_key(demo_model: str, lora_dir: Path, tmp_path: Path) -> None:
    """Two keys both register ``mine``, each from its own file: neither learns of the other's
    (no 409), each job resolves to its own key's file, and a delete removes only the caller's.
    The server's names (registered at start, usable by every key) cannot be taken."""
    svc, ex, store = keyed(demo_model, lora_dir, tmp_path)
    try:
        files = {"alice": lora_dir / "distill.safetensors", "bob": lora_dir / "style.safetensors"}
        for owner, f in files.items():
            assert svc.add_lora("mine", str(f), owner=owner).owner == owner
        digests = {o: hashlib.sha256(f.read_bytes()).hexdigest() for o, f in files.items()}
        for owner in files:
            assert [(e.name, e.sha256) for e in svc.list_loras(owner)] == [
                ("style", digests["bob"]), ("mine", digests[owner])]
        jobs = {o: svc.create({**BODY, "loras": [{"name": "mine"}]}, o).id for o in files}
        for job in jobs.values():
            ex.wait_assigned(job)
            ex.run(job)
        refs = {job: req.loras for _, _, job, req in ex.assigned}
        for owner, job in jobs.items():  # what the rank loads: this key's file, by its digest
            [ref] = refs[job]
            assert (ref.name, ref.source, ref.sha256) == ("mine", str(files[owner]), digests[owner])
        with pytest.raises(KeyError, match="one of the server's"):
            svc.add_lora("style", str(files["alice"]), owner="alice")
        with pytest.raises(KeyError, match="already registered"):
            svc.add_lora("mine", str(files["bob"]), owner="alice")
        assert svc.delete_lora("mine", "alice")
        assert [e.sha256 for e in svc.list_loras("bob") if e.name == "mine"] == [digests["bob"]]
        with pytest.raises(BodyError, match="unknown adapter 'mine'"):
            svc.create({**BODY, "loras": [{"name": "mine"}]}, "alice")
    finally:
        svc.close()
        store.close()


def test_a_key_registers_at_most_max_loras_per_key(demo_model: str, lora_dir: Path, tmp_path: Path) -> None:
    """The server's adapters do not count; another key has its own allowance; a delete frees one."""
    from service.models.lora_registry import LoraLimit

    svc, _, store = keyed(demo_model, lora_dir, tmp_path, max_loras_per_key=2)
    try:
        for name in ("a", "b"):
            svc.add_lora(name, str(lora_dir / "distill.safetensors"), owner="alice")
        with pytest.raises(LoraLimit, match=r"has 2 adapters registered, the most it may have \(2\)"):
            svc.add_lora("c", str(lora_dir / "distill.safetensors"), owner="alice")
        svc.add_lora("c", str(lora_dir / "distill.safetensors"), owner="bob")
        assert svc.delete_lora("a", "alice")
        svc.add_lora("c", str(lora_dir / "distill.safetensors"), owner="alice")
        assert [e.name for e in svc.list_loras("alice")] == ["style", "b", "c"]
    finally:
        svc.close()
        store.close()


def test_the_list_comes_in_pages(service, lora_dir: Path) -> None:  # noqa: ANN001
    svc, _ = service
    for name in ("b", "c", "d"):
        svc.add_lora(name, str(lora_dir / "distill.safetensors"))
    seen, after, more = [], None, True
    while more:
        page, more = svc.loras.page(None, after, 2)
        assert 0 < len(page) <= 2
        seen += [e.name for e in page]
        after = page[-1].name
    assert seen == ["style", "b", "c", "d"]
    assert [e.name for e in svc.loras.page(None, None, 3, "desc")[0]] == ["d", "c", "b"]
    assert svc.loras.page(None, "nope", 2) == ([], False)  # as GET /v1/videos answers an unknown id


def test_refusals_carry_no_server_path(service, lora_dir: Path, tmp_path: Path) -> None:  # noqa: ANN001
    """What a caller reads back names the adapter and its own ``source``, never a folder of the
    server's (the --lora-dir, where the file was found)."""
    svc, _ = service
    (lora_dir / "junk.safetensors").write_bytes(b"not safetensors at all")
    os.mkfifo(lora_dir / "pipe.safetensors")
    (lora_dir / "loop.safetensors").symlink_to(lora_dir / "loop.safetensors")  # resolving it raises
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(b"x")
    errors = []
    for name, source in (("junk", lora_dir / "junk.safetensors"), ("pipe", lora_dir / "pipe.safetensors"),
                         ("loop", lora_dir / "loop.safetensors"), ("out", outside)):
        with pytest.raises((LoraError, PermissionError)) as e:
            svc.add_lora(name, str(source))
        errors.append(str(e.value))
    assert "not a readable safetensors file" in errors[0] and "a FIFO" in errors[1], errors
    assert "cannot resolve it" in errors[2] and "--lora-dir folders" in errors[3], errors
    for text in errors:
        assert str(lora_dir) not in text and str(tmp_path) not in text, text
    assert all(str(lora_dir) not in str(e.public()) for e in svc.list_loras())


def test_a_bad_adapter_fails_the_start(demo_model: str, lora_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(LoraError, match="'broken'.*blocks.1.attn2.to_k.lora_B.weight"):
        make(demo_model, tmp_path, loras={"broken": str(lora_dir / "bad.safetensors")})


@pytest.mark.e2e  # a subprocess: imports torch and diffusers again
def test_generate_refuses_a_bad_adapter_before_work(demo_model: str, lora_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "x.mp4"
    r: subprocess.CompletedProcess = dloserve(
        "generate", "--model", demo_model, "--prompt", "a cat", "--out", str(out),
        "--lora", f"broken={lora_dir / 'bad.safetensors'}")
    assert r.returncode == 2 and "adapter 'broken'" in r.stderr
    assert "transformer.blocks.1.attn2.to_k.lora_B.weight" in r.stderr and not out.exists()


def test_model_dependent_fields_are_refused_at_the_edge(demo_model: str, lora_dir: Path,
                                                        tmp_path: Path) -> None:
    """What a rank would refuse is a 422 here, naming the field, and never reaches a rank: an
    adapter expert on a one-transformer model, any adapter or a step cache on a two-expert one
    (issue 31: these once got 202 and made the rank group rebuild twice)."""
    from service.models.demo import ensure_demo_model

    svc, ex, store = make(demo_model, tmp_path, loras={"style": str(lora_dir / "style.safetensors")})
    try:
        with pytest.raises(BodyError) as e:
            svc.create({**BODY, "loras": [{"name": "style", "expert": "high"}]})
        assert e.value.field == "loras[0].expert" and "one transformer" in e.value.message
        served = svc.create({**BODY, "loras": [{"name": "style", "expert": "both"}]})
        ex.wait_assigned(served.id)
        assert [job for _, _, job, _ in ex.assigned] == [served.id]  # the refused one never reached a rank
    finally:
        svc.close()
        store.close()
    two, ex2, store2 = make(str(ensure_demo_model("wan22-t2v-tiny")), tmp_path / "two")
    try:
        with pytest.raises(BodyError) as e:
            two.create({**BODY, "cache": {"method": "first_block"}})
        assert e.value.field == "cache.method" and "two-expert" in e.value.message
        two.create(dict(BODY))  # no cache: served
    finally:
        two.close()
        store2.close()
