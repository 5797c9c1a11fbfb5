"""Every ``dloserve serve`` flag is one setting: its ServiceConfig field has the flag's name and
default, and setting the flag sets that field (fast: parsing only, no Ray)."""

from __future__ import annotations

import argparse
import warnings
from typing import Any

import pytest

from service.api.config import ServiceConfig
from service.api.serve_flags import add_arguments, config_from_args, service_flags
from service.config.engine import OFFLOAD_KEYS, offload_mapping

# Flags that are the launcher's, not a setting of the service (or that become one by a
# rule: keys become their hashes, the results folder gets the port's default).
LAUNCHER = {"help", "model", "host", "port", "address", "drain_timeout_s", "ready_timeout_s",
            "ray_dashboard", "join_timeout_s", "results_url", "api_key", "api_key_file", "admin_key",
            "admin_key_file", "lora", "webhook_url", "webhook_secret_file"}  # the pair: test_webhooks
# The engine flags that are keys of the Serve config's one ``offload`` mapping, by flag.
OFFLOAD = {"offload": "mode", "dlo_mode": "mode", "dlo_no_use_allgather": "mode",
           "dlo_resident_layers": "resident_layers", "dlo_device_memory_gb": "device_memory_gb",
           "dlo_device_share": "device_share", "dlo_components": "components",
           "dlo_probe_size": "probe_shape",
           "dtype": "dtype", "quantization": "quantization", "cfg_batch": "cfg_batch", "compile": "compile",
           "attention": "attention", "cache": "cache", "lora_cache_gb": "lora_cache_gb"}
# Where a flag's words need a value of their own form (the rest: the type's next value).
WORDS = {"dlo_components": "dit,vae", "dlo_device_share": "0.25", "dlo_probe_size": "64x32x5",
         "cache": "first_block",
         "storage_options": '{"anon": true}', "lora_dir": "/adapters", "webhook_url": "https://example.com/h"}
ON = ["--enable-distributed-layerwise-offload"]  # the dlo_ flags need offload on


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p


def config(*argv: str) -> ServiceConfig:
    args = parser().parse_args(["/m", *argv])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # --dlo-no-use-allgather says it is deprecated
        return config_from_args(args, args.gpus_per_rank or 0.0)


def other(action: argparse.Action) -> list[str]:
    """The command-line words that give ``action`` a value other than its default."""
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [flag if not action.default else f"--no-{flag[2:]}"]
    if action.nargs == 0:  # store_true
        return [flag]
    if action.dest in WORDS:
        return [flag, WORDS[action.dest]]
    if action.choices:
        return [flag, next(str(c) for c in action.choices if c != action.default)]
    default = action.default if isinstance(action.default, (int, float)) else 2
    return [flag, str(default + 1)]


def test_every_flag_default_is_its_fields() -> None:
    """No flag given: every field as ServiceConfig's own default (one default, written once).
    One difference, on purpose: without --enable-distributed-layerwise-offload the CLI keeps
    the transformer resident; a Serve config that names no offload mode gets auto."""
    made, own = config(), ServiceConfig()
    set_by_launcher = {"model", "instance", "results_url", "cpus_per_rank_why"}
    for name in ServiceConfig.model_fields:
        if name not in set_by_launcher | {"offload"}:
            assert getattr(made, name) == getattr(own, name), name
    own_offload = offload_mapping(own.engine_config())
    assert (made.offload.pop("mode"), own_offload.pop("mode")) == ("resident", "auto")
    assert made.offload == own_offload


@pytest.mark.parametrize("action", [a for a in parser()._actions if a.dest not in LAUNCHER],
                         ids=lambda a: a.dest)
def test_every_flag_sets_the_field_of_its_name(action: argparse.Action) -> None:
    """The flag's dest is the field's name (or a key of the offload mapping), and the flag's
    value lands there: nothing is read under a second name."""
    base = ON if action.dest.startswith("dlo_") or "--no-offload" in action.option_strings else []
    before, after = config(*base), config(*base, *other(action))
    if action.dest in OFFLOAD:
        key = OFFLOAD[action.dest]
        assert key in OFFLOAD_KEYS
        assert after.offload[key] != before.offload[key], key
        return
    assert action.dest in ServiceConfig.model_fields, f"--{action.dest}: no field of that name"
    got: Any = getattr(after, action.dest)
    assert got != getattr(before, action.dest), action.dest
    words = other(action)
    if len(words) == 2 and action.type in (int, float):
        assert got == action.type(words[1])


def test_field_flags_are_declared_from_their_field() -> None:
    """The service's flags carry the field's default and description, and nothing else declares
    a flag for them."""
    p = parser()
    by_dest = {a.dest: a for a in p._actions}
    for name, info, _ in service_flags():
        assert by_dest[name].default == info.get_default(call_default_factory=True)
        assert by_dest[name].help == info.description


def test_old_serve_config_keys_still_work_and_say_the_new_one() -> None:
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        cfg = ServiceConfig(dp_size=2, limits={"max_steps": 7}, deadline={"base_s": 1.0})
    assert [str(w.message) for w in said if w.category is FutureWarning] == [
        "Serve config key dp_size is deprecated: write data_parallel_size",
        "Serve config key limits is deprecated: write max_steps",
        "Serve config key deadline is deprecated: write wave_deadline_base_s"]
    assert (cfg.data_parallel_size, cfg.max_steps, cfg.wave_deadline_base_s) == (2, 7, 1.0)
    with pytest.raises(ValueError, match="dp_size and data_parallel_size both given"):
        ServiceConfig(dp_size=2, data_parallel_size=2)
    with pytest.raises(ValueError, match=r"limits: unknown setting\(s\) \['max_wdith'\]"):
        ServiceConfig(limits={"max_wdith": 2})
