"""The package's layers, read from the source: no import cycle (imports inside functions and under
``TYPE_CHECKING`` counted), and every import points to the same layer or one below (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import klgrad

SRC = Path(klgrad.__file__).parent

LAYERS: tuple[tuple[str, ...], ...] = (
    ("choices", "machine", "option_rules", "fmt", "plotting", "runlock", "stopping", "threads"),
    ("import_path", "config", "schedule", "advantages"),
    ("kl", "data", "models", "distributed"),
    ("rewards", "logprobs", "rollout", "exact", "objective"),
    ("audit", "integrations", "trainer", "sft"),
    ("eval", "export", "compare", "reproduce", "docs"),
    ("completion", "cli", "__main__", ""),
)
"""Bottom to top, by top-level name under ``klgrad`` ("" is the package itself, whose names load lazily)."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """klgrad module -> the klgrad modules it imports anywhere in its source (``from klgrad.x import y`` counts as
    ``klgrad.x.y`` when that is a module, else ``klgrad.x``)."""
    modules = _modules()

    def resolve(name: str) -> str:
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges |= {resolve(a.name) for a in node.names if a.name.split(".")[0] == "klgrad"}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                if base.split(".")[0] != "klgrad":
                    continue
                for a in node.names:
                    full = f"{base}.{a.name}"
                    edges.add(full if full in modules else resolve(base))
        graph[name] = edges - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module} is in no layer of LAYERS: place it")


def test_no_import_cycle_counting_imports_inside_functions():
    assert _cycles(import_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_only_point_down_the_layers():
    upward = sorted(f"{m} -> {d}" for m, deps in import_graph().items() for d in deps if _layer(d) > _layer(m))
    assert upward == []


def test_every_module_has_a_layer():
    for module in import_graph():
        _layer(module)
