"""The ``--lora`` flag: what a path alone tells is refused at parse time, naming the flag."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from service.config import FlagError
from service.models.lora_ref import lora_flags


def flags(*values: str) -> argparse.Namespace:
    return argparse.Namespace(lora=list(values))


def test_a_registered_file_parses_and_uses_default_to_every_registered_one(tmp_path: Path) -> None:
    f = tmp_path / "style.safetensors"
    f.write_bytes(b"x")  # its contents are the registry's to check
    regs, uses = lora_flags(flags(f"style={f}"), uses_allowed=True)
    assert regs == [("style", str(f))] and [u.name for u in uses] == ["style"]


@pytest.mark.parametrize(("source", "said"), [
    ("https://example.com/a.safetensors", "URL sources are not supported"),
    ("s3://bucket/a.safetensors", "URL sources are not supported"),
    ("{tmp}/missing.safetensors", "no such file"),
    ("{tmp}", "not a file"),
])
def test_a_source_that_is_no_local_file_is_refused_naming_the_flag(source: str, said: str,
                                                                   tmp_path: Path) -> None:
    value = f"bad={source.format(tmp=tmp_path)}"
    with pytest.raises(FlagError, match=said) as e:
        lora_flags(flags(value))
    assert f"--lora {value!r}" in str(e.value)
