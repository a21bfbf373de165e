"""Imports run one way: workers → graph_state, model, stream; the fraud example sits on top of them all.

Every import statement of every module is read with ``ast`` (function-level
ones included), so a lazy import counts as much as one at the top. Our
packages are imported only as ``gnnstream.*``: a generic top-level name
(``import model``) would pick up whatever else is installed under it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("stream", "graph_state", "model", "workers", "fraud")

# the packages each one may import besides itself
ALLOWED = {
    "stream": set(),
    "graph_state": set(),
    "model": set(),
    "workers": {"stream", "graph_state", "model"},
    "fraud": {"stream", "graph_state", "model", "workers"},
}


def _imported(path: Path) -> tuple[set[str], set[str]]:
    """``(our packages imported, generic top-level names of ours imported)`` by the module at ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    ours = {n.split(".")[1] for n in names if n.startswith("gnnstream.") and n.count(".") >= 1}
    generic = {n.split(".")[0] for n in names} & set(PACKAGES)
    return ours & set(PACKAGES), generic


def test_the_rule_reads_imports_of_every_kind(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import gnnstream.stream.events\nfrom gnnstream.graph_state import keys\n\n"
                      "def f():\n    from gnnstream.fraud.train import x\n    import model\n")
    assert _imported(module) == ({"stream", "graph_state", "fraud"}, {"model"})


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_run_one_way(package: str) -> None:
    wrong = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        ours, generic = _imported(path)
        for other in sorted(ours - ALLOWED[package] - {package}):
            wrong.append(f"{rel} imports gnnstream.{other}")
        for name in sorted(generic):
            wrong.append(f"{rel} imports {name} by its generic name, not as gnnstream.{name}")
    assert not wrong, "; ".join(wrong)


def test_tests_and_benchmarks_import_the_namespace_only() -> None:
    wrong = [f"{path.relative_to(ROOT).as_posix()} imports {name}"
             for folder in ("tests", "bench") for path in sorted((ROOT / folder).rglob("*.py"))
             for name in sorted(_imported(path)[1])]
    assert not wrong, "; ".join(wrong)


def test_the_repository_holds_no_compiled_sources() -> None:
    tracked = [p for p in ROOT.rglob("*") if ".venv" not in p.parts and ".git" not in p.parts]
    compiled = [p.relative_to(ROOT).as_posix() for p in tracked if p.suffix in (".c", ".h", ".cpp", ".pyx")]
    assert not compiled, compiled


def test_no_test_module_imports_another() -> None:
    """Tests share helpers through ``tests/support.py`` (and fixtures through conftest.py), never by importing a
    test module or a conftest: that would run the other module's fixtures and marks where they do not belong."""
    def is_test_module(dotted: str) -> bool:
        last = dotted.rsplit(".", 1)[-1]
        return dotted.startswith("tests.") and (last.startswith("test_") or last == "conftest")

    wrong = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            wrong += [f"{path.relative_to(ROOT).as_posix()}:{node.lineno} imports {name}"
                      for name in names if is_test_module(name)]
    assert not wrong, "; ".join(wrong)


def _module_graph() -> dict[str, set[str]]:
    """``{module: modules of ours it imports}`` over every module of the installed package (function-level and
    TYPE_CHECKING imports included); ``from package import name`` counts as importing ``package.name`` when
    that is a module, else ``package``."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = ["gnnstream", package, *path.relative_to(ROOT / package).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                if node.level:  # relative: from the module's package
                    anchor = name.split(".")[:len(name.split(".")) - node.level + (path.name == "__init__.py")]
                    base = ".".join(anchor + [node.module])
                for alias in node.names:
                    edges.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_sees_a_function_level_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_through_others() -> None:
    graph = _module_graph()
    assert "gnnstream.workers.runtime.worker" in graph and graph["gnnstream.workers.runtime.worker"]
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)
