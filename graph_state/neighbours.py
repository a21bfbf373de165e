"""The neighbour index (``nbrs``): every node's neighbour list in sampling-rank order, its writes, and the
reads of samples ``S_k`` through the in-memory prefix table (:class:`~gnnstream.graph_state.prefixes.PrefixTable`)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import numpy as np

from gnnstream.graph_state import keys
from gnnstream.graph_state.batch import Batch
from gnnstream.graph_state.db import Columns, check_iterator
from gnnstream.graph_state.nodes import NodeRecords
from gnnstream.graph_state.prefixes import Node, PrefixTable, merge_rows

__all__ = ["NeighbourIndex"]

logger = logging.getLogger(__name__)

_PACK_U64 = keys.U64.pack


class NeighbourIndex:
    """Neighbour lists ordered by ``(rank(v, u), u)``, so ``S_k(v)`` is the first ``k`` entries whatever the
    degree, with the first :attr:`width` entries of each list held in a :class:`PrefixTable` (at least the
    first :attr:`need` of them).

    Reads merge in the changes of the open batch (:attr:`batch`, set while one is applied).

    Args:
        columns: the open state.
        rank: the seeded rank of a pair of node names, as 8 big-endian bytes.
        nodes: the node records (a list's length is its node's degree).
        iid_bound: how many iids the store has handed out (:attr:`GraphStore.iid_bound`).
    """

    def __init__(self, columns: Columns, rank: Callable[[str, str], bytes], nodes: NodeRecords,
                 iid_bound: Callable[[], int] = lambda: 0):
        self._columns = columns
        self.rank = rank
        self._nodes = nodes
        self._iid_bound = iid_bound
        self.batch: Batch | None = None
        self.prefixes = PrefixTable(0, iid_bound=iid_bound)

    @property
    def width(self) -> int:
        """How many entries of each list a prefix row is read with."""
        return self.prefixes.width

    @property
    def need(self) -> int:
        """How many entries of each list the prefix table holds at least: samples up to this size read it."""
        return self.prefixes.need

    def set_need(self, need: int) -> None:
        """Hold at least the first ``need`` entries of each list, reading ``need + max(8, need // 2)`` at a
        time (rows of another size are read again)."""
        if self.prefixes.need != need:
            self.prefixes = PrefixTable(need, need + max(8, need // 2), self._iid_bound)

    # ------------------------------------------------------------------ reading lists
    def iter(self, v: int) -> Iterator[tuple[bytes, int]]:
        """Neighbour entries of ``v`` in rank order, the open batch's changes merged in: ``(index key, u)``."""
        prefix = keys.nbr_prefix(v)
        pending = self.batch.pending_nbr.get(v, {}) if self.batch is not None else {}
        added = sorted((k, u) for k, u in pending.items() if u is not None)
        ai = 0
        it = self._columns.views["nbrs"].iter()
        it.seek(prefix)
        try:
            while it.valid():
                key = it.key()
                if not key.startswith(prefix):
                    break
                if key not in pending:
                    while ai < len(added) and added[ai][0] < key:
                        yield added[ai]
                        ai += 1
                    yield key, keys.decode_iid(it.value())
                it.next()
            else:  # the end of the family, or a read error
                check_iterator(it, self._columns.path)
        finally:
            del it
        yield from added[ai:]

    def read_prefix(self, v: int) -> tuple[list[bytes], list[int]]:
        """The first :attr:`width` entries of ``v``'s list, the open batch's changes merged in: rank bytes
        and ids."""
        ranks: list[bytes] = []
        if self.batch is not None and v in self.batch.pending_nbr:
            ids: list[int] = []
            width = self.width
            for key, u in self.iter(v):  # merges the open batch's changes
                if len(ids) >= width:
                    break
                ranks.append(key[8:16])
                ids.append(u)
            return ranks, ids
        values: list[bytes] = []
        it = self._columns.views["nbrs"].iter()
        try:
            self._scan_prefix(it, v, ranks, values)
        finally:
            del it
        return ranks, list(map(keys.decode_iid, values))

    def _scan_prefix(self, it: Any, v: int, ranks: list[bytes], values: list[bytes]) -> int:
        """Append the rank bytes and raw ids of ``v``'s first :attr:`width` stored entries, read with the
        iterator ``it``; returns how many."""
        prefix = _PACK_U64(v)
        take = self.width
        it.seek(prefix)
        n = 0
        while n < take and it.valid():
            key = it.key()
            if key[:8] != prefix:
                return n
            ranks.append(key[8:16])
            values.append(it.value())
            n += 1
            it.next()
        if not it.valid():  # the end of the family, or a read error
            check_iterator(it, self._columns.path)
        return n

    def _scan_merged(self, it: Any, v: int, changes: dict[bytes, int | None], ranks: list[bytes],
                     values: list[bytes]) -> int:
        """:meth:`_scan_prefix` with the open batch's ``changes`` to ``v``'s list merged in (as :meth:`iter`
        gives them, with the iterator ``it`` shared by many nodes); returns how many entries were appended."""
        prefix = _PACK_U64(v)
        take = self.width
        stored: list[tuple[bytes, bytes]] = []
        it.seek(prefix)
        while len(stored) < take and it.valid():
            key = it.key()
            if key[:8] != prefix:
                break
            if key not in changes:
                stored.append((key, it.value()))
            it.next()
        else:
            if not it.valid():  # the end of the family, or a read error
                check_iterator(it, self._columns.path)
        added = [(key, _PACK_U64(u)) for key, u in changes.items() if u is not None]
        merged = sorted(stored + added)[:take] if added else stored
        for key, value in merged:
            ranks.append(key[8:16])
            values.append(value)
        return len(merged)

    def prefix_ids(self, v: int) -> list[int]:
        """``v``'s prefix ids: the table's row, or read from RocksDB when it is not loaded (leaving the table
        alone; rows are loaded many at a time, by :meth:`sample_matrix` and batches)."""
        row = self.prefixes.row(v)
        return row if row is not None else self.read_prefix(v)[1]

    def read_rows(self, iids: np.ndarray, stored: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`read_prefix` of many nodes as prefix-table rows: ``(rank, ids, length)``.

        Nodes without changes in the open batch (all of them when ``stored``) are read with one iterator, the
        first :attr:`width` index entries after a seek to each, their ranks and ids decoded all at once.
        """
        width = self.prefixes.width
        n_rows = len(iids)
        rank = np.zeros((n_rows, width), dtype=np.uint64)
        ids = np.full((n_rows, width), -1, dtype=np.int64)
        length = np.zeros(n_rows, dtype=np.int32)
        pending = self.batch.pending_nbr if self.batch is not None and not stored else {}
        ranks: list[bytes] = []
        values: list[bytes] = []
        counts = [0] * n_rows
        it = self._columns.views["nbrs"].iter()
        try:
            for row, v in enumerate(iids.tolist()):
                changes = pending.get(v)
                if changes is not None:  # the open batch changed this list: merge its changes
                    counts[row] = self._scan_merged(it, v, changes, ranks, values)
                else:
                    counts[row] = self._scan_prefix(it, v, ranks, values)
        finally:
            del it
        if ranks:
            length[:] = counts
            row_of = np.repeat(np.arange(n_rows), length)
            col = np.arange(len(ranks)) - np.repeat(np.cumsum(length) - length, length)
            rank[row_of, col] = np.frombuffer(b"".join(ranks), dtype=">u8")
            ids[row_of, col] = np.frombuffer(b"".join(values), dtype=">u8")
        return rank, ids, length

    def load_rows(self, iids: np.ndarray) -> None:
        """Read the rows of ``iids`` that the prefix table lacks from RocksDB, as stored (before any open
        batch)."""
        missing = self.prefixes.missing(iids)
        if len(missing):
            self.prefixes.put_rows(missing, *self.read_rows(missing, stored=True))

    # ------------------------------------------------------------------ samples
    def sample_iids(self, iid: int, k: int) -> list[int]:
        """``S_k`` of node ``iid`` as interned ids in rank order; O(k) reads."""
        if self._nodes.get(iid) is None:
            return []
        if k <= self.need and self.batch is None:
            return self.prefix_ids(iid)[:k]
        out = []
        for _, u in self.iter(iid):
            if len(out) >= k:
                break
            out.append(u)
        return out

    def sample_matrix(self, k: int, iids: np.ndarray) -> np.ndarray:
        """``S_k`` of many nodes: an ``[len(iids), k]`` iid matrix in rank order, padded with -1.

        Outside a batch the rows come from the prefix table; rows not loaded
        yet are read from RocksDB first and kept there.
        """
        iids = np.asarray(iids, dtype=np.int64)
        if self.batch is not None or k > self.need:
            out = np.full((len(iids), k), -1, dtype=np.int64)
            for row, v in enumerate(iids.tolist()):
                s = self.sample_iids(v, k)
                out[row, :len(s)] = s
            return out
        self.load_rows(iids)
        return self.prefixes.samples(iids, k)

    # ------------------------------------------------------------------ writes of a batch
    def add(self, v: int, v_name: str, u: int, u_name: str, node: Node, batch: Batch) -> None:
        """Add ``u`` to ``N(v)``: its index entry and degree (the prefix follows in :meth:`settle`)."""
        key = keys.nbr_key(v, self.rank(v_name, u_name), u_name)
        node.degree += 1
        batch.wb.put(key, _PACK_U64(u), batch.nbrs_family)
        batch.pending_nbr[v][key] = u
        batch.nbr_first.setdefault(key, -1)

    def remove(self, v: int, v_name: str, u: int, u_name: str, node: Node, batch: Batch) -> None:
        """Remove ``u`` from ``N(v)``: its index entry and degree."""
        key = keys.nbr_key(v, self.rank(v_name, u_name), u_name)
        node.degree -= 1
        batch.delete("nbrs", key)
        batch.pending_nbr[v][key] = None
        batch.nbr_first.setdefault(key, u)

    def remove_all(self, v: int, entries: list[tuple[bytes, int]], batch: Batch) -> None:
        """Remove ``v``'s whole list (``entries``, as :meth:`iter` gave them) in one range delete."""
        batch.wb.delete_range(keys.nbr_prefix(v), keys.nbr_prefix(v + 1), batch.handles["nbrs"])
        pending, first = batch.pending_nbr[v], batch.nbr_first
        for key, u in entries:
            pending[key] = None
            first.setdefault(key, u)

    def settle(self, batch: Batch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Merge the batch's neighbour changes into the prefixes of every node whose list changed, all at once,
        and write them into the table.

        Returns ``(ids, before, after, moved)``: the nodes whose prefix ids
        changed, those ids before and after as ``[len(ids), width]`` matrices
        padded with -1, and ``(v, degree before, degree after)`` rows of every
        node whose degree changed.
        """
        table, width = self.prefixes, self.prefixes.width
        if not batch.pending_nbr:
            empty = np.zeros(0, dtype=np.int64)
            return empty, np.zeros((0, width), np.int64), np.zeros((0, width), np.int64), empty.reshape(0, 3)
        first = batch.nbr_first
        add_row: list[int] = []
        add_rank: list[bytes] = []
        add_id: list[int] = []
        rem_row: list[int] = []
        rem_id: list[int] = []
        for row, changes in enumerate(batch.pending_nbr.values()):  # net changes: entries stored now or before only
            for key, u in changes.items():
                was = first[key]
                if u is None:
                    if was >= 0:
                        rem_row.append(row)
                        rem_id.append(was)
                elif was < 0:
                    add_row.append(row)
                    add_rank.append(key[8:16])
                    add_id.append(u)
        v = np.fromiter(batch.pending_nbr, np.int64, len(batch.pending_nbr))
        self.load_rows(v)
        nodes = self._nodes.records
        deg1 = np.fromiter(((n.degree if (n := nodes[i]) is not None else 0) for i in v.tolist()), np.int64, len(v))
        added_to, removed_from = np.asarray(add_row, dtype=np.int64), np.asarray(rem_row, dtype=np.int64)
        # a degree counts its index entries: before the batch, less the net additions, plus the net removals
        deg0 = deg1 - np.bincount(added_to, minlength=len(v)) + np.bincount(removed_from, minlength=len(v))
        rank, ids, length = table.rank[v], table.ids[v], table.length[v]
        new_rank, new_ids, new_len, exact = merge_rows(
            rank, ids, length, deg0 > length, deg1,
            (added_to, np.frombuffer(b"".join(add_rank), dtype=">u8").astype(np.uint64),
             np.asarray(add_id, dtype=np.int64)),
            (removed_from, np.asarray(rem_id, dtype=np.int64)), table.need)
        again = np.flatnonzero(~exact)  # read again, with the batch's changes merged
        if len(again):
            new_rank[again], new_ids[again], new_len[again] = self.read_rows(v[again])
        table.put_rows(v, new_rank, new_ids, new_len)
        changed = (ids != new_ids).any(axis=1)
        moved = deg0 != deg1
        return (v[changed], ids[changed], new_ids[changed],
                np.stack([v[moved], deg0[moved], deg1[moved]], axis=1))
