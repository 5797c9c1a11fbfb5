"""Every exception class in ``service/`` survives pickling.

Ray (and the local launcher's pipe) rebuild a rank's exception in the caller by unpickling
it. A class whose ``__init__`` takes other arguments than ``self.args`` holds does not
unpickle; Ray then reports a system error, which reads as a dead rank: one bad request
would rebuild the whole group. So each class is found on the source, built with sample
arguments, and round-tripped.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pickle
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = {str: "field", int: 3, float: 1.5, bool: True}


def exception_classes() -> list[type[BaseException]]:
    """Every class defined in a ``service`` module that derives from BaseException."""
    found: list[type[BaseException]] = []
    for path in sorted((ROOT / "service").rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
        if not names:
            continue
        module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for name in names:
            cls = getattr(module, name)
            if isinstance(cls, type) and issubclass(cls, BaseException) and cls.__module__ == module.__name__:
                found.append(cls)
    return found


def sample(cls: type[BaseException]) -> BaseException:
    """An instance built from each parameter's annotation (strings by default)."""
    sig = inspect.signature(cls.__init__)
    hints = getattr(cls.__init__, "__annotations__", {})
    args = []
    for p in list(sig.parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty:
            continue
        kind = hints.get(p.name, "str")
        args.append(next((v for t, v in SAMPLE.items() if t.__name__ == str(kind)), "value"))
    return cls(*args) if args else cls("a message")


CLASSES = exception_classes()


def test_the_walk_finds_the_request_errors() -> None:
    names = {c.__name__ for c in CLASSES}
    assert {"RequestError", "BodyError", "LoraError", "CacheError", "QueueFull", "QuotaExceeded",
            "Unavailable", "CheckpointError"} <= names


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_round_trip(cls: type[BaseException]) -> None:
    e = sample(cls)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is cls
    assert str(back) == str(e)
    assert back.args == e.args
    assert vars(back) == vars(e)
