"""No import cycles: between the subpackages (``megatron_oar.models``, ``megatron_oar.rollout``,
..., the converter ``checkpoints_convert``, and the top-level modules such as
``megatron_oar.config``), and between the modules inside each. Every import counts, the lazy
ones inside functions too: a cycle that only closes at call time is still a cycle to a reader.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megatron_oar", "checkpoints_convert")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _imports(path: Path, mods: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports (``from pkg import sub`` resolves to ``pkg.sub``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                     for a in node.names]
        else:
            continue
        out.update(n for n in names if n in mods)
    return out


def _unit(module: str) -> str:
    """The subpackage (or top-level module) a module belongs to."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "megatron_oar" else parts[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _graphs() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    mods = _modules()
    units, modules = defaultdict(set), defaultdict(set)
    for mod, path in mods.items():
        for dep in _imports(path, mods):
            # a package's __init__ re-exporting its own modules is not an edge back up
            if dep.startswith(mod + ".") and path.name == "__init__.py":
                continue
            if mod.startswith(dep + ".") and (mods[dep].name == "__init__.py"):
                continue  # ``from pkg import sibling`` inside pkg resolved above; pkg itself is its init
            modules[mod].add(dep)
            if _unit(dep) != _unit(mod):
                units[_unit(mod)].add(_unit(dep))
    return units, modules


def test_no_cycle_between_subpackages():
    units, _ = _graphs()
    assert _cycles(units) == []


def test_no_cycle_between_modules():
    _, modules = _graphs()
    assert _cycles(modules) == []


def test_the_graph_sees_the_imports():
    """The checker itself: known downward edges are there, and a planted cycle is found."""
    units, modules = _graphs()
    assert "megatron_oar.models" in units["checkpoints_convert"]
    assert "megatron_oar.rewards.extract" in modules["megatron_oar.rewards.pool"]
    planted = {k: set(v) for k, v in units.items()}
    planted["megatron_oar.models"].add("checkpoints_convert")
    assert ["checkpoints_convert", "megatron_oar.models"] in _cycles(planted)
