"""`dloserve serve` rejects bad flags and models before starting Ray (fast)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from service.api.launch import add_arguments, config_from_args, run


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_flags_map_onto_the_service_config() -> None:
    args = parse("/m", "--data-parallel-size", "4", "--enable-distributed-layerwise-offload",
                 "--dlo-no-use-allgather", "--max-wait-ms", "20", "--queue-size", "9", "--max-steps", "7")
    cfg = config_from_args(args, gpus_per_rank=1.0)
    assert (cfg.dp_size, cfg.offload, cfg.use_allgather, cfg.queue_size) == (4, True, False, 9)
    assert cfg.limits["max_steps"] == 7 and cfg.max_wait_ms == 20
    assert cfg.engine_spec("/m").bundles() == [{"CPU": 1.0, "GPU": 1.0}] * 4
    assert cfg.engine_spec("/m").device == "cuda"
    assert cfg.offload_options == {"mode": "rank_local"}
    args = parse("/m", "--enable-distributed-layerwise-offload", "--dlo-mode", "auto",
                 "--dlo-resident-layers", "3", "--dlo-components", "vae,dit",
                 "--dlo-probe-size", "1280x720x81")
    spec = config_from_args(args, gpus_per_rank=1.0).engine_spec("/m")
    assert spec.offload_options == {"mode": "auto", "resident_layers": 3, "components": ["dit", "vae"],
                                    "probe_shape": [720, 1280, 81]}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data-parallel-size", "0"], "--data-parallel-size"),
        (["--dlo-no-use-allgather"], "--enable-distributed-layerwise-offload"),
        (["/does/not/exist"], "does not exist"),
        (["--dlo-mode", "auto"], "--dlo-mode: needs --enable-distributed-layerwise-offload"),
        (["--enable-distributed-layerwise-offload", "--dlo-components", "dit,unet"], "--dlo-components"),
        (["--enable-distributed-layerwise-offload", "--dlo-device-memory-gb", "-1"],
         "--dlo-device-memory-gb"),
        (["--enable-distributed-layerwise-offload", "--dlo-probe-size", "832x480"], "--dlo-probe-size"),
        (["--enable-distributed-layerwise-offload", "--dlo-mode", "auto", "--scheduler", "waves"],
         "--dlo-mode auto needs --scheduler continuous"),
        (["--enable-distributed-layerwise-offload", "--dlo-no-use-allgather", "--dlo-mode", "allgather"],
         "contradicts"),
    ],
)
def test_bad_flags_exit_2_without_starting_ray(argv: list[str], message: str, capsys, tmp_path: Path) -> None:  # noqa: ANN001
    assert run(parse(*argv)) == 2
    assert message in capsys.readouterr().err
