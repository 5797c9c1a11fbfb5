"""`dloserve serve` rejects bad flags and models before starting Ray (fast)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from service.api.launch import add_arguments, config_from_args, run
from service.api.service import ServiceConfig
from service.config import ModelConfig, OffloadConfig, OffloadMode
from service.config.args import EngineArgs


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_flags_map_onto_the_service_config() -> None:
    args = parse("/m", "--data-parallel-size", "4", "--enable-distributed-layerwise-offload",
                 "--dlo-no-use-allgather", "--max-wait-ms", "20", "--queue-size", "9", "--max-steps", "7",
                 "--job-retries", "0")
    with pytest.warns(FutureWarning, match="--dlo-no-use-allgather is deprecated: use --dlo-mode rank-local"):
        cfg = config_from_args(args, gpus_per_rank=1.0)
    engine = cfg.engine_config("/m")
    assert cfg.data_parallel_size == 4 and cfg.queue_size == 9
    assert engine.offload == OffloadConfig(OffloadMode.RANK_LOCAL)
    assert cfg.job_retries == 0 and config_from_args(parse("/m"), 0.0).job_retries == 1
    assert cfg.max_steps == 7 and cfg.max_wait_ms == 20
    assert engine.parallel.bundles() == [{"CPU": 1.0, "GPU": 1.0}] * 4
    assert engine.parallel.device == "cuda"
    args = parse("/m", "--enable-distributed-layerwise-offload", "--dlo-mode", "auto",
                 "--dlo-resident-layers", "3", "--dlo-components", "vae,dit",
                 "--dlo-probe-size", "1280x720x81", "--dtype", "bfloat16")
    cfg = config_from_args(args, gpus_per_rank=1.0)
    flags = EngineArgs.from_namespace(args).to_config(gpus_per_rank=1.0)
    assert flags.offload == OffloadConfig(OffloadMode.AUTO, resident_layers=3, components=("dit", "vae"),
                                          probe_shape=(720, 1280, 81))
    assert flags.model == ModelConfig(dtype="bfloat16")
    assert cfg.engine_config() == flags  # the same config all the way down
    assert ServiceConfig(**cfg.model_dump()).engine_config() == flags  # through Serve's args and back


def test_the_serve_config_offload_mapping_keeps_working() -> None:
    """The Serve config's flat ``offload`` mapping (deploy/serve.yaml) still sets every concern;
    the removed ``use_allgather`` key is refused naming what to write instead."""
    cfg = ServiceConfig(offload={"mode": "rank-local", "dtype": "bfloat16", "lora_cache_gb": 1,
                                 "cache": "first_block", "cfg_batch": "off"})
    engine = cfg.engine_config("/m")
    assert engine.offload.mode is OffloadMode.RANK_LOCAL and engine.model.dtype == "bfloat16"
    assert engine.lora.cache_gb == 1 and engine.step_cache.method == "first_block"
    assert engine.model.cfg_batch == "off"
    assert ServiceConfig().engine_config().offload.mode is OffloadMode.AUTO  # no mode: auto, as always
    sp = ServiceConfig(sequence_parallel_size=2)
    assert sp.engine_config().offload.mode is OffloadMode.ALLGATHER  # SP: one mode
    with pytest.raises(ValueError, match="offload.use_allgather is gone: write offload.mode"):
        ServiceConfig(offload={"use_allgather": False})
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['residnet_layers'\]"):
        ServiceConfig(offload={"residnet_layers": 2})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data-parallel-size", "0"], "--data-parallel-size"),
        (["--dlo-no-use-allgather"], "--enable-distributed-layerwise-offload"),
        (["/does/not/exist"], "does not exist"),
        (["--dlo-mode", "auto"], "--dlo-mode: needs --enable-distributed-layerwise-offload"),
        (["--sequence-parallel-size", "2", "--enable-distributed-layerwise-offload",
          "--dlo-no-use-allgather"], "gathers each block over the SP group"),
        (["--enable-distributed-layerwise-offload", "--dlo-components", "dit,unet"], "--dlo-components"),
        (["--enable-distributed-layerwise-offload", "--dlo-device-memory-gb", "-1"],
         "--dlo-device-memory-gb"),
        (["--enable-distributed-layerwise-offload", "--dlo-probe-size", "832x480"], "--dlo-probe-size"),
        (["--enable-distributed-layerwise-offload", "--dlo-no-use-allgather", "--dlo-mode", "allgather"],
         "contradicts"),
        (["--lora", "style=/no/such.safetensors"], "--lora 'style=/no/such.safetensors': no such file"),
        (["--lora", "style=https://example.com/s.safetensors"], "URL sources are not supported"),
    ],
)
def test_bad_flags_exit_2_without_starting_ray(argv: list[str], message: str, capsys,
                                               tmp_path: Path) -> None:  # noqa: ANN001
    assert run(parse(*argv)) == 2
    assert message in capsys.readouterr().err


def test_a_negative_job_retries_is_refused_naming_the_flag(capsys) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit) as e:
        parse("--job-retries", "-1")
    assert e.value.code == 2 and "--job-retries: must be 0 or more, got -1" in capsys.readouterr().err


def test_the_key_file_gives_keys_their_own_limits(tmp_path: Path) -> None:
    from service.api.keys import key_hash, owner_id

    keys = tmp_path / "keys"
    keys.write_text("# tenants\nsk-plain\n\nsk-big max_queued=8 max_running=2\n  sk-small max_queued=1\n"
                    "sk-urgent min_priority=-5\n")
    cfg = config_from_args(parse("/m", "--api-key-file", str(keys), "--max-queued-per-key", "4"), 0.0)
    assert sorted(cfg.api_key_hashes) == sorted(key_hash(k) for k in ("sk-plain", "sk-big", "sk-small",
                                                                        "sk-urgent"))
    assert cfg.key_quotas == {key_hash("sk-big"): {"max_queued": 8, "max_running": 2},
                              key_hash("sk-small"): {"max_queued": 1},
                              key_hash("sk-urgent"): {"min_priority": -5}}
    tenants = cfg.tenants()
    assert tenants.quota(owner_id(key_hash("sk-plain"))).max_queued == 4
    big = tenants.quota(owner_id(key_hash("sk-big")))
    assert (big.max_queued, big.max_running) == (8, 2)
    assert tenants.quota(owner_id(key_hash("sk-small"))).max_running is None
    assert tenants.quota(owner_id(key_hash("sk-urgent"))).min_priority == -5
    assert tenants.quota(owner_id(key_hash("sk-plain"))).min_priority == 0  # no promotion unless given


@pytest.mark.parametrize("line", ["sk-x max_queued", "sk-x max_queued=0", "sk-x burst=3",
                                  "sk-x max_running=two", "sk-x min_priority=-101", "sk-x min_priority=top"])
def test_a_key_file_line_it_cannot_read_exits_2_naming_the_line(line: str, capsys, tmp_path: Path,  # noqa: ANN001
                                                                  demo_model: str) -> None:
    import socket

    keys = tmp_path / "keys"
    keys.write_text(f"sk-fine\n{line}\n")
    with socket.socket() as busy:  # should the file be read, the start still ends here (exit 2)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        assert run(parse(demo_model, "--api-key-file", str(keys), "--port", port,
                         "--results-dir", str(tmp_path / "r"))) == 2
    err = capsys.readouterr().err
    assert f"{keys}:2:" in err and "already in use" not in err


def test_a_start_removes_stale_results_folders_of_stopped_instances(monkeypatch, capsys, tmp_path: Path,
                                                                    # noqa: ANN001
                                                                     demo_model: str) -> None:
    """Through `dloserve serve` itself: it exits 2 on the busy port, after the cleaning."""
    import fcntl
    import os
    import socket
    import time

    monkeypatch.setenv("HOME", str(tmp_path))
    root = tmp_path / ".cache" / "dloserve" / "results"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        old = time.time() - 7200

        def folder(name: str, *files: str, age: float = old) -> Path:
            d = root / name
            d.mkdir(parents=True)
            for f in files:
                (d / f).write_bytes(b"x")
                os.utime(d / f, (age, age))
            os.utime(d, (age, age))
            return d

        job = "video_" + "0" * 32
        stale = folder("port-1111", ".lock", f"{job}.json", f"{job}.mp4")
        fresh = folder("port-2222", f"{job}.json", age=time.time())
        running = folder("port-3333", ".lock", f"{job}.json")
        foreign = folder("port-4444", f"{job}.json", "notes.txt")
        other = folder("mine", f"{job}.json")
        own = folder(f"port-{port}", f"{job}.json")  # this start's port: reused, not removed
        with open(running / ".lock", "a+") as held:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # an instance runs there
            assert run(parse(demo_model, "--port", str(port), "--retention-s", "3600")) == 2
    err = capsys.readouterr().err
    assert "already in use" in err and f"removed the results folder of a stopped instance: {stale}" in err
    assert not stale.exists()
    assert all(d.exists() for d in (fresh, running, foreign, other, own))


def test_a_key_files_byte_order_mark_is_no_part_of_its_first_key(tmp_path: Path) -> None:
    from service.api.keys import key_hash

    keys = tmp_path / "keys"
    keys.write_bytes("sk-bom-0123456789abcdef\nsk-second-0123456789\n".encode("utf-8-sig"))
    cfg = config_from_args(parse("/m", "--api-key-file", str(keys)), 0.0)
    assert sorted(cfg.api_key_hashes) == sorted(key_hash(k) for k in ("sk-bom-0123456789abcdef",
                                                                       "sk-second-0123456789"))


def test_short_keys_are_warned_about_at_start(capsys, tmp_path: Path,
                                              demo_model: str) -> None:  # noqa: ANN001
    import socket

    with socket.socket() as busy:  # the start ends on the busy port (exit 2), after the key checks
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        assert run(parse(demo_model, "--api-key", "k", "--api-key", "sk-long-enough-0123456789",
                         "--port", port, "--results-dir", str(tmp_path / "r"))) == 2
    err = capsys.readouterr().err
    assert "1 API key(s) shorter than 16 characters" in err and "sk-long" not in err


def test_no_module_uses_rays_private_api() -> None:
    """One start path on Ray's public API (docs/operate.md, "Start-up"): nothing imports
    ``ray._private`` or ``ray.serve._private``, or patches Ray's constants."""
    import re

    root = Path(__file__).resolve().parents[2]
    private = re.compile(r"\bray(\.serve)?\._private\b|\bray_constants\b|\bpy_executable\b")
    found = [str(p.relative_to(root)) for p in sorted((root / "service").rglob("*.py"))
             if private.search(p.read_text())]
    assert found == []


def test_the_job_store_the_launcher_starts_is_the_one_the_replica_connects_to(ray_cluster: dict,
                                                                              tmp_path: Path) -> None:
    """The launcher starts the job store beside Serve's start (``launch._start_store``): the replica's
    own connect (as ``VideoService`` makes it) finds that actor, not a new one."""
    import ray

    from service.api.jobs import NAMESPACE, stop_store, store_name
    from service.api.launch import _start_store
    from service.api.results import open_storage
    from service.api.service import connect_job_store

    cfg = ServiceConfig(results_url=str(tmp_path / "results"), max_jobs=7)
    url = open_storage(cfg.results_url, cfg.storage_options).url
    try:
        _start_store(cfg)
        early = ray.get_actor(store_name(url), namespace=NAMESPACE)
        client = connect_job_store(cfg, url)  # the replica's call
        assert client.handle._actor_id == early._actor_id
        assert ray.get(early.status.remote())["jobs"] == 0
    finally:
        stop_store(url)


def test_cpus_per_rank_comes_from_the_flag_then_the_host_then_the_default(ray_cluster: dict) -> None:
    """``--cpus-per-rank`` wins; on a cluster of our own the host sizes it (this one's 2 CPUs,
    less the ingress's: the floor of 1); a joined cluster keeps the old default. The reason
    goes to /readyz (test_service.py) and the log."""
    from service.api.launch import _size_ranks as size_ranks
    from service.config.parallel import CPUS_PER_RANK

    p = argparse.ArgumentParser()
    add_arguments(p)
    given = p.parse_args(["/m", "--cpus-per-rank", "3"])
    size_ranks(given, own_cluster=True)
    assert (given.cpus_per_rank, given.cpus_per_rank_why) == (3.0, "--cpus-per-rank")
    host = p.parse_args(["/m"])
    size_ranks(host, own_cluster=True)
    assert host.cpus_per_rank == 1.0 and "2 CPUs" in host.cpus_per_rank_why
    joined = p.parse_args(["/m"])
    size_ranks(joined, own_cluster=False)
    assert joined.cpus_per_rank == CPUS_PER_RANK and "joined cluster" in joined.cpus_per_rank_why


def test_a_signal_inside_a_ray_call_stops_the_start_once_the_call_returns() -> None:
    """Raised inside Ray's code, the stop could land in its C code (a SystemError, exit 1): inside
    ``_ray_call`` the first signal waits for the region's end; outside, it stops at once."""
    import os
    import signal
    import time

    from service.api import launch
    from service.api.cluster import Stop

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    launch._install_handlers()
    finished = False
    try:
        with pytest.raises(Stop, match="SIGTERM"):
            with launch._ray_call():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)  # the handler runs here, between bytecodes
                finished = True
        assert finished, "the region was cut short"
        launch._signals.count, launch._signals.pending = 0, ""
        with pytest.raises(Stop, match="SIGINT"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
            finished = False
        assert finished, "outside a Ray call the signal did not stop at once"
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        launch._signals.reset()
