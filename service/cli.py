"""``dloserve``: the command line.

    dloserve demo-model PATH [--preset tiny|small|wan14b-shape|wan22-a14b-shape|...] [--layers N]
    dloserve generate --prompt TEXT [--model PATH] [--out out.mp4] [DLO flags]
    dloserve quantize SRC DST     (a pipeline folder with an fp8 transformer)
    dloserve serve ...            (delegates to service.api.launch)

``generate`` without ``--model`` uses the trained demo model (service/models/demo/weights/wan-shapes)
at the request its folder names as default (dloserve_defaults.json; flags win over it). With
``--data-parallel-size N > 1`` it starts N local processes (gloo on CPU, NCCL on GPU); rank 0
runs the request and the others idle-replay the gathers. With ``--sequence-parallel-size S``
the S processes all run the request, each on 1/S of its tokens. No Ray is needed for it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence


def _add_demo(sub: argparse._SubParsersAction) -> None:
    from service.models.demo import preset_names

    p = sub.add_parser("demo-model", help="write an offline demo Wan pipeline directory (any family)")
    p.add_argument("path", help="new or empty folder to write")
    p.add_argument("--preset", default="tiny", choices=preset_names())
    p.add_argument("--layers", type=int, default=None,
                   help="transformer blocks, per expert for Wan2.2 A14B (preset default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    from service.config.args import GENERATE, EngineArgs
    from service.models.request import GenerationRequest

    d = GenerationRequest(prompt="x")
    model_default = "(default: the model folder's dloserve_defaults.json, else %s)"
    p = sub.add_parser("generate", help="generate one video to an MP4 file")
    p.add_argument("--model", default=None, help="diffusers pipeline folder (default: the trained demo "
                                                 "model, service/models/demo/weights/wan-shapes)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--negative-prompt", default=None, help=model_default % repr(d.negative_prompt))
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default="out.mp4")
    p.add_argument("--height", type=int, default=None, help=model_default % d.height)
    p.add_argument("--width", type=int, default=None, help=model_default % d.width)
    p.add_argument("--num-frames", type=int, default=None, help=model_default % d.num_frames)
    p.add_argument("--fps", type=int, default=None, help=model_default % d.fps)
    p.add_argument("--steps", type=int, default=None, help=model_default % d.num_inference_steps)
    p.add_argument("--guidance-scale", type=float, default=None, help=model_default % d.guidance_scale)
    p.add_argument("--guidance-scale-2", type=float, default=None,
                   help="Wan2.2 A14B: the low-noise expert's guidance (default: --guidance-scale)")
    p.add_argument("--image", default=None,
                   help="image-to-video: a PNG, JPEG or WebP file (stretched to --width x --height, "
                        "as diffusers' pipeline does; docs/models.md)")
    p.add_argument("--flow-shift", type=float, default=None, help="override the scheduler's shift")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    EngineArgs.add_cli_args(p, GENERATE)
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_quantize(sub: argparse._SubParsersAction) -> None:
    from service.models.quantize import add_arguments

    add_arguments(sub.add_parser("quantize", help="write a pipeline folder with an fp8 transformer"))


def _add_serve(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="run the HTTP service (Ray Serve)", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dloserve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_generate(sub)
    _add_quantize(sub)
    _add_serve(sub)
    return parser


def cmd_demo_model(args: argparse.Namespace) -> int:
    from service.models.demo import write_demo_model

    t0 = time.perf_counter()
    path = write_demo_model(args.path, args.preset, args.layers, args.seed, progress=True)
    print(f"wrote {args.preset} demo model to {path} in {time.perf_counter() - t0:.1f} s")
    return 0


def _with_loras(args: argparse.Namespace, adapter: object, config: object, req: object) -> object:
    """``req`` with the ``--lora`` adapters (registered and checked here, before any rank starts)."""
    from dataclasses import replace

    from service.config import FlagError
    from service.models.lora import targets_of
    from service.models.lora_ref import lora_flags
    from service.models.lora_registry import LoraRegistry

    regs, uses = lora_flags(args, uses_allowed=True)
    if not regs:
        if uses:
            raise FlagError(f"--lora {uses[0].name}: no adapter is registered under that name "
                            "(give NAME=PATH)")
        return req
    registry = LoraRegistry(targets_of(adapter, config.model.dtype, config.model.quantization))
    for name, source in regs:
        registry.register(name, os.path.expanduser(source))
    refs, _ = registry.resolve(tuple(uses))
    return replace(req, loras=refs)


def cmd_generate(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from service.config import FlagError
    from service.config.args import EngineArgs
    from service.models.request import GenerationRequest, RequestError
    from service.models.startup import check_start

    try:  # every flag checked, in one order, before the request or the model
        gpus = 1.0 if args.device == "cuda" else 0.0
        config = EngineArgs.from_namespace(args).to_config(gpus_per_rank=gpus)
        config = replace(config, parallel=replace(config.parallel, executor="local"))
    except FlagError as e:
        return _fail(str(e))
    sp, dp = args.sequence_parallel_size, args.data_parallel_size
    if sp > 1 and dp > 1:
        return _fail("--sequence-parallel-size with --data-parallel-size: generate runs one request on "
                     "one SP group; D SP groups are for 'dloserve serve' and the batch job")
    image = None
    if args.image is not None:
        from service.models.image import check_image

        try:
            with open(args.image, "rb") as f:
                image = f.read()
        except OSError as e:
            return _fail(f"--image: {e}")
        try:
            check_image(image, "--image")
        except RequestError as e:
            return _fail(str(e))
    from service.models.adapter import ModelError
    from service.models.registry import request_defaults, resolve_model

    try:
        defaults = request_defaults(resolve_model(args.model))
    except ModelError as e:
        return _fail(str(e))
    given = {"negative_prompt": args.negative_prompt, "height": args.height, "width": args.width,
             "num_frames": args.num_frames, "fps": args.fps, "num_inference_steps": args.steps,
             "guidance_scale": args.guidance_scale, "flow_shift": args.flow_shift}
    extra = {} if args.guidance_scale_2 is None else {"guidance_scale_2": args.guidance_scale_2}
    req = GenerationRequest(image=image, extra=extra, prompt=args.prompt, seed=args.seed,
                            **{**defaults, **{k: v for k, v in given.items() if v is not None}})
    req.check()  # model-independent checks first: no demo model is written for a bad request
    import torch

    if args.device == "cuda" and torch.cuda.device_count() < max(dp, sp):
        return _fail(f"--device cuda: {max(dp, sp)} rank(s) need as many CUDA devices, "
                     f"found {torch.cuda.device_count()}")
    config, adapter = check_start(config, args.model, args.device)  # ModelError: exit 2, naming it
    try:
        adapter.validate(req)  # bad input: refused before any process starts
    except RequestError as e:
        flag = {"image": "--image", "extra.guidance_scale_2": "--guidance-scale-2"}.get(e.field)
        if flag is None:
            raise
        raise RequestError(flag, e.message) from None
    try:
        req = _with_loras(args, adapter, config, req)
    except (FlagError, ValueError) as e:  # LoraError, RequestError: they name adapter and key
        return _fail(str(e))
    if config.offload.enabled and config.offload.probe_shape is None:  # generate probes its own size
        config = replace(config, offload=replace(config.offload, probe_shape=(req.height, req.width,
                                                                              req.num_frames)))
    from service.jobs.generate import generate

    t0 = time.perf_counter()
    try:
        mode = generate(config, req, args.out, progress=not args.quiet)
    except RuntimeError as e:
        return _fail(str(e))
    size = os.path.getsize(args.out)
    print(
        f"wrote {args.out} ({size} bytes, {req.num_frames} frames {req.width}x{req.height}) "
        f"in {time.perf_counter() - t0:.1f} s [{mode}, {f'SP{sp}' if sp > 1 else f'DP{dp}'}, {args.device}]"
    )
    return 0


def cmd_serve(argv: Sequence[str]) -> int:
    try:
        from service.api.launch import add_arguments, run
    except ImportError as e:
        return _fail(f"'dloserve serve' needs service.api.launch, which cannot be imported: {e}")
    parser = argparse.ArgumentParser(prog="dloserve serve")
    add_arguments(parser)
    result = run(parser.parse_args(list(argv)))
    return int(result or 0)


def _stop_before_start() -> None:
    """A signal while ``serve`` is still importing: nothing has started, so exit 0 at once
    (launch.run installs the handlers that stop a started service)."""
    import signal

    def stop(signum: int, _frame: object) -> None:
        print(f"dloserve serve: {signal.Signals(signum).name} before start-up: nothing started",
              file=sys.stderr, flush=True)
        raise SystemExit(0)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)


def _fail(message: str) -> int:
    print(f"dloserve: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        _stop_before_start()
        return cmd_serve(argv[1:])  # its own parser owns every flag after "serve"
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    from service.models.adapter import ModelError
    from service.models.request import RequestError

    hf_logging.disable_progress_bar()  # per-file "Loading weights" bars: noise next to ours
    try:
        if args.command == "demo-model":
            return cmd_demo_model(args)
        if args.command == "quantize":
            from service.models.quantize import run

            return run(args)
        return cmd_generate(args)
    except (RequestError, ModelError, FileExistsError) as e:
        return _fail(str(e))


if __name__ == "__main__":
    sys.exit(main())
