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
        self.edge_ttl = 0.0  # the edge window in seconds (0: none)
        self.stream_time: float | None = None  # T as of the last batch written (None: no event yet)

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
            raws = self._columns.views["edges"].get(wanted)
            batch.stored_edges = {k: raw is not None for k, raw in zip(wanted, raws)}
            unpack, times = keys.EDGE_RECORD.unpack, batch.edge_time
            for k, raw in zip(wanted, raws):
                if raw is not None:
                    times[k] = unpack(raw)[1]

    def run(self, events: Sequence[Any], batch: Batch, result: ApplyResult) -> None:
        """Apply each event of a validated batch in order, then expire the edges that fell out of the window.

        An edge upsert between two nodes already read (the common case after
        :meth:`prefetch`) runs inline with its lookups bound once a batch;
        anything else goes through the ``_apply_<op>`` handlers. Stream time
        ``T`` moves with every event; an edge upsert with ``ts <= T - ttl`` on
        arrival is late (its endpoints are touched, the edge is not).
        """
        handlers = {op: getattr(self, "_apply_" + op) for op in ("edge_upsert", "edge_delete", "node_upsert", "node_delete")}
        iid_of, node_of, put_node = self._ids.iid_of.get, self._nodes.records.get, batch.nodes.add
        edges, stored, times = batch.edges, batch.stored_edges.get, batch.edge_time
        put, family, pack_edge, edge_key = batch.wb.put, batch.handles["edges"], keys.EDGE_RECORD.pack, keys.edge_key
        add_nbr, degree_changed = self._nbrs.add, result.degree_changed
        put_expiry, delete_expiry, expiry = batch.wb.put, batch.wb.delete, batch.handles["expiry"]
        max_ts = result.max_ts
        ttl = self.edge_ttl
        now = -np.inf if self.stream_time is None else self.stream_time
        start = now

        def exists(key: bytes) -> bool:  # _edge_exists with the batch's tables bound (a method call costs more)
            known = edges.get(key)
            if known is None:
                known = stored(key)
            return self._edge_exists(batch, key) if known is None else known

        for ev in events:
            ts = ev.ts
            if ts > max_ts:
                max_ts = float(ts)
            late = ttl and ev.op == "edge_upsert" and ts <= now - ttl
            if ts > now:
                now = float(ts)
            if late:
                self._touch(ev.src, ev.ts, batch, result)
                self._touch(ev.dst, ev.ts, batch, result)
                result.late_events += 1
                result.late_loops += ev.src == ev.dst
                continue
            if ev.op != "edge_upsert" or (s := iid_of(ev.src)) is None or (d := iid_of(ev.dst)) is None \
                    or (sn := node_of(s)) is None or (dn := node_of(d)) is None:
                handlers[ev.op](ev, batch, result)
                continue
            # both endpoints exist and are read: _touch and _put_edge without the lookups they repeat
            if ts > sn.last_ts:
                sn.last_ts = float(ts)
            if ts < sn.first_ts:
                self._retime(s, sn, float(ts), batch, result)
            if ts > dn.last_ts:
                dn.last_ts = float(ts)
            if ts < dn.first_ts:
                self._retime(d, dn, float(ts), batch, result)
            put_node(s)
            put_node(d)
            key = edge_key(s, d)
            existed = exists(key)
            t = float(ts)
            old = None
            if existed:
                old = times.get(key)
                if old is None:
                    old = self._edge_time(batch, key)
                if old > t:
                    t = old
            if ttl and t != old:
                if old is not None:
                    delete_expiry(keys.expiry_key(old, s, d), expiry)
                put_expiry(keys.expiry_key(t, s, d), b"", expiry)
            put(key, pack_edge(float(ev.weight), t), family)
            edges[key] = True
            times[key] = t
            if not existed and s != d and not exists(edge_key(d, s)):
                add_nbr(s, ev.src, d, ev.dst, sn, batch)
                add_nbr(d, ev.dst, s, ev.src, dn, batch)
                degree_changed.add(s)
                degree_changed.add(d)
        result.max_ts = max_ts
        if now > start:
            result.stream_time = now
            self.stream_time = now
        if ttl and now > -np.inf:
            self._expire(now - ttl, batch, result)

    def _expire(self, threshold: float, batch: Batch, result: ApplyResult) -> None:
        """Remove every present edge with ``t(e) <= threshold``: those the ``expiry`` index holds up to it (in
        time order, so the cost is that of the edges expired) and those this batch wrote.

        The index's expired range goes in one range delete; the edges leave
        together, and a pair of nodes is unlinked once neither direction
        remains (what removing them one at a time leaves).
        """
        stop = keys.time_key(threshold)
        stored, times, written = batch.stored_edges, batch.edge_time, batch.edges
        due: list[bytes] = []  # edge keys
        expired: list[bytes] = []
        for key in self._columns.families["expiry"].keys():
            if key[:8] > stop:
                break
            expired.append(key)
        for key in expired:
            edge = key[8:]  # an expiry key ends with its edge's key
            if edge not in written:  # an edge this batch wrote is judged below
                due.append(edge)
        own = [keys.time_key(times[key]) + key for key, present in written.items()
               if present and times[key] <= threshold]
        due += [key[8:] for key in own]
        if not due:
            return
        # the index from the first key due up to stop, in one range delete: the keys read above and this batch's
        # puts of edges due now (a range no wider than that: tombstones do not pile up over earlier ones)
        batch.wb.delete_range(min(expired[:1] + own), stop + b"\xff" * 17, batch.handles["expiry"])
        delete, family = batch.wb.delete, batch.handles["edges"]
        for key in due:
            delete(key, family)
            written[key] = False
            times.pop(key, None)
            stored[key] = True
        # what unlinking reads, with one multi-get each: the reverse edges, the names and node records
        reverse = [k for k in {key[8:] + key[:8] for key in due} if k not in written and k not in stored]
        if reverse:
            for k, raw in zip(reverse, self._columns.views["edges"].get(reverse)):
                stored[k] = raw is not None
        pairs = {}
        for key in due:
            back = key[8:] + key[:8]
            present = written.get(back)
            if not (stored[back] if present is None else present) and key != back:
                pairs[min(key, back)] = None  # each pair once, whichever direction came first
        result.expired_edges += len(due)
        result.expired_loops += sum(key[:8] == key[8:] for key in due)
        if not pairs:
            return
        unlink = [keys.decode_edge_key(key) for key in pairs]
        ends = {i for pair in unlink for i in pair}
        unnamed = [i for i in ends if i not in self._ids.name_of]
        if unnamed:
            for i, raw in zip(unnamed, self._columns.views["names"].get([keys.encode_iid(i) for i in unnamed])):
                if raw is not None:
                    self._ids.name_of[i] = raw.decode()
        cold = [i for i in ends if i not in self._nodes.records]
        if cold:
            self._nodes.read(cold)
        name, node, touched, remove = self._ids.name_of, self._nodes.records, batch.nodes, self._nbrs.remove
        for s, d in unlink:
            sn, dn, s_name, d_name = node[s], node[d], name[s], name[d]
            remove(s, s_name, d, d_name, sn, batch)
            remove(d, d_name, s, s_name, dn, batch)
        touched.update(ends)
        result.degree_changed.update(ends)

    # ------------------------------------------------------------------ one event
    def _touch(self, name: str, ts: float, batch: Batch, result: ApplyResult) -> tuple[int, Node]:
        iid = self._ids.intern(name, batch)
        node = self._nodes.get(iid)
        if node is None:
            node = Node(0, 0, float(ts), float(ts))
            result.created.add(iid)
            result.features_changed.add(iid)
            result.deleted.discard(iid)
            self._nodes.put(iid, node, batch)
            batch.born[iid] = node.first_ts
            return iid, node
        if ts > node.last_ts:
            node.last_ts = float(ts)
        if ts < node.first_ts:
            self._retime(iid, node, float(ts), batch, result)
        self._nodes.put(iid, node, batch)
        return iid, node

    def _retime(self, iid: int, node: Node, first: float, batch: Batch, result: ApplyResult) -> None:
        """An existing node's ``first(v)`` moves back to ``first`` (an upsert older than any before)."""
        if iid not in batch.born:
            batch.born_before[iid] = node.first_ts
        node.first_ts = first
        batch.born[iid] = first
        result.age_changed.add(iid)

    def _edge_exists(self, batch: Batch, key: bytes) -> bool:
        """Whether the edge of ``key`` (:func:`keys.edge_key`) is present, this batch's writes included."""
        if key in batch.edges:
            return batch.edges[key]
        stored = batch.stored_edges.get(key)
        return self._columns.views["edges"].get(key) is not None if stored is None else stored

    def _edge_time(self, batch: Batch, key: bytes) -> float | None:
        """``t(e)`` of the edge of ``key``, this batch's writes included (None: absent)."""
        if key in batch.edges and not batch.edges[key]:
            return None
        t = batch.edge_time.get(key)
        if t is None:
            raw = self._columns.views["edges"].get(key)
            if raw is None:
                return None
            t = batch.edge_time[key] = keys.EDGE_RECORD.unpack(raw)[1]
        return t

    def _put_edge(self, batch: Batch, key: bytes, weight: float, ts: float) -> bool:
        """Write the edge of ``key`` with an upsert's ``weight`` and ``ts`` (``t(e)`` the larger of ``ts`` and
        the edge's time); return whether it existed."""
        old = self._edge_time(batch, key)
        t = ts if old is None or old < ts else old
        batch.put("edges", key, keys.EDGE_RECORD.pack(weight, t))
        batch.edges[key] = True
        batch.edge_time[key] = t
        if self.edge_ttl and t != old:
            s, d = keys.decode_edge_key(key)
            if old is not None:
                batch.delete("expiry", keys.expiry_key(old, s, d))
            batch.put("expiry", keys.expiry_key(t, s, d), b"")
        return old is not None

    def _drop_edge(self, batch: Batch, key: bytes) -> None:
        """Delete the present edge of ``key``."""
        if self.edge_ttl:
            s, d = keys.decode_edge_key(key)
            batch.delete("expiry", keys.expiry_key(self._edge_time(batch, key), s, d))
        batch.delete("edges", key)
        batch.edges[key] = False
        batch.edge_time.pop(key, None)

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
        existed = self._put_edge(batch, key, float(ev.weight), float(ev.ts))
        if not existed and s != d and not self._edge_exists(batch, keys.edge_key(d, s)):
            self._link(s, ev.src, sn, d, ev.dst, dn, batch, result, add=True)

    def _apply_edge_delete(self, ev: Any, batch: Batch, result: ApplyResult) -> None:
        s, d = self._ids.iid(ev.src), self._ids.iid(ev.dst)
        if s is not None and d is not None:
            self._remove_edge(s, d, batch, result)

    def _remove_edge(self, s: int, d: int, batch: Batch, result: ApplyResult) -> None:
        """Delete edge ``s -> d`` if present, and ``s`` and ``d`` from each other's neighbourhood unless
        ``d -> s`` is present."""
        key = keys.edge_key(s, d)
        if not self._edge_exists(batch, key):
            return
        self._drop_edge(batch, key)
        if s != d and not self._edge_exists(batch, keys.edge_key(d, s)):
            sn, dn = self._nodes.get(s), self._nodes.get(d)
            self._nodes.put(s, sn, batch)
            self._nodes.put(d, dn, batch)
            self._link(s, self._ids.name(s), sn, d, self._ids.name(d), dn, batch, result, add=False)

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
                    self._drop_edge(batch, edge)
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
            self._drop_edge(batch, loop)
        if v not in batch.born:
            batch.born_before[v] = node.first_ts
        batch.born[v] = None
        self._nodes.put(v, None, batch)
        batch.delete("feats", keys.encode_iid(v))
        result.features_changed.add(v)
        result.deleted.add(v)
        result.created.discard(v)

    # ------------------------------------------------------------------ the end of a batch
    def finish(self, batch: Batch, result: ApplyResult) -> None:
        """Node records, the ``born`` index, net sample changes, the sampled-by changes and dirty marks."""
        self._nodes.encode(batch)
        for iid, first in batch.born.items():
            before = batch.born_before.get(iid)
            if before is not None:
                batch.delete("born", keys.born_key(before, iid))
            if first is not None:
                batch.put("born", keys.born_key(first, iid), b"")
        ids, before_m, after_m, deg = self._nbrs.settle(batch)
        delta: list[np.ndarray] = []  # this batch's sampled-by changes: one record
        mark_parts: list[tuple[int, np.ndarray, int]] = [
            (0, np.fromiter(result.features_changed, np.int64, len(result.features_changed)), DIRTY_INPUT),
            (0, np.fromiter(result.degree_changed, np.int64, len(result.degree_changed)), DIRTY_DEGREE),
            (0, np.fromiter(result.age_changed, np.int64, len(result.age_changed)), DIRTY_DEGREE),
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
