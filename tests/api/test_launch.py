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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data-parallel-size", "0"], "--data-parallel-size"),
        (["--dlo-no-use-allgather"], "--enable-distributed-layerwise-offload"),
        (["/does/not/exist"], "does not exist"),
    ],
)
def test_bad_flags_exit_2_without_starting_ray(argv: list[str], message: str, capsys, tmp_path: Path) -> None:  # noqa: ANN001
    assert run(parse(*argv)) == 2
    assert message in capsys.readouterr().err
