"""The shared offload flags: mapping to options, errors naming the flag, probe support."""

from __future__ import annotations

import argparse

import pytest

from service.models.flux import FluxAdapter
from service.models.options import add_offload_arguments, offload_options, parse_probe_size, probe_problem
from service.models.pipeline import OffloadConfig
from service.models.wan import WanAdapter


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--dlo-no-use-allgather", action="store_true")
    add_offload_arguments(p)
    return p.parse_args(list(argv))


def test_options_round_trip_into_the_config() -> None:
    opts = offload_options(parse("--dlo-mode", "rank-local", "--dlo-device-memory-gb", "40",
                                 "--dlo-components", "text_encoder,dit", "--dlo-probe-size", "1024x1024x1"),
                           enabled=True)
    assert opts == {"mode": "rank_local", "device_memory_gb": 40.0, "components": ["dit", "text_encoder"],
                    "probe_shape": [1024, 1024, 1]}
    cfg = OffloadConfig.from_options(True, True, opts)
    assert (cfg.use_allgather, cfg.mode, cfg.components, cfg.probe_shape) == \
        (False, "manual", ("dit", "text_encoder"), (1024, 1024, 1))
    auto = OffloadConfig.from_options(True, True, offload_options(parse("--dlo-mode", "auto"), True))
    assert auto.mode == "auto" and auto.strategy == "auto"
    assert offload_options(parse(), enabled=False) == {}  # defaults need no offload


@pytest.mark.parametrize(("argv", "message"), [
    (["--dlo-resident-layers", "-1"], "--dlo-resident-layers must be >= 0"),
    (["--dlo-resident-layers", "2", "--dlo-device-memory-gb", "9"], "not both"),
    (["--dlo-no-use-allgather", "--dlo-mode", "auto"], "contradicts --dlo-mode auto"),
    (["--dlo-probe-size", "0x480x81"], "--dlo-probe-size must be WIDTHxHEIGHTxFRAMES"),
])
def test_bad_values_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        offload_options(parse(*argv), enabled=True)


def test_flags_without_offload_are_refused() -> None:
    with pytest.raises(ValueError, match="--dlo-resident-layers: needs --enable-distributed"):
        offload_options(parse("--dlo-resident-layers", "2"), enabled=False)


def test_probe_support_per_family() -> None:
    assert parse_probe_size("832x480x81") == [480, 832, 81]
    assert probe_problem(WanAdapter, {"mode": "auto"}, "cuda") is None
    assert "--dlo-mode auto needs a load-time probe" in probe_problem(FluxAdapter, {"mode": "auto"}, "cpu")
    assert probe_problem(FluxAdapter, {"device_memory_gb": 30.0}, "cpu") is None  # no probe on CPU
    assert "--dlo-device-memory-gb" in probe_problem(FluxAdapter, {"device_memory_gb": 30.0}, "cuda")
