"""The flags of ``dloserve serve`` and what they become: a ServiceConfig (the Serve app's
``args``), the results URL and the API-key hashes. Parsing only; ``launch`` runs it.

Each setting's flag is declared from its field (ServiceConfig's marked ``Flag``, EngineArgs'),
its default written there once; here only what is no field: the results folder's per-port
default, the keys (the config holds their hashes), the webhook pair and the launcher's own."""

from __future__ import annotations

import argparse
import json
import os
import types
import typing
import uuid
from typing import Any

SERVICE = "service"  # the flags declared from ServiceConfig's fields


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``dloserve serve`` flags: the engine's (EngineArgs), the service's (one per
    ServiceConfig field marked ``Flag``, declared from the field) and the launcher's own."""
    from service.config.args import SERVE, EngineArgs

    p.add_argument("model", nargs="?", default=None, help="diffusers pipeline dir (default: demo)")
    EngineArgs.add_cli_args(p, SERVE)
    g = p.add_argument_group(SERVICE)
    for name, info, flag in service_flags():
        g.add_argument(*(flag.names or (f"--{name.replace('_', '-')}",)), dest=name,
                       help=info.description, **_argparse_kw(info, flag))
    g.add_argument("--results-url", "--results-dir", dest="results_url", default=None,
                   help="folder or fsspec URL (s3://bucket/prefix) for job records and MP4s, seen "
                        "by every replica (default ~/.cache/dloserve/results/port-PORT; locked)")
    g.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' (repeatable); jobs belong to their key. "
                        "Visible in the process list: prefer --api-key-file or DLOSERVE_API_KEYS")
    g.add_argument("--api-key-file", default=None,
                   help="one API key per line: KEY, or KEY max_queued=N max_running=N (that key's "
                        "own limits); '#' starts a comment line")
    g.add_argument("--admin-key", action="append", default=None,
                   help="a key that reads /readyz's detail and every key's /v1/waves (repeatable; "
                        "visible in the process list: prefer --admin-key-file)")
    g.add_argument("--admin-key-file", default=None, help="one admin key per line")
    g.add_argument("--webhook-url", default=None,
                   help="POST signed video.completed / video.failed / video.cancelled events of every "
                        "job to URL (Standard Webhooks; needs --webhook-secret-file). A key's own: the "
                        "key file's webhook_url= and webhook_secret=")
    g.add_argument("--webhook-secret-file", default=None,
                   help="file holding the whsec_<base64> secret that signs --webhook-url's events")
    g.add_argument("--webhook-allow-private", action="store_true",
                   help="let webhooks (the instance's and keys') go to loopback, private and link-local "
                        "addresses; without it a target resolving to one is refused at each connect")
    launcher = p.add_argument_group("launcher")
    launcher.add_argument("--host", default="127.0.0.1")
    launcher.add_argument("--port", type=int, default=8000)
    launcher.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                          help="Ray cluster to join (default: start a local one)")
    launcher.add_argument("--drain-timeout-s", type=float, default=60.0,
                          help="on SIGTERM: how long running jobs may take to finish")
    launcher.add_argument("--ready-timeout-s", type=float, default=1800.0)
    launcher.add_argument("--ray-dashboard", action=argparse.BooleanOptionalAction, default=False,
                          help="on a cluster of its own: start Ray's dashboard (127.0.0.1:8265; `ray job "
                               "submit`, `ray list`, `serve status`); off by default: it delays Ray's "
                               "start by seconds")
    launcher.add_argument("--join-timeout-s", type=float, default=60.0,
                          help="with --address: give up joining the cluster after this long")


def service_flags() -> list[tuple[str, Any, Any]]:
    """(name, pydantic FieldInfo, Flag) of every ServiceConfig field that is a flag."""
    from service.api.config import Flag, ServiceConfig

    out = []
    for name, info in ServiceConfig.model_fields.items():
        flag = next((m for m in info.metadata if isinstance(m, Flag)), None)
        if flag is not None:
            out.append((name, info, flag))
    return out


def _argparse_kw(info: Any, flag: Any) -> dict[str, Any]:
    """``add_argument``'s type and default from the field: its annotation (None dropped), its
    default (a fresh list or mapping each parse)."""
    ann = info.annotation
    if typing.get_origin(ann) in (typing.Union, types.UnionType):  # X | None: X
        ann = next(t for t in typing.get_args(ann) if t is not type(None))
    kind = typing.get_origin(ann) or ann
    kw: dict[str, Any] = {"default": info.get_default(call_default_factory=True)}
    if kind is dict:
        kw["type"] = json.loads
    elif kind is bool:
        kw["action"] = argparse.BooleanOptionalAction
    elif kind is not list:
        kw["type"] = kind
    return {**kw, **flag.kw}


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
    flags = {name: (getattr(args, name) or None) if flag.zero_is_none else getattr(args, name)
             for name, _, flag in service_flags()}
    quotas = api_keys(args)
    return ServiceConfig(
        **ServiceConfig.from_engine(engine),
        **flags,
        model=args.model,
        cpus_per_rank_why=getattr(args, "cpus_per_rank_why", None) or (
            "the default" if args.cpus_per_rank is None else "--cpus-per-rank"),
        wave_deadline_base_s=args.wave_deadline_base_s,
        wave_deadline_per_forward_s=args.wave_deadline_per_forward_s,
        instance=uuid.uuid4().hex[:12],
        results_url=results_url(args),
        api_key_hashes=sorted(quotas),
        key_quotas={h: q for h, q in quotas.items() if q},
        admin_key_hashes=admin_key_hashes(args),
        loras=dict(lora_flags(args)[0]),
        **webhook_settings(args),
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
