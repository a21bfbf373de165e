"""The invalid-event reasons listed are the reasons emitted, and the docs list the same set.

The emitted reasons are read from the source with :mod:`ast`: the first
argument (or ``reason=``) of every ``InvalidEvent(...)`` call, and the
literal reason of every dead-letter reject path (``reject``, ``for_record``),
in the packages that decode, check and route events. A reason built at run
time could not be checked, so an ``InvalidEvent`` whose reason is not a
literal fails the test.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from gnnstream.stream.events import INVALID_EVENT_REASONS

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("stream", "graph_state", "workers")
_REJECT_PATHS = {"reject": 1, "for_record": 1}  # callee -> position of its reason argument


def _callee(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


def _reason_arg(call: ast.Call, position: int) -> ast.expr | None:
    for keyword in call.keywords:
        if keyword.arg == "reason":
            return keyword.value
    return call.args[position] if len(call.args) > position else None


def emitted_reasons() -> tuple[dict[str, list[str]], list[str]]:
    """``({reason: [where it is raised]}, [InvalidEvent calls whose reason is not a literal])``."""
    found: dict[str, list[str]] = {}
    dynamic: list[str] = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                name = _callee(node)
                where = f"{path.relative_to(ROOT).as_posix()}:{node.lineno}"
                if name == "InvalidEvent":
                    arg = _reason_arg(node, 0)
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        found.setdefault(arg.value, []).append(where)
                    else:
                        dynamic.append(where)
                elif name in _REJECT_PATHS:
                    arg = _reason_arg(node, _REJECT_PATHS[name])
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        found.setdefault(arg.value, []).append(where)
    return found, dynamic


def test_every_emitted_reason_is_listed_and_every_listed_one_is_emitted() -> None:
    found, dynamic = emitted_reasons()
    assert not dynamic, f"InvalidEvent raised with a reason that is not a literal at {dynamic}"
    assert "wrong_feature_length" in found and "not_json" in found  # the walk sees both the decoder and the checks
    unlisted = {reason: found[reason] for reason in sorted(found.keys() - INVALID_EVENT_REASONS)}
    assert not unlisted, f"reasons emitted but missing from INVALID_EVENT_REASONS: {unlisted}"
    never = sorted(INVALID_EVENT_REASONS - found.keys())
    assert not never, f"reasons in INVALID_EVENT_REASONS that nothing emits: {never}"


def _readme_reasons() -> set[str]:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"The reason is one\s+of (.*?)\(see", text, re.S)
    assert match, "README.md lost its sentence 'The reason is one of ... (see docs/operations.md)'"
    return set(re.findall(r"`([a-z0-9_]+)`", match.group(1)))


def _operations_reasons() -> set[str]:
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("### Invalid events", 1)[1].split("\n#", 1)[0]
    return set(re.findall(r"^\| `([a-z0-9_]+)` \|", section, re.M))


def _module_doc_reasons() -> set[str]:
    import gnnstream.stream.events as events
    return set(re.findall(r"^``([a-z0-9_]+)``\s", events.__doc__ or "", re.M))


def test_the_docs_list_the_same_reasons() -> None:
    for where, listed in (("README.md", _readme_reasons()), ("docs/operations.md", _operations_reasons()),
                          ("the stream.events docstring", _module_doc_reasons())):
        missing, extra = sorted(INVALID_EVENT_REASONS - listed), sorted(listed - INVALID_EVENT_REASONS)
        assert not missing and not extra, f"{where}: missing {missing}, extra {extra}"
