"""Imports run one way: workers → graph_state, model, stream; the fraud example sits on top.

Every import statement of every module is read with ``ast`` (function-level
ones included), so a lazy import counts as much as one at the top.
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
# where the command line runs the example: the only imports of fraud from workers
COMMAND_LINE = {"workers/cli.py", "workers/replay.py"}


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(PACKAGES)


def test_the_rule_reads_imports_of_every_kind(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import stream.events\nfrom graph_state import keys\n\ndef f():\n    from fraud.train import x\n")
    assert _imported_packages(module) == {"stream", "graph_state", "fraud"}


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_run_one_way(package: str) -> None:
    wrong = []
    for path in sorted((ROOT / package).glob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        allowed = ALLOWED[package] | {package} | ({"fraud"} if rel in COMMAND_LINE else set())
        for other in sorted(_imported_packages(path) - allowed):
            wrong.append(f"{rel} imports {other}")
    assert not wrong, "; ".join(wrong)


def test_the_repository_holds_no_compiled_sources() -> None:
    tracked = [p for p in ROOT.rglob("*") if ".venv" not in p.parts and ".git" not in p.parts]
    compiled = [p.relative_to(ROOT).as_posix() for p in tracked if p.suffix in (".c", ".h", ".cpp", ".pyx")]
    assert not compiled, compiled
