"""``dloserve``: the command line.

    dloserve demo-model PATH [--preset tiny|small|wan14b-shape|wan14b-umt5xxl] [--layers N]
    dloserve generate --prompt TEXT [--model PATH] [--out out.mp4] [DLO flags]
    dloserve quantize SRC DST     (a pipeline folder with an fp8 transformer)
    dloserve serve ...            (delegates to service.api.launch)

``generate`` without ``--model`` uses the tiny demo model, written to the cache folder
($DLOSERVE_CACHE or ~/.cache/dloserve) on first use. With ``--data-parallel-size N > 1``
it starts N local processes (gloo on CPU, NCCL on GPU); rank 0 runs the request and the
others idle-replay the gathers. With ``--sequence-parallel-size S`` the S processes all run
the request, each on 1/S of its tokens. No Ray is needed for it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

DTYPES = ("auto", "bfloat16", "float16", "float32")


def _add_demo(sub: argparse._SubParsersAction) -> None:
    from service.models.demo import PRESETS

    p = sub.add_parser("demo-model", help="write an offline demo Wan T2V pipeline directory")
    p.add_argument("path", help="new or empty folder to write")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None, help="transformer blocks (preset default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    from service.models.request import GenerationRequest

    d = GenerationRequest(prompt="x")
    p = sub.add_parser("generate", help="generate one video to an MP4 file")
    p.add_argument("--model", default=None, help="diffusers pipeline folder (default: tiny demo model)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--negative-prompt", default=d.negative_prompt)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default="out.mp4")
    p.add_argument("--height", type=int, default=d.height)
    p.add_argument("--width", type=int, default=d.width)
    p.add_argument("--num-frames", type=int, default=d.num_frames)
    p.add_argument("--fps", type=int, default=d.fps)
    p.add_argument("--steps", type=int, default=d.num_inference_steps)
    p.add_argument("--guidance-scale", type=float, default=d.guidance_scale)
    p.add_argument("--flow-shift", type=float, default=None, help="override the scheduler's shift")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="transformer dtype (auto: checkpoint's)")
    p.add_argument("--data-parallel-size", type=int, default=1, help="local ranks (processes)")
    p.add_argument("--sequence-parallel-size", "--usp", type=int, default=1, dest="sequence_parallel_size",
                   help="split the request's tokens across S local ranks (Ulysses); DLO gathers over them")
    p.add_argument(
        "--enable-distributed-layerwise-offload",
        action="store_true",
        help="stream transformer blocks from host memory (AllGather of 1/N shards by default)",
    )
    p.add_argument(
        "--dlo-no-use-allgather",
        action="store_true",
        help="rank-local offload: each rank streams whole blocks, no sharding",
    )
    from service.models.options import add_offload_arguments

    add_offload_arguments(p)
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


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from service.engine.local import generate_local
    from service.models.adapter import load_adapter
    from service.models.demo import ensure_demo_model
    from service.models.options import check_flags, offload_options
    from service.models.pipeline import OffloadConfig
    from service.models.request import GenerationRequest

    n = args.data_parallel_size
    if n < 1:
        return _fail("--data-parallel-size must be >= 1")
    if args.dlo_no_use_allgather and not args.enable_distributed_layerwise_offload:
        return _fail("--dlo-no-use-allgather needs --enable-distributed-layerwise-offload")
    sp = args.sequence_parallel_size
    err = check_flags(sp, args.dlo_no_use_allgather)
    if err:
        return _fail(err)
    if sp > 1 and n > 1:
        return _fail("--sequence-parallel-size with --data-parallel-size: generate runs one request on "
                     "one SP group; D SP groups are for 'dloserve serve' and the batch job")
    if args.device == "cuda" and not torch.cuda.is_available():
        return _fail("--device cuda: no CUDA device is available")
    req = GenerationRequest(
        prompt=args.prompt,
        negative_prompt=args.negative_prompt,
        seed=args.seed,
        height=args.height,
        width=args.width,
        num_frames=args.num_frames,
        fps=args.fps,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance_scale,
        flow_shift=args.flow_shift,
    )
    req.check()  # model-independent checks first: no demo model is written for a bad request
    model = args.model or str(ensure_demo_model())
    load_adapter(model, sequence_parallel=sp).validate(req)  # bad input: refused before any process
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    try:
        options = offload_options(args, args.enable_distributed_layerwise_offload)
    except ValueError as e:
        return _fail(str(e))
    from service.models.options import probe_problem, sequence_parallel_problem

    problem = sequence_parallel_problem(options, sp) or \
        probe_problem(load_adapter(model), options, args.device)
    if problem:
        return _fail(problem)
    options.setdefault("probe_shape", [req.height, req.width, req.num_frames])
    offload = OffloadConfig.from_options(
        args.enable_distributed_layerwise_offload, not args.dlo_no_use_allgather, options, dtype
    )
    t0 = time.perf_counter()
    generate_local(
        model, req, args.out, world=max(n, sp), device=args.device, offload=offload,
        progress=not args.quiet, sequence_parallel=sp,
    )
    size = os.path.getsize(args.out)
    print(
        f"wrote {args.out} ({size} bytes, {req.num_frames} frames {req.width}x{req.height}) "
        f"in {time.perf_counter() - t0:.1f} s [{offload.strategy}, {f'SP{sp}' if sp > 1 else f'DP{n}'}, "
        f"{args.device}]"
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


def _fail(message: str) -> int:
    print(f"dloserve: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
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
