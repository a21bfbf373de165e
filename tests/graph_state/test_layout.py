"""One layout: a new state records it, a state of another layout is refused with one line saying how to
rebuild it, by the writer, a follower and the read-only commands alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rocksdict import Options, Rdict

from gnnstream.graph_state import keys
from gnnstream.graph_state.exceptions import StateLayoutError
from gnnstream.graph_state.store import GraphStore
from gnnstream.stream.events import EdgeUpsert
from tests.workers.reference import call_gnnstream


def _state(path: Path) -> None:
    with GraphStore(path, seed=0) as store:
        store.apply([EdgeUpsert("a", "b", 1.0, 1.0)])


def _set_layout(path: Path, layout: object) -> None:
    """Rewrite (or, with None, drop) the state's recorded layout, as another version would have left it."""
    with GraphStore(path) as store:
        meta = store.column("meta")
        if layout is None:
            meta.delete(b"layout")
        else:
            meta.put(b"layout", json.dumps(layout).encode())


def test_a_new_state_records_the_layout_and_opens_again(tmp_path: Path) -> None:
    _state(tmp_path / "s")
    with GraphStore(tmp_path / "s") as store:
        assert json.loads(store.column("meta").get(b"layout")) == keys.LAYOUT
        assert store.neighbors("a") == ["b"]


@pytest.mark.parametrize("layout", [None, keys.LAYOUT - 1, keys.LAYOUT + 1])
def test_a_state_of_another_layout_is_refused_everywhere(tmp_path: Path, layout: object) -> None:
    path = tmp_path / "s"
    _state(path)
    _set_layout(path, layout)
    which = "an earlier layout" if layout is None else f"layout {layout}"
    for open_it in (lambda: GraphStore(path), lambda: GraphStore(path, follow=tmp_path / "follower")):
        with pytest.raises(StateLayoutError, match=f"written with {which} .* reads layout {keys.LAYOUT} only"):
            open_it()
    done = call_gnnstream("graph", "show", "--state", path, "a")
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    assert lines[0].startswith("gnnstream: error: ") and which in lines[0], lines[0]
    assert "gnnstream graph load" in lines[0] and "gnnstream backfill" in lines[0], lines[0]
    # refused, not rewritten: the writer did not record its own layout over the other one
    raw_db = Rdict(str(path), options=Options(raw_mode=True), column_families={
        name: Options(raw_mode=True) for name in keys.COLUMN_FAMILIES})
    try:
        raw = raw_db.get_column_family("meta").get(b"layout")
    finally:
        raw_db.close()
    assert raw == (None if layout is None else json.dumps(layout).encode())


def test_a_state_with_families_of_another_layout_is_refused_at_open(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _state(path)
    options = Options(raw_mode=True)
    options.create_missing_column_families(True)
    families = {name: Options(raw_mode=True) for name in (*keys.COLUMN_FAMILIES, "embmeta")}
    Rdict(str(path), options=options, column_families=families).close()  # a family this layout does not have
    with pytest.raises(StateLayoutError, match="rebuild it in a new directory"):
        GraphStore(path)
    (tmp_path / "none.jsonl").write_text("")
    done = call_gnnstream("apply", "--state", path, tmp_path / "none.jsonl")
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0 and len(lines) == 1 and "written with an earlier layout" in lines[0], done.stderr
