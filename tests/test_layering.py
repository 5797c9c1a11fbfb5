"""The package's shape: imports point one way, nothing imports in a circle, the dispatcher
imports no Ray (nor torch), the CLIs' flag modules import no torch. ``config`` (plain data)
sits between ``models`` and ``offload``: it speaks the offload library's mode enum, and every
layer above reads it.

Checked on the source (every ``import`` statement, module level or not) and in fresh
interpreters (what importing a module really pulls in)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["api", "jobs", "router", "engine", "models", "config", "offload"]  # each may import only later ones
SAME_LEVEL = {"api": {"jobs"}, "jobs": {"api"}}  # the two front ends do not import each other either


def imports(path: Path) -> set[str]:
    """The service.* modules a file imports, resolved to dotted names."""
    tree = ast.parse(path.read_text())
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("service")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("service"):
                source = node.module
            else:
                continue
            out.add(source)
            # ``from . import demo`` / ``from service.models import demo`` import a module too
            out |= {f"{source}.{a.name}" for a in node.names if is_module(f"{source}.{a.name}")}
    return out


def is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_imports_point_one_way() -> None:
    wrong = []
    for path in (ROOT / "service").rglob("*.py"):
        here = layer(".".join(path.relative_to(ROOT).with_suffix("").parts))
        if here is None:
            continue  # service/cli.py sits above everything
        for mod in imports(path):
            there = layer(mod)
            if there is None or there == here:
                continue
            if LAYERS.index(there) < LAYERS.index(here) or there in SAME_LEVEL.get(here, ()):
                wrong.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not wrong, wrong


def test_no_module_imports_in_a_circle() -> None:
    graph: dict[str, set[str]] = {}
    for path in (ROOT / "service").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = {m for m in imports(path) if m != name}
    seen: dict[str, int] = {}  # 1: on the stack, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        seen[node] = 1
        for nxt in graph.get(node, ()):
            if seen.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt in graph and nxt not in seen:
                visit(nxt, [*stack, nxt])
        seen[node] = 2

    for n in sorted(graph):
        if n not in seen:
            visit(n, [n])
    assert not cycles, cycles


def loaded(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_the_dispatcher_imports_neither_ray_nor_torch() -> None:
    top = loaded("service.router.dispatcher")
    assert "ray" not in top and "torch" not in top, sorted(top)


def test_the_flag_modules_import_no_torch() -> None:
    for module in ("service.config.args", "service.api.serve_flags"):
        assert "torch" not in loaded(module), module


def test_the_models_package_names_exist() -> None:
    """``service.models`` resolves its names lazily: each must be where the table says."""
    import service.models as models

    for name in models.__all__:
        assert getattr(models, name) is not None, name
