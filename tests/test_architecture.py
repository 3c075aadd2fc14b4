"""The package's layers, read from the source: no import cycle (imports inside functions and under
``TYPE_CHECKING`` counted), and every import points to the same layer or one below (docs/architecture.md). And the
test folders mirror the package: a subpackage's tests in the folder of its name, a top-level module's at the top."""

from __future__ import annotations

import ast
from pathlib import Path

import klgrad

SRC = Path(klgrad.__file__).parent

LAYERS: tuple[tuple[str, ...], ...] = (
    ("choices", "machine", "version", "fmt", "flags", "plotting", "runlock", "stopping", "threads"),
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
            elif isinstance(node, ast.Call) and _dynamic_import(node) is not None:  # __import__("klgrad.x")
                edges.add(resolve(_dynamic_import(node)))
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


def _dynamic_import(call: ast.Call) -> str | None:
    """The klgrad module a call imports by name (``__import__("klgrad")``, ``importlib.import_module("klgrad.x")``,
    a string literal), or None."""
    fn = call.func
    name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None
    if name not in ("__import__", "import_module") or not call.args:
        return None
    arg = call.args[0]
    is_klgrad = isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.split(".")[0] == "klgrad"
    return arg.value if is_klgrad else None


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


DYNAMIC = ("klgrad", "klgrad.import_path")


def test_no_module_hides_an_import_from_the_graph():
    """Every import is a statement or a literal name the graph reads: no ``__import__`` call anywhere, and
    ``import_module`` of a computed name only in the package's lazy loader (its targets are ``_HOME``'s, below
    it) and in :mod:`klgrad.import_path` (a user's ``package.module:name``, never a klgrad module)."""
    hidden = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func
            called = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
            literal = bool(node.args) and isinstance(node.args[0], ast.Constant)
            if called == "__import__" or (called == "import_module" and not literal and name not in DYNAMIC):
                hidden.append(f"{name}:{node.lineno}")
    assert hidden == []
    assert import_graph()["klgrad.trainer.record"] >= {"klgrad.version"}


def test_every_module_has_a_layer():
    for module in import_graph():
        _layer(module)


TESTS = Path(__file__).resolve().parent
CHECKOUT_SRC = TESTS.parent / "src" / "klgrad"
WHOLE_PACKAGE = {
    "test_architecture.py": "the layers of every module, and this layout",
    "test_gpu.py": "train, the fast forward and the sampler on a CUDA GPU (tools/gpu_check.sh runs it by name)",
    "test_package_data.py": "what a wheel of the package carries",
    "test_reference_docs.py": "the hand-written reference pages against the whole package",
    "test_readme.py": "README.md's framework table against the audit and its presets",
}
"""Top-level test modules about the package as a whole rather than one module, with what each covers."""
OTHER_FOLDERS = {
    "helpers": "the shared helpers, the package tests.helpers",
}


def test_test_folders_mirror_the_package():
    """A folder of tests/ is a subpackage of src/klgrad/ (or one of OTHER_FOLDERS), and every subpackage has one; a
    test module at the top is named after a top-level module (test_<module>.py, or test_<module>_<aspect>.py) or is
    about the package as a whole (WHOLE_PACKAGE)."""
    subpackages = {p.name for p in CHECKOUT_SRC.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.stem for p in CHECKOUT_SRC.glob("*.py")} - {"__init__", "__main__"}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert sorted(folders - subpackages - OTHER_FOLDERS.keys()) == [], "a test folder that mirrors no subpackage"
    assert sorted(subpackages - folders) == [], "a subpackage without its test folder"
    misplaced = []
    for path in sorted(TESTS.glob("*.py")):
        name = path.stem.removeprefix("test_")
        if path.name in {"__init__.py", *WHOLE_PACKAGE}:
            continue
        if path.name == f"test_{name}.py" and any(name == m or name.startswith(f"{m}_") for m in modules):
            continue
        misplaced.append(path.name)
    assert misplaced == [], "move these into the folder of the subpackage they test"
    for folder in folders - {"helpers"}:
        strays = [p.name for p in (TESTS / folder).glob("*.py") if not p.name.startswith("test_")]
        assert strays == [], f"tests/{folder}/ holds test modules only; shared code goes to tests/helpers/"


CHECKOUT = TESTS.parent


def test_studies_live_in_experiments_and_tooling_in_tools():
    """The library is src/klgrad/; each study is a folder of experiments/ with its README (its claims) beside its
    evidence and its drivers; repository tooling (the GPU check, the wheelhouse, the verl venv) is tools/; there is
    no scripts/ folder, and results/ keeps only the GPU machines' reports. A test of a study's or a tool's script
    sits beside the script (test_<script>.py) and names one that exists; test_readme.py checks the study's README
    against its files."""
    assert not (CHECKOUT / "scripts").exists(), "study drivers go to experiments/<study>/, tooling to tools/"
    assert sorted(p.name for p in (CHECKOUT / "results").iterdir()) == ["gpu"]
    studies = [p for p in (CHECKOUT / "experiments").iterdir() if p.is_dir()]
    assert studies, "experiments/ holds the studies"
    for folder in [*studies, CHECKOUT / "tools"]:
        assert folder.name == "tools" or (folder / "README.md").is_file(), f"{folder.name} has no README.md"
        scripts = {p.stem for p in folder.iterdir() if p.suffix in {".py", ".sh"} and not p.name.startswith("test_")}
        tested = {p.stem.removeprefix("test_") for p in folder.glob("test_*.py")} - {"readme"}  # README vs files
        assert sorted(tested - scripts) == [], f"{folder.name}: test_<script>.py for a script that is not there"
