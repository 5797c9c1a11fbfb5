"""The flags of ``dloserve serve`` and what they become: a ServiceConfig (the Serve app's
``args``), the results URL and the API-key hashes. Parsing only; ``launch`` runs it."""

from __future__ import annotations

import argparse
import json
import os
import uuid
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    from service.config.args import SERVE, EngineArgs

    p.add_argument("model", nargs="?", default=None, help="diffusers pipeline dir (default: demo)")
    EngineArgs.add_cli_args(p, SERVE)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                   help="Ray cluster to join (default: start a local one)")
    p.add_argument("--num-replicas", type=int, default=1, help="DP groups (one per replica)")
    p.add_argument("--max-width", type=int, default=1280)
    p.add_argument("--max-height", type=int, default=1280)
    p.add_argument("--max-pixels", type=int, default=1280 * 720)
    p.add_argument("--max-frames", type=int, default=129)
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--results-url", "--results-dir", dest="results_url", default=None,
                   help="folder or fsspec URL (s3://bucket/prefix) for job records and MP4s, seen "
                        "by every replica (default ~/.cache/dloserve/results/port-PORT; locked)")
    p.add_argument("--storage-options", type=json.loads, default={}, metavar="JSON",
                   help='fsspec options for --results-url, e.g. \'{"endpoint_url": "http://minio:9000"}\' '
                        "(credentials: the usual environment, e.g. AWS_ACCESS_KEY_ID)")
    p.add_argument("--group-timeout-s", type=float, default=30.0,
                   help="a replica (DP group) silent this long is lost: its jobs fail with a reason")
    p.add_argument("--retention-s", type=float, default=86400.0, help="keep finished jobs this long")
    p.add_argument("--max-jobs", type=int, default=1000, help="keep at most this many jobs")
    p.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' (repeatable); jobs belong to their key. "
                        "Visible in the process list: prefer --api-key-file or DLOSERVE_API_KEYS")
    p.add_argument("--api-key-file", default=None,
                   help="one API key per line: KEY, or KEY max_queued=N max_running=N (that key's "
                        "own limits); '#' starts a comment line")
    p.add_argument("--admin-key", action="append", default=None,
                   help="a key that reads /readyz's detail and every key's /v1/waves (repeatable; "
                        "visible in the process list: prefer --admin-key-file)")
    p.add_argument("--admin-key-file", default=None, help="one admin key per line")
    p.add_argument("--max-queued-per-key", type=int, default=16,
                   help="queued jobs per API key; beyond it 429 quota_exceeded (0: no limit but "
                        "--queue-size)")
    p.add_argument("--max-running-per-key", type=int, default=0,
                   help="jobs per API key on ranks at once (0: as many as are free)")
    p.add_argument("--lora-dir", action="append", default=[], metavar="FOLDER",
                   help="POST /v1/loras may register .safetensors files under FOLDER (repeatable; "
                        "none: adapters come only from --lora NAME=PATH at start)")
    p.add_argument("--webhook-url", default=None,
                   help="POST signed video.completed / video.failed / video.cancelled events of every "
                        "job to URL (Standard Webhooks; needs --webhook-secret-file). A key's own: the "
                        "key file's webhook_url= and webhook_secret=")
    p.add_argument("--webhook-secret-file", default=None,
                   help="file holding the whsec_<base64> secret that signs --webhook-url's events")
    p.add_argument("--webhook-allow-private", action="store_true",
                   help="let webhooks (the instance's and keys') go to loopback, private and link-local "
                        "addresses; without it a target resolving to one is refused at each connect")
    p.add_argument("--max-body-bytes", type=int, default=65536,
                   help="larger request bodies are refused with 413 before they are read")
    p.add_argument("--body-timeout-s", type=float, default=10.0,
                   help="a request body must arrive within this long, or 408 (slow clients)")
    p.add_argument("--first-byte-timeout-s", type=float, default=3.0,
                   help="a request body must start within this long, or 408 (headers sent, then nothing)")
    p.add_argument("--max-uploads-per-key", type=int, default=8,
                   help="request bodies one API key may send at once; more get 429 at once (0: no cap)")
    p.add_argument("--max-uploads-per-address", type=int, default=16,
                   help="request bodies one client address may send at once (0: no cap; behind a "
                        "proxy every client has the proxy's address)")
    p.add_argument("--max-image-bytes", type=int, default=8 * 2**20,
                   help="largest input_reference image file; where the model takes images a body may be "
                        "this much larger than --max-body-bytes (x 4/3 for base64 in JSON)")
    p.add_argument("--max-image-pixels", type=int, default=4096 * 4096,
                   help="largest input_reference image (width x height from its header, before decoding); "
                        "the service also caps it at its largest video, --max-width x --max-height")
    p.add_argument("--drain-timeout-s", type=float, default=60.0,
                   help="on SIGTERM: how long running jobs may take to finish")
    p.add_argument("--ready-timeout-s", type=float, default=1800.0)
    p.add_argument("--rank-prestart", action=argparse.BooleanOptionalAction, default=True,
                   help="on a cluster of its own with one replica: start the rank processes right after "
                        "Ray, so they import while Serve and the ingress start (default on)")
    p.add_argument("--ray-dashboard", action=argparse.BooleanOptionalAction, default=False,
                   help="on a cluster of its own: start Ray's dashboard (127.0.0.1:8265; `ray job submit`, "
                        "`ray list`, `serve status`); off by default: it delays Ray's start by seconds")
    p.add_argument("--join-timeout-s", type=float, default=60.0,
                   help="with --address: give up joining the cluster after this long")


def config_from_args(args: argparse.Namespace, gpus_per_rank: float, engine: Any = None) -> Any:
    """The ServiceConfig of the flags (FlagError naming a bad one): ``engine``, the EngineConfig
    ``launch`` checked at start (else made here from the flags), with the GPUs and CPUs per rank
    resolved since (the cluster's, the host's) in place."""
    from dataclasses import replace

    from service.api.service import ServiceConfig
    from service.config.args import EngineArgs
    from service.models.lora_ref import lora_flags

    engine = engine or EngineArgs.from_namespace(args).to_config()
    engine = replace(engine, parallel=replace(engine.parallel, gpus_per_rank=gpus_per_rank,
                                              **({} if args.cpus_per_rank is None
                                                 else {"cpus_per_rank": args.cpus_per_rank})))
    extra: dict[str, Any] = {"results_url": results_url(args), "group_timeout_s": args.group_timeout_s,
                             "storage_options": args.storage_options}
    quotas = api_keys(args)
    return ServiceConfig(
        **ServiceConfig.from_engine(engine),
        model=args.model,
        cpus_per_rank_why=getattr(args, "cpus_per_rank_why", None) or (
            "the default" if args.cpus_per_rank is None else "--cpus-per-rank"),
        num_replicas=args.num_replicas,
        retention_s=args.retention_s,
        max_jobs=args.max_jobs,
        limits={
            "max_width": args.max_width,
            "max_height": args.max_height,
            "max_pixels": args.max_pixels,
            "max_frames": args.max_frames,
            "max_steps": args.max_steps,
        },
        deadline={
            "base_s": args.wave_deadline_base_s,
            "per_forward_s": args.wave_deadline_per_forward_s,
        },
        instance=uuid.uuid4().hex[:12],
        api_key_hashes=sorted(quotas),
        key_quotas={h: q for h, q in quotas.items() if q},
        admin_key_hashes=admin_key_hashes(args),
        max_queued_per_key=args.max_queued_per_key or None,
        max_running_per_key=args.max_running_per_key or None,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout_s,
        first_byte_timeout_s=args.first_byte_timeout_s,
        max_uploads_per_key=args.max_uploads_per_key or None,
        max_uploads_per_address=args.max_uploads_per_address or None,
        loras=dict(lora_flags(args)[0]),
        lora_dirs=list(args.lora_dir),
        max_image_bytes=args.max_image_bytes,
        max_image_pixels=args.max_image_pixels,
        **webhook_settings(args),
        **extra,
    )


def webhook_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The instance's webhook (the secret file checked here, its path made absolute) and each
    key's own from the key file, by key hash. WebhookConfigError or OSError names what is wrong."""
    from service.api.keys import key_hash, parse_key_lines
    from service.api.webhooks import WebhookConfigError, check_url, parse_secret, warn_of

    out: dict[str, Any] = {}
    if bool(args.webhook_url) != bool(args.webhook_secret_file):
        raise WebhookConfigError("--webhook-url and --webhook-secret-file go together")
    if args.webhook_url:
        path = os.path.abspath(os.path.expanduser(args.webhook_secret_file))
        with open(path) as f:
            parse_secret(f.read(), f"--webhook-secret-file {path}")
        out.update(webhook_url=check_url(args.webhook_url, "--webhook-url"), webhook_secret_file=path)
    if args.api_key_file:
        with open(args.api_key_file) as f:
            hooks = {key_hash(e.key): e.webhook for e in parse_key_lines(f, args.api_key_file) if e.webhook}
        if hooks:
            out["key_webhooks"] = hooks
    if args.webhook_allow_private:
        out["webhook_allow_private"] = True
    warn_of(out, args.api_key_file)
    return out


def results_url(args: argparse.Namespace) -> str:
    """The flag's URL (a relative folder made absolute: replicas run elsewhere), or one folder
    per instance: an instance is its port on this machine."""
    url = args.results_url or os.path.join("~", ".cache", "dloserve", "results", f"port-{args.port}")
    return url if "://" in url else os.path.abspath(os.path.expanduser(url))


def key_entries(args: argparse.Namespace) -> list[Any]:
    """Every API key from --api-key, --api-key-file and DLOSERVE_API_KEYS, as KeyEntry."""
    from service.api.keys import KeyEntry, parse_key_lines

    entries = [KeyEntry(k) for k in args.api_key or []]
    if args.api_key_file:
        with open(args.api_key_file) as f:
            entries += parse_key_lines(f, args.api_key_file)
    return entries + [KeyEntry(k.strip()) for k in os.environ.get("DLOSERVE_API_KEYS", "").split(",")
                      if k.strip()]


def api_keys(args: argparse.Namespace) -> dict[str, dict[str, int]]:
    """SHA-256 of every key from --api-key, --api-key-file and DLOSERVE_API_KEYS, each with
    its own limits from the key file (empty: the flags' defaults); the keys themselves never
    leave this process (the Serve config carries only hashes). OSError or KeyFileError for
    a file that cannot be read."""
    from service.api.keys import key_hash

    out: dict[str, dict[str, int]] = {}
    for e in key_entries(args):
        out.setdefault(key_hash(e.key), {}).update(e.quota)
    return out


def api_key_hashes(args: argparse.Namespace) -> list[str]:
    return sorted(api_keys(args))


def admin_key_hashes(args: argparse.Namespace) -> list[str]:
    """SHA-256 of every --admin-key and --admin-key-file key (a file's lines: one key each)."""
    from service.api.keys import key_hash, parse_key_lines

    keys = list(args.admin_key or [])
    if args.admin_key_file:
        with open(args.admin_key_file) as f:
            keys += [e.key for e in parse_key_lines(f, args.admin_key_file)]
    return sorted({key_hash(k) for k in keys})
