"""The arguments object and the config it makes: one declaration of each flag (its default
from its field), one check order, errors that name the flag, the same config from the CLI and
from a Serve config mapping."""

from __future__ import annotations

import argparse

import pytest

from service.config import EngineConfig, FlagError, ModelConfig, OffloadConfig, OffloadMode
from service.config.args import BATCH, GENERATE, SERVE, EngineArgs
from service.config.engine import from_offload_mapping, offload_mapping
from service.config.offload import parse_probe_size
from service.models.flux import FluxAdapter
from service.models.wan import WanAdapter


def parse(*argv: str, offload_default: bool = False) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p, GENERATE, defaults={"offload": True} if offload_default else None)
    return p.parse_args(list(argv))


def config(*argv: str, offload_default: bool = False) -> EngineConfig:
    return EngineArgs.from_namespace(parse(*argv, offload_default=offload_default)).to_config()


def mapped(mapping: dict) -> EngineConfig:
    return EngineConfig(**from_offload_mapping(mapping, OffloadMode.AUTO))


def test_flags_become_one_config_that_round_trips_through_a_config_mapping() -> None:
    c = config("--enable-distributed-layerwise-offload", "--dlo-mode", "rank-local",
               "--dlo-device-memory-gb", "40", "--dlo-components", "text_encoder,dit",
               "--dlo-probe-size", "1024x1024x1", "--dtype", "bfloat16")
    assert c.offload == OffloadConfig(OffloadMode.RANK_LOCAL, device_memory_gb=40.0,
                                      components=("dit", "text_encoder"), probe_shape=(1024, 1024, 1))
    assert c.model == ModelConfig(dtype="bfloat16")
    assert not c.offload.mode.gathers and c.offload.enabled and c.offload.probed
    assert mapped(offload_mapping(c)) == c
    assert config().offload.mode is OffloadMode.RESIDENT
    assert config("--enable-distributed-layerwise-offload").offload.mode is OffloadMode.AUTO  # default
    sp = config("--enable-distributed-layerwise-offload", "--sequence-parallel-size", "2")
    assert sp.offload.mode is OffloadMode.ALLGATHER  # an SP group always gathers
    with pytest.warns(FutureWarning, match="--dlo-no-use-allgather is deprecated"):  # the old alias
        assert config("--enable-distributed-layerwise-offload", "--dlo-no-use-allgather").offload \
            == OffloadConfig(OffloadMode.RANK_LOCAL)
    # the batch job: offload on unless --no-offload
    assert config(offload_default=True).offload.mode is OffloadMode.AUTO
    assert config("--no-offload", offload_default=True).offload.mode is OffloadMode.RESIDENT


def test_every_default_comes_from_its_field() -> None:
    """A front end that declares no flag of a group gets the same values as one that does."""
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p, SERVE)
    assert EngineArgs.from_namespace(p.parse_args([])) == EngineArgs()
    q = argparse.ArgumentParser()
    EngineArgs.add_cli_args(q, BATCH, defaults={"wave_deadline_base_s": 600.0})
    assert q.parse_args([]).job_retries == EngineArgs().job_retries == EngineConfig().scheduler.job_retries
    assert EngineArgs().to_config() == EngineConfig()  # no flag: the config's own defaults


def test_auto_resolves_once_and_is_not_usable_before() -> None:
    c = config("--enable-distributed-layerwise-offload", "--dlo-mode", "auto")
    with pytest.raises(ValueError, match="not resolved"):
        _ = c.offload.mode.gathers
    assert c.offload.resolved(OffloadMode.ALLGATHER).mode.gathers
    assert c.offload.resolved(OffloadMode.RANK_LOCAL).mode is OffloadMode.RANK_LOCAL
    with pytest.raises(ValueError):
        c.offload.resolved(OffloadMode.RESIDENT)


@pytest.mark.parametrize(("argv", "message"), [
    (["--dlo-resident-layers", "-1"], "--dlo-resident-layers must be >= 0"),
    (["--dlo-resident-layers", "2", "--dlo-device-memory-gb", "9"], "not both"),
    (["--dlo-no-use-allgather", "--dlo-mode", "auto"], "contradicts --dlo-mode auto"),
    (["--dlo-probe-size", "0x480x81"], "--dlo-probe-size must be WIDTHxHEIGHTxFRAMES"),
    (["--dlo-components", "vae"], "must include 'dit'"),
    (["--data-parallel-size", "0"], "--data-parallel-size must be >= 1"),
    (["--sequence-parallel-size", "2", "--dlo-no-use-allgather"], "gathers each block over the SP group"),
    (["--sequence-parallel-size", "2", "--dlo-mode", "auto"], "--dlo-mode auto: not yet with"),
    (["--sequence-parallel-size", "2", "--dlo-resident-layers", "2"], "--dlo-resident-layers: not yet with"),
    (["--sequence-parallel-size", "2", "--cfg-batch", "on"], "--cfg-batch on: not yet with"),
    (["--sequence-parallel-size", "2", "--attention", "fp8"], "--attention fp8: not yet with"),
    (["--sequence-parallel-size", "2", "--attention", "fa4"], "--attention fa4: not yet with"),
    (["--sequence-parallel-size", "2", "--compile", "on"], "--compile on: not yet with"),
])
@pytest.mark.filterwarnings("ignore:--dlo-no-use-allgather is deprecated")
def test_bad_values_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(FlagError, match=message):
        config("--enable-distributed-layerwise-offload", *argv)


@pytest.mark.parametrize("argv", [["--dlo-resident-layers", "2"], ["--dlo-mode", "auto"],
                                  ["--dlo-no-use-allgather"], ["--dlo-components", "dit,vae"]])
@pytest.mark.filterwarnings("ignore:--dlo-no-use-allgather is deprecated")
def test_offload_flags_without_offload_are_refused(argv: list[str]) -> None:
    with pytest.raises(FlagError, match="needs --enable-distributed-layerwise-offload"):
        config(*argv)


def test_a_config_mapping_is_checked_as_strictly_as_the_flags() -> None:
    with pytest.raises(FlagError, match="unknown setting"):
        mapped({"mode": "allgather", "probe_size": "1x1x1"})
    with pytest.raises(FlagError, match="offload.use_allgather is gone"):
        mapped({"mode": "allgather", "use_allgather": True})
    with pytest.raises(FlagError, match="needs --enable"):
        mapped({"mode": "resident", "resident_layers": 3})


def test_the_device_share_flag_and_mapping() -> None:
    on = "--enable-distributed-layerwise-offload"
    assert config(on, "--dlo-device-share", "0").offload.device_share == 0
    assert mapped({"device_share": 0.25}).offload.device_share == 0.25
    assert offload_mapping(config("--enable-distributed-layerwise-offload"))["device_share"] == 0.4
    with pytest.raises(FlagError, match="--dlo-device-share"):
        config("--enable-distributed-layerwise-offload", "--dlo-device-share", "1.5")


def test_probe_support_per_family() -> None:
    assert parse_probe_size("832x480x81") == (480, 832, 81)
    auto = EngineConfig(offload=OffloadConfig(OffloadMode.AUTO))
    budget = EngineConfig(offload=OffloadConfig(OffloadMode.ALLGATHER, device_memory_gb=30.0))
    assert auto.probe_problem(WanAdapter, "cuda") is None
    assert auto.probe_problem(FluxAdapter, "cuda") is None  # auto without a probe: AllGather
    assert budget.probe_problem(FluxAdapter, "cpu") is None  # no probe on CPU
    assert "--dlo-device-memory-gb" in budget.probe_problem(FluxAdapter, "cuda")


def test_cfg_batch_and_compile_switches() -> None:
    """auto: on CUDA, off on CPU (CPU frames stay bitwise diffusers'); on/off whatever the
    device; a bad value names the flag, from the CLI and from a config mapping alike."""
    auto = config().model
    assert (auto.cfg_batch, auto.compile) == ("auto", "auto")
    assert auto.cfg_batching("cuda") and not auto.cfg_batching("cpu")
    assert auto.compiling("cuda") and not auto.compiling("cpu")
    on = config("--cfg-batch", "on", "--compile", "on")
    assert on.model.cfg_batching("cpu") and on.model.compiling("cpu")
    off = mapped({"cfg_batch": "off", "compile": "off"}).model
    assert not off.cfg_batching("cuda") and not off.compiling("cuda")
    assert mapped(offload_mapping(on)) == on
    with pytest.raises(FlagError, match=r"--cfg-batch must be one of \['auto', 'on', 'off'\], got 'yes'"):
        mapped({"cfg_batch": "yes"})
    with pytest.raises(FlagError, match="--compile must be one of"):
        ModelConfig(compile=True)  # type: ignore[arg-type]
    with pytest.raises(SystemExit):
        parse("--cfg-batch", "sometimes")


def test_attention_flag() -> None:
    """exact by default; the approximate kernels are opt-in, from the CLI and a config mapping
    alike; a bad value names the flag."""
    assert config().model.attention == "exact"
    fp8 = config("--attention", "fp8")
    assert fp8.model.attention == "fp8"
    assert mapped(offload_mapping(fp8)) == fp8
    assert mapped({"attention": "fa4"}).model.attention == "fa4"
    with pytest.raises(FlagError, match=r"--attention must be one of \['exact', 'sdpa', 'fa4', 'fp8'\], "
                       r"got 's"):
        mapped({"attention": "sage"})
    for gone in ("fp4", "triton-fp8", "int8-fp8"):  # our Triton kernel: deleted (issue 46's measurement)
        with pytest.raises(SystemExit):
            parse("--attention", gone)
    for name in ("sdpa", "fa4", "fp8"):  # each declared once: the flag, the mapping, the config
        flags, mapping = config("--attention", name), mapped({"attention": name})
        assert flags.model.attention == mapping.model.attention == name


def test_exact_attention_goes_with_sequence_parallelism() -> None:
    """exact (its SP calls stay SDPA: the router passes parallel_config calls through) and sdpa
    are accepted with --sequence-parallel-size; the kernels that would take SP's calls are not."""
    for name in ("exact", "sdpa"):
        assert config("--sequence-parallel-size", "2", "--attention", name).model.attention == name
