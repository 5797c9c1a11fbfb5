"""The offload flags every front end shares (``generate``, ``serve``, the batch job).

One place adds them and one checks them, so the three CLIs cannot drift; the result is
a plain dict (it travels in the Serve config and to Ray actors) that
``OffloadConfig.from_options`` turns back into a config. No torch here: the CLIs import
this to build their parsers.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

MODES = ("auto", "allgather", "rank-local")
QUANTIZATIONS = ("fp8",)
COMPONENTS = ("dit", "text_encoder", "vae")


def parse_components(value: str | tuple[str, ...] | list[str] | None, flag: str = "--dlo-components"
                     ) -> tuple[str, ...]:
    """``"dit,text_encoder,vae"`` -> a checked tuple; ValueError naming ``flag``."""
    if value is None:
        return ("dit",)
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)
    bad = sorted(set(items) - set(COMPONENTS))
    if bad or not items:
        raise ValueError(f"{flag}: unknown component(s) {bad or items}; choose from {list(COMPONENTS)}")
    if "dit" not in items:
        raise ValueError(f"{flag}: must include 'dit' (the transformer is what offload streams first)")
    return tuple(c for c in COMPONENTS if c in items)



def add_offload_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dlo-mode", choices=MODES, default=None,
                   help="allgather (default), rank-local, or auto: chosen at load from a short probe "
                        "of per-block compute vs transfer time (logged, and in /readyz)")
    p.add_argument("--dlo-resident-layers", type=int, default=None,
                   help="keep this many transformer blocks on the device (spread over the depth)")
    p.add_argument("--dlo-device-memory-gb", type=float, default=None,
                   help="keep as many blocks resident as fit in this many GiB beside the two slots, "
                        "the non-block tensors and the probe forward's activations")
    p.add_argument("--dlo-components", default="dit",
                   help=f"what offload covers, comma-separated from {','.join(COMPONENTS)}: "
                        "text_encoder streams its blocks too, vae is on the device only for decode")
    p.add_argument("--dlo-probe-size", default=None,
                   help="WIDTHxHEIGHTxFRAMES of the load-time probe forward (auto mode, memory budget); "
                        "default 832x480x81 (generate: the request's own size)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="fp8: the transformer blocks' Linear weights in float8_e4m3fn with per-channel "
                        "scales (half the bytes to stream), quantized at load or read from a checkpoint "
                        "written by 'dloserve quantize'; resident or offloaded")


FLAGS = {"mode": "--dlo-mode", "resident_layers": "--dlo-resident-layers",
         "device_memory_gb": "--dlo-device-memory-gb", "components": "--dlo-components",
         "probe_shape": "--dlo-probe-size", "quantization": "--quantization"}


def offload_options(args: argparse.Namespace, enabled: bool,
                    needs: str = "needs --enable-distributed-layerwise-offload") -> dict[str, Any]:
    """The checked options as a plain dict; ValueError naming the flag."""
    mode = args.dlo_mode
    if getattr(args, "dlo_no_use_allgather", False):
        if mode not in (None, "rank-local"):
            raise ValueError(f"--dlo-no-use-allgather contradicts --dlo-mode {mode}")
        mode = "rank-local"
    out: dict[str, Any] = {}
    if mode is not None:
        out["mode"] = mode.replace("-", "_")
    if args.dlo_resident_layers is not None:
        if args.dlo_resident_layers < 0:
            raise ValueError(f"--dlo-resident-layers must be >= 0, got {args.dlo_resident_layers}")
        out["resident_layers"] = args.dlo_resident_layers
    if args.dlo_device_memory_gb is not None:
        if not args.dlo_device_memory_gb > 0:
            raise ValueError(f"--dlo-device-memory-gb must be > 0, got {args.dlo_device_memory_gb}")
        if "resident_layers" in out:
            raise ValueError("give --dlo-resident-layers or --dlo-device-memory-gb, not both")
        out["device_memory_gb"] = args.dlo_device_memory_gb
    components = parse_components(args.dlo_components)
    if components != ("dit",):
        out["components"] = list(components)
    if args.dlo_probe_size is not None:
        out["probe_shape"] = parse_probe_size(args.dlo_probe_size)
    if out and not enabled:
        raise ValueError(f"{', '.join(FLAGS[k] for k in out)}: {needs}")
    if getattr(args, "quantization", None) is not None:  # resident too: not an offload flag
        out["quantization"] = args.quantization
    return out


def check_flags(degree: int, rank_local: bool) -> str | None:
    """What is wrong with ``--sequence-parallel-size`` next to the other DLO flags, or None
    (shared by ``generate``, ``serve`` and the batch job; here, not in ``sequence``, so a CLI
    checks it before torch is imported)."""
    flag = "--sequence-parallel-size"
    if degree < 1:
        return f"{flag} must be >= 1, got {degree}"
    if degree > 1 and rank_local:
        return f"{flag} gathers each block over the SP group: drop --dlo-no-use-allgather"
    return None


def sequence_parallel_problem(options: dict[str, Any], sp: int) -> str | None:
    """Placement options not yet made for an SP group (untested there: refused, named)."""
    if sp <= 1:
        return None
    refused = [FLAGS[k] for k in ("mode", "resident_layers", "device_memory_gb", "components", "quantization")
               if k in options and not (k == "mode" and options[k] == "allgather")]
    if refused:
        return (f"{', '.join(refused)}: not yet with --sequence-parallel-size > 1 (an SP group always "
                "gathers over its ranks and streams the transformer only)")
    return None


def check_serving_options(args: argparse.Namespace, enabled: bool,
                          needs: str = "needs --enable-distributed-layerwise-offload") -> str | None:
    """What is wrong with the offload flags of ``serve`` / the batch job, or None."""
    try:
        opts = offload_options(args, enabled, needs)
    except ValueError as e:
        return str(e)
    problem = sequence_parallel_problem(opts, getattr(args, "sequence_parallel_size", 1))
    if problem:
        return problem
    if opts.get("mode") == "auto" and getattr(args, "scheduler", "continuous") == "waves":
        return "--dlo-mode auto needs --scheduler continuous (waves are sized before the mode is known)"
    return None


def probe_problem(adapter: Any, options: dict[str, Any], device: str) -> str | None:
    """Why this model cannot run the load-time probe these options need, or None."""
    needs = options.get("mode") == "auto" or ("device_memory_gb" in options and device == "cuda")
    if needs and not adapter.can_probe:
        flag = "--dlo-mode auto" if options.get("mode") == "auto" else "--dlo-device-memory-gb"
        return f"{flag} needs a load-time probe, which {adapter.family} does not have yet (Wan does)"
    return None


def parse_probe_size(value: str) -> list[int]:
    """``"832x480x81"`` -> [height, width, frames]."""
    m = re.fullmatch(r"\s*(\d+)x(\d+)x(\d+)\s*", value)
    if not m or min(int(g) for g in m.groups()) < 1:
        raise ValueError(f"--dlo-probe-size must be WIDTHxHEIGHTxFRAMES like 832x480x81, got {value!r}")
    w, h, f = (int(g) for g in m.groups())
    return [h, w, f]
