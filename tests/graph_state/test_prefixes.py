"""The batch merge of neighbour-list prefixes (``merge_rows``) against whole lists sorted afresh, and the store
reading rows again where the merge cannot tell them (equal ranks, removals past what a row holds)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gnnstream.graph_state.prefixes import merge_rows
from gnnstream.graph_state.store import GraphStore
from gnnstream.stream.events import EdgeDelete, EdgeUpsert, NodeDelete

WIDTH = 4


@st.composite
def lists(draw):
    """Rows before and after a batch: ``(before, after)`` lists of ``(rank, id)`` per row, how many entries each
    row held before (between ``need`` and :data:`WIDTH`, or the whole list) and ``need``."""
    need = draw(st.integers(1, WIDTH))
    rows = draw(st.integers(1, 6))
    rank = st.integers(0, draw(st.sampled_from([6, 2**64 - 1])))  # a small range gives equal ranks
    before, after, held = [], [], []
    for _ in range(rows):
        ids = draw(st.lists(st.integers(0, 60), unique=True, max_size=18))
        cut = draw(st.integers(0, len(ids)))
        ids, new = ids[:cut], ids[cut:]  # ids added interleave with those held: ties must not follow input order
        entries = [(draw(rank), u) for u in ids]
        gone = draw(st.sets(st.sampled_from(ids))) if ids else set()
        before.append(entries)
        after.append([e for e in entries if e[1] not in gone] + [(draw(rank), u) for u in new])
        whole = len(entries) <= WIDTH and draw(st.booleans())  # a short list is held whole, or cut to need
        held.append(len(entries) if whole else draw(st.integers(min(need, len(entries)), min(WIDTH, len(entries)))))
    return before, after, held, need


def _rows(lists_: list[list[tuple[int, int]]], held: list[int] | None = None):
    rank = np.zeros((len(lists_), WIDTH), dtype=np.uint64)
    ids = np.full((len(lists_), WIDTH), -1, dtype=np.int64)
    length = np.zeros(len(lists_), dtype=np.int32)
    for i, entries in enumerate(lists_):
        kept = sorted(entries)[:WIDTH if held is None else held[i]]
        length[i] = len(kept)
        for j, (r, u) in enumerate(kept):
            rank[i, j], ids[i, j] = r, u
    return rank, ids, length


@settings(max_examples=500, deadline=None)
@given(case=lists())
def test_merge_matches_lists_sorted_afresh(case):
    before, after, held, need = case
    rank, ids, length = _rows(before, held)
    truncated = np.array([len(b) > h for b, h in zip(before, held)])
    degree = np.array([len(a) for a in after])
    added, removed = ([], [], []), ([], [])
    for row, (b, a) in enumerate(zip(before, after)):
        for r, u in sorted(set(a) - set(b), key=lambda e: -e[1]):
            added[0].append(row), added[1].append(r), added[2].append(u)
        for _, u in set(b) - set(a):
            removed[0].append(row), removed[1].append(u)
    new_rank, new_ids, new_len, exact = merge_rows(
        rank, ids, length, truncated, degree,
        (np.array(added[0], np.int64), np.array(added[1], np.uint64), np.array(added[2], np.int64)),
        (np.array(removed[0], np.int64), np.array(removed[1], np.int64)), need)
    for row, a in enumerate(after):
        ranks = sorted(r for r, _ in set(a) | set(before[row]))
        tie = any(x == y for x, y in zip(ranks, ranks[1:]))
        if exact[row]:  # the first new_len entries of the list, at least need of them (or all)
            n = int(new_len[row])
            assert min(len(a), need) <= n <= min(len(a), WIDTH)
            want = sorted(a)[:n]
            assert new_rank[row, :n].tolist() == [r for r, _ in want]
            assert new_ids[row].tolist() == [u for _, u in want] + [-1] * (WIDTH - n)
        else:
            last = sorted(before[row])[held[row] - 1][0] if truncated[row] else None
            lost = last is not None and sum(1 for r, _ in a if r <= last) < min(len(a), need)
            assert tie or lost, f"row {row} read again without a tie or a removal past the row"
        if not truncated[row] and not tie:
            assert exact[row], "a row holding its whole list is merged in memory"
            assert new_len[row] == min(len(a), WIDTH)


def _colliding(v_name: str, u_name: str) -> bytes:
    """A rank with four values: the ids decide most orders."""
    return bytes(7) + bytes([sum(map(ord, v_name + u_name)) % 4])


@pytest.mark.parametrize("per_batch", [1, 5, 100])
def test_equal_ranks_are_ordered_by_ids(tmp_path, per_batch):
    store = GraphStore(tmp_path / "db", seed=0)
    store._nbrs.rank = _colliding
    store.set_fanouts((1, 3, 10))
    names = [f"n{i:02d}" for i in np.random.default_rng(5).permutation(30)]  # not in name order
    events = [EdgeUpsert("hub", u, i) for i, u in enumerate(names)]
    events += [EdgeDelete("hub", u, 100 + i) for i, u in enumerate(names[::4])]
    events += [NodeDelete("n05", 200), EdgeUpsert("n05", "hub", 201), EdgeUpsert("n07", "n05", 202)]
    try:
        for at in range(0, len(events), per_batch):
            store.apply(events[at:at + per_batch])
            nbrs: dict[str, set[str]] = {}
            for ev in events[:at + per_batch]:
                if ev.op == "edge_upsert" and ev.src != ev.dst:
                    nbrs.setdefault(ev.src, set()).add(ev.dst)
                    nbrs.setdefault(ev.dst, set()).add(ev.src)
                elif ev.op == "edge_delete":
                    nbrs.get(ev.src, set()).discard(ev.dst)
                    nbrs.get(ev.dst, set()).discard(ev.src)
                elif ev.op == "node_delete":
                    for u in nbrs.pop(ev.id, set()):
                        nbrs[u].discard(ev.id)
            for v, n in nbrs.items():
                order = sorted(n, key=lambda u: (_colliding(v, u), u))
                for k in (1, 3, 10):
                    assert store.sample(v, k) == order[:k], (at, v, k)
                    assert store.sample_iids(store.iid(v), k) == [store.iid(u) for u in order[:k]], (at, v, k)
    finally:
        store.close()


def test_tables_by_iid_make_room_for_every_node_of_the_store_at_once(tmp_path):
    """On a store just opened, the prefix table and the row cache grow to the store's iid bound and an eighth
    more at once (not to the largest iid asked for); past that, the prefix table grows by a quarter."""
    from gnnstream.graph_state.page_log import PageLog
    from gnnstream.graph_state.row_cache import EmbeddingTables

    with GraphStore(tmp_path / "db", seed=0) as store:
        store.set_fanouts((2,))
        store.apply([EdgeUpsert(f"a{i}", f"b{i}", i) for i in range(1500)])
    with GraphStore(tmp_path / "db", seed=0) as store:
        store.set_fanouts((2,))
        assert store.iid_bound == 3000
        assert store.sample_matrix(2, np.asarray([0])).tolist() == [[1, -1]]
        assert len(store._nbrs.prefixes.loaded) == 3375
        tables = EmbeddingTables(store, [3, 2], {1: PageLog(store, family="layerpages", prefix=b"\x01")})
        tables.set(1, np.asarray([7]), np.ones((1, 2), dtype=np.float32))
        assert tables.cached(1, np.asarray([7, 2999]))[1].tolist() == [True, False]
        assert len(tables._loaded[1]) == 3375
        store.apply([EdgeUpsert(f"c{i}", f"d{i}", 2000 + i) for i in range(250)])
        assert store.iid_bound == 3500
        assert store.sample_matrix(2, np.asarray([3499])).tolist() == [[3498, -1]]
        assert len(store._nbrs.prefixes.loaded) == 4218  # a quarter more than 3375
