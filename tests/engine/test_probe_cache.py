"""auto's probe timings kept between starts (engine.probe_cache): a second start with the same
facts chooses from them without a probe (``source: cached``); any fact the timings depend on
(the probe size, torch's version, the checkpoint's headers) makes a new key; a damaged file
or a host that cannot be named costs a probe, never a wrong choice. Real probes on CPU (the
demo model at a given --dlo-probe-size), counted by the executor's ``probes``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from service.config import EngineConfig, OffloadConfig, OffloadMode, ParallelConfig
from service.engine import probe_cache
from service.engine.start import probe_mode
from tests.engine.test_auto_choice import NoTransport


class Host(NoTransport):
    """A transport that names its probe host, as the Ray one does from bundle 0's node."""

    host: tuple[str, float] | None = ("test-cpu", 0.0)

    def _probe_host(self) -> tuple[str, float] | None:
        return self.host


def cpu_auto(model: str, shape: tuple[int, int, int] = (16, 16, 1)) -> EngineConfig:
    return EngineConfig(model, parallel=ParallelConfig(dp_size=2),
                        offload=OffloadConfig(OffloadMode.AUTO, probe_shape=shape))


def start(config: EngineConfig, cls: type[NoTransport] = Host) -> NoTransport:
    ex = cls(config)
    ex._resolve_auto(lambda: probe_mode(config, torch.device("cpu")))
    return ex


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DLOSERVE_CACHE", str(tmp_path))
    return tmp_path / "probe"


def test_a_second_start_chooses_from_the_cached_timings(demo_model: str, cache: Path) -> None:
    first = start(cpu_auto(demo_model))
    assert first.probes == 1 and first.config.choice.source == "probe"
    assert len(list(cache.glob("*.json"))) == 1
    again = start(cpu_auto(demo_model))
    assert again.probes == 0  # no probe process
    choice = again.config.choice
    assert choice.source == "cached" and "timings from the probe of" in choice.reason
    assert choice.mode is first.config.choice.mode
    assert choice.timings == first.config.choice.timings  # world 2 both times
    assert again.status()["offload_mode"]["source"] == "cached"


def test_a_changed_fact_is_a_miss(demo_model: str, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert start(cpu_auto(demo_model)).probes == 1
    assert start(cpu_auto(demo_model, (16, 32, 1))).probes == 1  # another probe size
    with monkeypatch.context() as m:
        m.setattr(torch, "__version__", "9.9.9")
        assert start(cpu_auto(demo_model)).probes == 1  # another torch
    assert start(cpu_auto(demo_model)).probes == 0  # the first facts again: a hit
    assert len(list(cache.glob("*.json"))) == 3


def test_the_checkpoint_headers_are_in_the_key_its_values_are_not(demo_model: str, tmp_path: Path) -> None:
    copy = tmp_path / "model"
    shutil.copytree(demo_model, copy)
    weights = copy / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    save_file(tensors, weights)  # written the way the edits below write it
    facts = probe_cache.probe_facts(cpu_auto(str(copy)), "test-cpu", 0.0)
    name = next(iter(tensors))
    save_file({**tensors, name: tensors[name] + 1}, weights)  # other values, the same header
    assert probe_cache.probe_facts(cpu_auto(str(copy)), "test-cpu", 0.0) == facts
    save_file({**tensors, name: tensors[name].to(torch.float16)}, weights)  # another dtype
    assert probe_cache.probe_facts(cpu_auto(str(copy)), "test-cpu", 0.0)["checkpoint"] != facts["checkpoint"]
    assert probe_cache.probe_facts(cpu_auto(str(copy)), "other-gpu", 0.0) != facts


def test_a_damaged_entry_or_an_unnamed_host_costs_a_probe(demo_model: str, cache: Path) -> None:
    assert start(cpu_auto(demo_model)).probes == 1
    (entry,) = cache.glob("*.json")
    entry.write_text("{not json")
    assert start(cpu_auto(demo_model)).probes == 1  # probed again, and written whole again
    assert start(cpu_auto(demo_model)).probes == 0

    class Unnamed(Host):
        host = None

    shutil.rmtree(cache)
    assert start(cpu_auto(demo_model), Unnamed).probes == 1
    assert start(cpu_auto(demo_model), Unnamed).probes == 1
    assert not cache.exists()  # nothing keyed by a host it could not name
