"""Applying graph events: one batch of events turned into the writes of one :class:`~gnnstream.graph_state.batch.Batch`
(nodes, edges, features, neighbour index, sampled-by changes, dirty marks) and the :class:`ApplyResult` of what
changed."""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from gnnstream.graph_state import keys
from gnnstream.graph_state.batch import ApplyResult, Batch
from gnnstream.graph_state.db import Columns
from gnnstream.graph_state.marks import DIRTY_COUNT, DIRTY_DEGREE, DIRTY_INPUT, DIRTY_SAMPLE, MarkLog, combine, or_reduce
from gnnstream.graph_state.neighbours import NeighbourIndex
from gnnstream.graph_state.nodes import NodeIds, NodeRecords
from gnnstream.graph_state.prefixes import Node
from gnnstream.graph_state.sampled import SampledBy, member, sample_pairs

__all__ = ["EventApplier"]

logger = logging.getLogger(__name__)

_EDGE_OPS = ("edge_upsert", "edge_delete")


class EventApplier:
    """Writes a batch's events into its :class:`Batch` and works out what they changed.

    Args:
        columns: the open state.
        ids, nodes, nbrs, sampled, marks: the store's parts the events change.
    """

    def __init__(self, columns: Columns, ids: NodeIds, nodes: NodeRecords, nbrs: NeighbourIndex,
                 sampled: SampledBy, marks: MarkLog):
        self._columns = columns
        self._ids = ids
        self._nodes = nodes
        self._nbrs = nbrs
        self._sampled = sampled
        self._marks = marks

    def prefetch(self, events: Sequence[Any], batch: Batch) -> None:
        """Read the ids, node records and edges a batch will look at with one multi-get each."""
        names: dict[str, None] = {}
        for ev in events:
            if ev.op in _EDGE_OPS:
                names[ev.src] = names[ev.dst] = None
            else:
                names[ev.id] = None
        known = self._ids.iid_of
        unknown = [n for n in names if n not in known]
        if unknown:
            self._ids.read(unknown)
        records = self._nodes.records
        cold = [known[n] for n in names if n in known and known[n] not in records]
        if cold:
            self._nodes.read(cold)
        pairs: dict[bytes, None] = {}
        for ev in events:
            if ev.op in _EDGE_OPS:
                s, d = known.get(ev.src), known.get(ev.dst)
                if s is not None and d is not None:
                    pairs[keys.edge_key(s, d)] = pairs[keys.edge_key(d, s)] = None
        if pairs:
            wanted = list(pairs)
            batch.stored_edges = {k: raw is not None for k, raw in zip(wanted, self._columns.views["edges"].get(wanted))}

    def run(self, events: Sequence[Any], batch: Batch, result: ApplyResult) -> None:
        """Apply each event of a validated batch in order.

        An edge upsert between two nodes already read (the common case after
        :meth:`prefetch`) runs inline with its lookups bound once a batch;
        anything else goes through the ``_apply_<op>`` handlers.
        """
        handlers = {op: getattr(self, "_apply_" + op) for op in ("edge_upsert", "edge_delete", "node_upsert", "node_delete")}
        iid_of, node_of, put_node = self._ids.iid_of.get, self._nodes.records.get, batch.nodes.add
        edges, stored = batch.edges, batch.stored_edges.get
        put, family, pack_edge, edge_key = batch.wb.put, batch.handles["edges"], keys.EDGE_RECORD.pack, keys.edge_key
        add_nbr, degree_changed = self._nbrs.add, result.degree_changed
        max_ts = result.max_ts

        def exists(key: bytes) -> bool:  # _edge_exists with the batch's tables bound (a method call costs more)
            known = edges.get(key)
            if known is None:
                known = stored(key)
            return self._edge_exists(batch, key) if known is None else known

        for ev in events:
            ts = ev.ts
            if ts > max_ts:
                max_ts = float(ts)
            if ev.op != "edge_upsert" or (s := iid_of(ev.src)) is None or (d := iid_of(ev.dst)) is None \
                    or (sn := node_of(s)) is None or (dn := node_of(d)) is None:
                handlers[ev.op](ev, batch, result)
                continue
            # both endpoints exist and are read: _touch without the lookups it would repeat
            if ts > sn.last_ts:
                sn.last_ts = float(ts)
            if ts > dn.last_ts:
                dn.last_ts = float(ts)
            put_node(s)
            put_node(d)
            key = edge_key(s, d)
            existed = exists(key)
            put(key, pack_edge(float(ev.weight), float(ts)), family)
            edges[key] = True
            if not existed and s != d and not exists(edge_key(d, s)):
                add_nbr(s, ev.src, d, ev.dst, sn, batch)
                add_nbr(d, ev.dst, s, ev.src, dn, batch)
                degree_changed.add(s)
                degree_changed.add(d)
        result.max_ts = max_ts

    # ------------------------------------------------------------------ one event
    def _touch(self, name: str, ts: float, batch: Batch, result: ApplyResult) -> tuple[int, Node]:
        iid = self._ids.intern(name, batch)
        node = self._nodes.get(iid)
        if node is None:
            node = Node(0, 0, ts)
            result.created.add(iid)
            result.features_changed.add(iid)
            result.deleted.discard(iid)
        if ts > node.last_ts:
            node.last_ts = float(ts)
        self._nodes.put(iid, node, batch)
        return iid, node

    def _edge_exists(self, batch: Batch, key: bytes) -> bool:
        """Whether the edge of ``key`` (:func:`keys.edge_key`) is present, this batch's writes included."""
        if key in batch.edges:
            return batch.edges[key]
        stored = batch.stored_edges.get(key)
        return self._columns.views["edges"].get(key) is not None if stored is None else stored

    def _set_edge(self, batch: Batch, key: bytes, record: bytes | None) -> None:
        if record is None:
            batch.delete("edges", key)
        else:
            batch.put("edges", key, record)
        batch.edges[key] = record is not None

    def _link(self, a: int, a_name: str, an: Node, b: int, b_name: str, bn: Node,
              batch: Batch, result: ApplyResult, add: bool) -> None:
        change = self._nbrs.add if add else self._nbrs.remove
        change(a, a_name, b, b_name, an, batch)
        change(b, b_name, a, a_name, bn, batch)
        result.degree_changed.update((a, b))

    def _apply_edge_upsert(self, ev: Any, batch: Batch, result: ApplyResult) -> None:
        s, sn = self._touch(ev.src, ev.ts, batch, result)
        d, dn = self._touch(ev.dst, ev.ts, batch, result)
        key = keys.edge_key(s, d)
        existed = self._edge_exists(batch, key)
        self._set_edge(batch, key, keys.EDGE_RECORD.pack(float(ev.weight), float(ev.ts)))
        if not existed and s != d and not self._edge_exists(batch, keys.edge_key(d, s)):
            self._link(s, ev.src, sn, d, ev.dst, dn, batch, result, add=True)

    def _apply_edge_delete(self, ev: Any, batch: Batch, result: ApplyResult) -> None:
        s, d = self._ids.iid(ev.src), self._ids.iid(ev.dst)
        key = None if s is None or d is None else keys.edge_key(s, d)
        if key is None or not self._edge_exists(batch, key):
            return
        self._set_edge(batch, key, None)
        if s != d and not self._edge_exists(batch, keys.edge_key(d, s)):
            sn, dn = self._nodes.get(s), self._nodes.get(d)
            self._nodes.put(s, sn, batch)
            self._nodes.put(d, dn, batch)
            self._link(s, ev.src, sn, d, ev.dst, dn, batch, result, add=False)

    def _apply_node_upsert(self, ev: Any, batch: Batch, result: ApplyResult) -> None:
        iid, node = self._touch(ev.id, ev.ts, batch, result)
        node.flags |= keys.FLAG_HAS_FEATURES
        self._nodes.put(iid, node, batch)
        batch.put("feats", keys.encode_iid(iid), np.asarray(ev.features, dtype="<f4").tobytes())
        result.features_changed.add(iid)

    def _apply_node_delete(self, ev: Any, batch: Batch, result: ApplyResult) -> None:
        v = self._ids.iid(ev.id)
        node = None if v is None else self._nodes.get(v)
        if node is None:
            return
        entries = list(self._nbrs.iter(v))
        for key, u in entries:
            u_name = key[16:].decode()
            for a, b in ((v, u), (u, v)):
                edge = keys.edge_key(a, b)
                if self._edge_exists(batch, edge):
                    self._set_edge(batch, edge, None)
            un = self._nodes.get(u)
            self._nodes.put(u, un, batch)
            self._nbrs.remove(u, u_name, v, ev.id, un, batch)
            result.degree_changed.add(u)
        self._nbrs.remove_all(v, entries, batch)  # v's own list in one range delete (linear in the degree overall)
        if entries:
            result.degree_changed.add(v)
        node.degree = 0
        loop = keys.edge_key(v, v)
        if self._edge_exists(batch, loop):
            self._set_edge(batch, loop, None)
        self._nodes.put(v, None, batch)
        batch.delete("feats", keys.encode_iid(v))
        result.features_changed.add(v)
        result.deleted.add(v)
        result.created.discard(v)

    # ------------------------------------------------------------------ the end of a batch
    def finish(self, batch: Batch, result: ApplyResult) -> None:
        """Node records, net sample changes, the sampled-by changes and dirty marks."""
        self._nodes.encode(batch)
        ids, before_m, after_m, deg = self._nbrs.settle(batch)
        delta: list[np.ndarray] = []  # this batch's sampled-by changes: one record
        mark_parts: list[tuple[int, np.ndarray, int]] = [
            (0, np.fromiter(result.features_changed, np.int64, len(result.features_changed)), DIRTY_INPUT),
            (0, np.fromiter(result.degree_changed, np.int64, len(result.degree_changed)), DIRTY_DEGREE),
        ]
        fanouts = self._sampled.fanouts
        for k in fanouts:
            old, new = before_m[:, :k], after_m[:, :k]
            rows = (old != new).any(axis=1)
            ids_k, old, new = ids[rows], old[rows], new[rows]
            old_pairs, new_pairs = sample_pairs(ids_k, old), sample_pairs(ids_k, new)
            removed = old_pairs[~member(new_pairs, old_pairs)]
            added = new_pairs[~member(old_pairs, new_pairs)]
            for pairs, sink, flag in ((removed, batch.sampled_removed, 0), (added, batch.sampled_added, 1)):
                rec = np.empty(len(pairs), dtype=keys.SAMPLED_DELTA_RECORD)
                rec["k"], rec["added"], rec["pair"] = k, flag, pairs
                delta.append(rec)
                sink[k] = pairs
            counted = deg[np.minimum(deg[:, 1], k) != np.minimum(deg[:, 2], k), 0]
            result.sample_changed[k] = set(ids_k.tolist())
            result.count_changed[k] = set(counted.tolist())
            mark_parts += [(k, ids_k, DIRTY_SAMPLE), (k, counted, DIRTY_COUNT)]
        if not fanouts:
            return
        changes = np.concatenate(delta)
        if len(changes):
            self._sampled.put_changes(batch, changes, self._ids.next_iid)
        marks, flags = or_reduce([(combine(np.full(len(a), t), a), np.full(len(a), f, dtype=np.uint8))
                                   for t, a, f in mark_parts])
        if len(marks):  # one packed block: flags of marks already stored are OR-combined when read
            key, value = self._marks.block(marks, flags)
            batch.put("dirty", key, value)
            batch.marks = marks, flags
