"""Batch generation on the same DP-group engine as the HTTP service, without HTTP.

    ray job submit --working-dir . -- python -m service.jobs.batch \\
        --prompts prompts.jsonl --out results/ --data-parallel-size 2

``prompts.jsonl``: one JSON object per line with GenerationRequest fields (``prompt``
required; ``seed``, ``height``, ``width``, ``num_frames``, ``fps``,
``num_inference_steps``, ``guidance_scale``, ``negative_prompt``, ``flow_shift``, ``priority``
(lower first, default 0: the order items start in, docs/service.md "Priorities"); Wan2.2
A14B: ``guidance_scale_2``; image-to-video: ``image``, a path (relative to the prompts
file's folder) or an fsspec URL of a PNG, JPEG or WebP file, under the prompts file's folder
or ``--image-root``, at most 16 MiB) and an optional ``id``
(default: ``item-<line>``). Every line is validated (its image read and checked) before
any worker starts. Outputs go to ``OUT/<id>.mp4``; ``OUT/manifest.jsonl`` gets one line per
finished item with the file's SHA-256. Re-running skips items whose manifest entry is
completed and whose file still has that hash (resumable); failed items are retried.
Each entry carries the item's ``timings`` (seconds per stage). Stopping the job (``ray job
stop``, SIGTERM, Ctrl-C) cancels running items at their next transformer forward (recorded
``cancelled``) and leaves queued ones for the next run.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from service.models.request import GenerationRequest, RequestError

FIELDS = {f.name for f in dataclasses.fields(GenerationRequest)} - {"extra"}
EXTRA = {"guidance_scale_2"}  # family arguments a line may give (they go to ``extra``)


def read_image(source: object, base: Path, where: str, root: str | None = None) -> bytes:
    """The checked bytes of a line's ``image``: a path (relative to ``base``) or a URL, under
    ``root`` (default: ``base``, the prompts file's folder; ``--image-root``), read up to
    MAX_IMAGE_BYTES. Errors name the line and the source, never the file's bytes: a prompts
    file cannot make the job read, or quote, any file the job's user can."""
    import fsspec

    from service.models.image import MAX_IMAGE_BYTES, check_image

    if not isinstance(source, str) or not source:
        raise ValueError(f"{where}: image: must be a path or URL, got {source!r}")
    limit = root or str(base)
    url = _confined(source, base, limit)
    if url is None:
        raise ValueError(f"{where}: image: {source!r} is outside {limit} (the prompts file's folder, "
                         "or --image-root)")
    try:
        with fsspec.open(url, "rb") as f:
            data = f.read(MAX_IMAGE_BYTES + 1)
    except (OSError, ValueError, ImportError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise ValueError(f"{where}: image: cannot read {source!r}: {reason}") from None
    try:
        check_image(data, "image", max_bytes=MAX_IMAGE_BYTES)
    except RequestError as e:
        raise ValueError(f"{where}: {e} ({source})") from None
    return data


def _confined(source: str, base: Path, root: str) -> str | None:
    """The URL to read ``source`` from, or None where it is not under ``root``: a local
    path (or file:// URL) after symlinks are resolved, a remote URL by its prefix."""
    local_root = root.removeprefix("file://") if "://" not in root.removeprefix("file://") else None
    if "://" in source and not source.startswith("file://"):
        prefix = root.rstrip("/") + "/"
        return source if local_root is None and source.startswith(prefix) and ".." not in source else None
    if local_root is None:
        return None
    path = Path(source.removeprefix("file://"))
    resolved = (base / path).resolve() if not path.is_absolute() else path.resolve()
    return str(resolved) if resolved.is_relative_to(Path(local_root).resolve()) else None


def read_prompts(path: Path, image_root: str | None = None,
                 defaults: dict[str, Any] | None = None) -> list[tuple[str, GenerationRequest]]:
    """Parse and check every line; raises ValueError naming the line and field. ``defaults``: what
    a line leaves out (the model folder's default request)."""
    items: list[tuple[str, GenerationRequest]] = []
    seen: set[str] = set()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: invalid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{n}: must be a JSON object")
        item_id = str(obj.pop("id", f"item-{n:05d}"))
        if not item_id.replace("-", "").replace("_", "").isalnum() or item_id in seen:
            raise ValueError(f"{path}:{n}: id {item_id!r} must be unique and [A-Za-z0-9_-]")
        unknown = sorted(set(obj) - FIELDS - EXTRA)
        if unknown:
            raise ValueError(f"{path}:{n}: unknown field(s) {unknown}")
        if "prompt" not in obj:
            raise ValueError(f"{path}:{n}: prompt: missing")
        if "image" in obj:
            obj["image"] = read_image(obj["image"], path.parent, f"{path}:{n}", image_root)
        extra = {k: obj.pop(k) for k in EXTRA & set(obj)}
        seen.add(item_id)
        items.append((item_id, GenerationRequest(**{**(defaults or {}), **obj}, extra=extra)))
    return items


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def public(req: GenerationRequest) -> dict[str, Any]:
    """The request as the manifest records it: the image by its SHA-256, not its bytes."""
    d = dataclasses.asdict(req)
    image = d.pop("image")
    if image is not None:
        d["image_sha256"] = hashlib.sha256(image).hexdigest()
    return d


def finished(out: Path) -> dict[str, dict[str, Any]]:
    """Manifest entries whose file is still there with the recorded hash (last one wins)."""
    done: dict[str, dict[str, Any]] = {}
    manifest = out / "manifest.jsonl"
    if not manifest.exists():
        return done
    for line in manifest.read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue  # a torn last line from a killed run
        done.pop(e.get("id"), None)
        f = out / str(e.get("file", ""))
        if e.get("status") == "completed" and f.is_file() and sha256(f) == e.get("sha256"):
            done[e["id"]] = e
    return done


class ManifestSink:
    """Writes each finished item (file first, then its manifest line) and moves the bar."""

    def __init__(self, out: Path, todo: int, bar: Any) -> None:
        self.out, self.bar = out, bar
        self.left = todo
        self.failed = 0
        self.all_done = threading.Event()
        self._lock = threading.Lock()
        self._ended: set[str] = set()
        if todo == 0:
            self.all_done.set()

    def on_start(self, ticket: Any, info: dict[str, Any]) -> None:
        self.bar.set_postfix_str(f"{ticket.id} on rank {info['rank']}")

    def ended(self, ids: list[str]) -> bool:
        with self._lock:
            return set(ids) <= self._ended

    def on_progress(self, ticket_id: str, step: int, total: int) -> None:
        pass

    def on_requeue(self, ticket: Any, why: str) -> None:
        self.bar.set_postfix_str(f"{ticket.id} queued again: {why[:60]}")

    def on_finish(self, ticket: Any, outcome: Any, info: dict[str, Any]) -> None:
        req: GenerationRequest = ticket.payload
        entry: dict[str, Any] = {
            "id": ticket.id,
            "request": public(req),
            "wave": info.get("wave"),
            "group": info.get("group"),
            "node_id": info.get("node_id"),
            "finished_at": time.time(),
        }
        t0 = time.monotonic()
        if outcome.ok:
            name = f"{ticket.id}.mp4"
            tmp = self.out / f".{name}.tmp"
            tmp.write_bytes(outcome.mp4)
            os.replace(tmp, self.out / name)
            entry.update(status="completed", file=name, bytes=len(outcome.mp4),
                         sha256=hashlib.sha256(outcome.mp4).hexdigest(), dp_rank=outcome.dp_rank,
                         seconds=round(outcome.seconds, 3))
        else:
            entry.update(status="cancelled" if outcome.cancelled else "failed", error=outcome.error)
        if outcome.timings:
            entry["timings"] = {**outcome.timings, "store_s": round(time.monotonic() - t0, 4)}
        with self._lock:
            with open(self.out / "manifest.jsonl", "a") as f:
                f.write(json.dumps(entry) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self.failed += 0 if outcome.ok else 1
            self._ended.add(ticket.id)
            self.left -= 1
            self.bar.update(1)
            if self.left == 0:
                self.all_done.set()


class GroupSink:
    """One DP group's view of the shared sink: stamps which group (and node) ran an item."""

    def __init__(self, sink: ManifestSink, index: int) -> None:
        self.sink, self.index = sink, index
        self.dispatcher: Any = None
        self._node: str | None = None  # where the group's placement group landed (asked once)

    def _stamp(self, info: dict[str, Any]) -> dict[str, Any]:
        placement = getattr(self.dispatcher.executor, "placement", None) if self.dispatcher else None
        if self._node is None and placement is not None:
            import ray

            self._node = ray.util.placement_group_table(placement).get("bundles_to_node_id", {}).get(0)
        return {**info, "group": self.index, "node_id": self._node}

    def on_start(self, ticket: Any, info: dict[str, Any]) -> None:
        self.sink.on_start(ticket, self._stamp(info))

    def on_progress(self, ticket_id: str, step: int, total: int) -> None:
        pass

    def on_requeue(self, ticket: Any, why: str) -> None:
        self.sink.on_requeue(ticket, why)

    def on_finish(self, ticket: Any, outcome: Any, info: dict[str, Any]) -> None:
        self.sink.on_finish(ticket, outcome, self._stamp(info))


def parser() -> argparse.ArgumentParser:
    from service.config.args import BATCH, EngineArgs

    p = argparse.ArgumentParser(prog="python -m service.jobs.batch", description=__doc__.split("\n")[0])
    p.add_argument("--prompts", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--model", default=None, help="diffusers pipeline dir (default: demo model)")
    p.add_argument("--num-groups", type=int, default=1,
                   help="DP groups (each its own placement group; on a cluster, a node each)")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS or local)")
    p.add_argument("--image-root", default=None,
                   help="folder (or URL prefix, s3://bucket/images) that lines' images must be under "
                        "(default: the prompts file's folder)")
    EngineArgs.add_cli_args(p, BATCH, defaults={"offload": True, "wave_deadline_base_s": 600.0})
    return p


def feed(groups: list[Any], todo: list[tuple[str, GenerationRequest]], done: threading.Event,
         ahead: int) -> None:
    """Hand items to whichever group has room (``ahead`` queued beyond what it runs), so a
    faster or less loaded group takes more; with one group everything is queued at once."""
    from service.engine.outcome import Outcome
    from service.router.health import Unavailable
    from service.router.queue import Ticket

    def submit(d: Any, item_id: str, req: GenerationRequest) -> None:
        try:
            d.submit(item_id, req.compat_key(), req)
        except Unavailable as e:  # its group gave up starting: the item fails with the reason
            d.sink.on_finish(Ticket(item_id, req.compat_key(), req, time.monotonic()),
                             Outcome(-1, error=str(e)), {})

    if len(groups) == 1:
        for item_id, req in todo:  # all queued before the loop runs (waves: full waves form)
            submit(groups[0], item_id, req)
        return
    items = list(todo)
    while items and not done.is_set():
        for d in sorted(groups, key=lambda d: d.depth + d.held):
            if items and d.depth < ahead:
                item_id, req = items.pop(0)
                submit(d, item_id, req)
        time.sleep(0.02)


def cancel_all(groups: list[Any], sink: ManifestSink, todo: list[tuple[str, GenerationRequest]],
               grace_s: float = 60.0) -> None:
    """Stop the run: queued items are dropped (not in the manifest: a re-run does them), running
    ones stop at their next forward and are recorded ``cancelled``."""
    running = [i for i, _ in todo for d in groups if d.cancel(i) == "running"]
    print(f"batch: stopping: {len(running)} running item(s) cancelled at their next forward", flush=True)
    end = time.monotonic() + grace_s
    while time.monotonic() < end and not sink.ended(running):
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from service.config.args import EngineArgs
    from service.models.adapter import ModelError
    from service.models.registry import request_defaults, resolve_model
    from service.models.startup import check_start

    try:
        items = read_prompts(args.prompts, args.image_root, request_defaults(resolve_model(args.model)))
        config = EngineArgs.from_namespace(args).to_config()
        if args.lora:  # shared flag; lines naming adapters are the next step (docs/lora.md)
            raise ValueError("--lora: the batch job takes no adapters yet (use dloserve generate or serve)")
        if args.num_groups < 1:
            raise ValueError(f"--num-groups must be >= 1, got {args.num_groups}")
        config, adapter = check_start(config, args.model, "cuda" if args.gpus_per_rank != 0 else "cpu")
        for item_id, req in items:
            try:
                adapter.validate(req)
            except RequestError as e:
                raise ValueError(f"{args.prompts}: item {item_id}: {e}") from None
    except (OSError, ValueError, ModelError) as e:
        print(f"batch: error: {e}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    done = finished(args.out)
    todo = [(i, r) for i, r in items if i not in done]
    print(f"batch: {len(items)} items, {len(items) - len(todo)} already done (skipped), "
          f"{len(todo)} to run", flush=True)
    if not todo:
        return 0
    return _run(args, config, todo)


def _run(args: argparse.Namespace, config: Any, todo: list[tuple[str, GenerationRequest]]) -> int:
    from dataclasses import replace

    import ray
    from tqdm import tqdm

    from service.router.build import build_dispatcher
    from service.router.policy import DeadlinePolicy

    ray.init(address=args.address, log_to_driver=False)
    if args.gpus_per_rank is None:  # the cluster's: a GPU per rank where it has GPUs
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
        config = replace(config, parallel=replace(config.parallel, gpus_per_rank=gpus))
    # every item queued at once (waves: full waves form), none waits for a partial wave
    config = replace(config, scheduler=replace(config.scheduler, queue_size=len(todo), max_wait_ms=0.0))
    t0 = time.monotonic()
    bar = tqdm(total=len(todo), desc="videos", unit="video", file=sys.stderr)
    sink = ManifestSink(args.out, len(todo), bar)
    groups = []
    deadlines = DeadlinePolicy(args.wave_deadline_base_s, args.wave_deadline_per_forward_s)
    for i in range(args.num_groups):
        gsink = GroupSink(sink, i)
        gsink.dispatcher = build_dispatcher(config, gsink, deadlines=deadlines, max_attempts=3)
        groups.append(gsink.dispatcher)
    stop = threading.Event()  # SIGTERM (``ray job stop``) or SIGINT: cancel, record, leave
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: (stop.set(), sink.all_done.set()))
    for d in groups:
        d.start()
    try:
        threading.Thread(target=feed, args=(groups, todo, sink.all_done, max(1, args.data_parallel_size)),
                         name="batch-feed", daemon=True).start()
        sink.all_done.wait()
        if stop.is_set():
            cancel_all(groups, sink, todo)
    finally:
        bar.close()
        for d in groups:
            d.stop()
    for d in groups:
        if d.choice:
            print(f"batch: --dlo-mode auto chose {d.choice.mode.value}: {d.choice.reason}", flush=True)
    print(f"batch: {len(todo) - sink.failed} completed, {sink.failed} failed in "
          f"{time.monotonic() - t0:.1f} s; manifest {args.out / 'manifest.jsonl'}", flush=True)
    return 1 if sink.failed else 0


if __name__ == "__main__":
    sys.exit(main())
