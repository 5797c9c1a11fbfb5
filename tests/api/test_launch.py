"""`dloserve serve` rejects bad flags and models before starting Ray (fast)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from service.api.launch import add_arguments, config_from_args, run
from service.api.service import ServiceConfig
from service.models.options import Mode, OffloadSettings


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_flags_map_onto_the_service_config() -> None:
    args = parse("/m", "--data-parallel-size", "4", "--enable-distributed-layerwise-offload",
                 "--dlo-no-use-allgather", "--max-wait-ms", "20", "--queue-size", "9", "--max-steps", "7")
    cfg = config_from_args(args, gpus_per_rank=1.0)
    assert (cfg.dp_size, cfg.offload, cfg.queue_size) == (4, OffloadSettings(Mode.RANK_LOCAL), 9)
    assert cfg.limits["max_steps"] == 7 and cfg.max_wait_ms == 20
    assert cfg.engine_spec("/m").bundles() == [{"CPU": 1.0, "GPU": 1.0}] * 4
    assert cfg.engine_spec("/m").device == "cuda"
    args = parse("/m", "--enable-distributed-layerwise-offload", "--dlo-mode", "auto",
                 "--dlo-resident-layers", "3", "--dlo-components", "vae,dit",
                 "--dlo-probe-size", "1280x720x81", "--dtype", "bfloat16")
    cfg = config_from_args(args, gpus_per_rank=1.0)
    want = OffloadSettings(Mode.AUTO, resident_layers=3, components=("dit", "vae"),
                           probe_shape=(720, 1280, 81), dtype="bfloat16")
    assert cfg.engine_spec("/m").settings == want  # the same object all the way down
    assert ServiceConfig(**cfg.model_dump()).offload == want  # through Serve's args and back


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
    ],
)
def test_bad_flags_exit_2_without_starting_ray(argv: list[str], message: str, capsys, tmp_path: Path) -> None:  # noqa: ANN001
    assert run(parse(*argv)) == 2
    assert message in capsys.readouterr().err
