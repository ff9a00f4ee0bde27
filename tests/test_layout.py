"""The package's shape: no import circle (module-level and function-level imports alike), no module over 450 lines,
and the encoder's work modules are given the encoder rather than importing it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "diffusion_embedder"
MAX_LINES = 450
#: Modules that do the Encoder's work: given the encoder (or its class), they never import it.
ENCODER_WORK = ("loading", "inference", "folders", "export")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """The package modules ``name`` imports anywhere in its source: at module level, in functions, and under
    ``TYPE_CHECKING``. ``from pkg import x`` counts as importing ``pkg.x`` when that is a module, else ``pkg``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


GRAPH = {name: imports_of(name) for name in MODULES}


def test_the_import_graph_has_no_circle():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_finder_sees_function_level_and_relative_imports():
    """The checker itself: an import inside a function closes a circle; ``from . import x`` resolves."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert "diffusion_embedder.export" in GRAPH["diffusion_embedder.encoder"]  # imported at module level
    assert "diffusion_embedder.encoder" in GRAPH["diffusion_embedder.export_cli"]  # imported inside main()
    assert "diffusion_embedder.data.batching" in GRAPH["diffusion_embedder.data"]  # from .batching import ...


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_over_450_lines(name):
    lines = len(MODULES[name].read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name].relative_to(PACKAGE.parent)} has {lines} lines (at most {MAX_LINES})"


@pytest.mark.parametrize("name", ENCODER_WORK)
def test_the_encoders_work_modules_never_import_it(name):
    """loading gets the class, inference / folders / export the instance: the encoder sits above them."""
    module = f"diffusion_embedder.{name}"
    reachable, todo = set(), [module]
    while todo:
        for nxt in GRAPH[todo.pop()] - reachable:
            reachable.add(nxt)
            todo.append(nxt)
    assert "diffusion_embedder.encoder" not in reachable, f"{module} reaches diffusion_embedder.encoder"
