"""Answers of the query API, read from a follower of the worker's state.

:class:`QueryState` opens the worker's RocksDB state as a secondary
instance (``GraphStore(follow=...)``), so it never takes the writer's lock
and never writes; :meth:`QueryState.refresh` brings it up to the writer's
last committed batch. It answers three questions:

- :meth:`~QueryState.embedding`: a node's stored final embedding, version
  and mode, from the page log (:class:`gnnstream.graph_state.page_log.PageLog`).
- :meth:`~QueryState.samples`: a node's current sample at every layer.
- :meth:`~QueryState.infer`: the final embeddings some nodes *would* have if
  a list of events were applied on top of the current graph, computed
  exactly and without changing anything.

What-if inference folds the events into an :class:`Overlay` over the
stored graph (edges, features and neighbour sets that differ), then
evaluates the requested nodes' sampled computation trees on it
(:class:`_Evaluation`): a row whose tree the events cannot reach is read
from the store, every other one is computed from the level below, down to
the features. Samples follow docs/design.md: the stored, rank-ordered
neighbour list with the overlay's additions merged in by ``(r(v, u), u)``
and its removals skipped, so a node with a million neighbours costs
``O(k)`` reads unless the events delete it. Stored rows are the contract's
values only when the worker left nothing dirty; while it has dirty marks
(between committing a batch's graph changes and its recompute, or with hub
work deferred) the whole tree is computed from the features, so the
answer is exact either way.

Event time follows the store: the events move the overlay's stream time
``T'``; an upsert at or before ``T' - ttl`` is late (its endpoints only),
and every edge with ``t(e) <= T' - ttl`` leaves the overlay (the stored ones
found in the ``expiry`` index, the cost of those that expire). Under the
staged cold-start policy each node's stage is taken at ``T'``; a what-if
that moves stream time, in a windowed state or under the staged policy, is
computed from the features (stages and expiry can reach anything).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Literal, Sequence

import numpy as np
import torch

from gnnstream.graph_state.exceptions import StateNoEmbeddings, StoreConfigError
from gnnstream.graph_state.store import GraphStore
from gnnstream.model import load_model_dir
from gnnstream.stream.events import Event, InvalidEvent, check_features, decode_event, strict_json
from gnnstream.stream.partitioning import partition_for
from gnnstream.workers.engine import kept_partitions
from gnnstream.workers.engine.stats import EngineError
from gnnstream.workers.state import MODEL_DIR_META, held_identity, other_model_error
from gnnstream.graph_state.page_log import FrameReused, PageLog
from gnnstream.workers.query.overlay import Overlay
from gnnstream.model.coldstart import STAGE_EXPANDED, STAGE_NONE
from gnnstream.model.head import HEAD_FILE, ScoreHead, TransactionHead, load_head, load_transaction_head
from gnnstream.model.schema import edge_type_name
from gnnstream.workers.engine.typed import GRAPH_SCHEMA_META, TypedLayout, schema_refusal

__all__ = ["QueryState", "QueryError", "load_infer_body", "MAX_EVENTS", "MAX_IDS"]

logger = logging.getLogger(__name__)

MAX_EVENTS = 1_000  # events of one what-if request
MAX_IDS = 1_000  # nodes asked for in one what-if request
_REREADS = 3  # catch-ups tried when the writer reused a frame this reader was about to read
KEPT_ROWS = 4_000_000  # rows of the frames lookups keep in memory (PageLog.row), as many as the worker's row cache
MARKS_HELD = 100_000  # the most pending dirty marks a lookup checks before it trusts a stored row unread


class QueryError(ValueError):
    """A request that cannot be answered: ``status`` is the HTTP status, the message says why."""

    def __init__(self, status: int, message: str, **extra: Any):
        super().__init__(message)
        self.status = status
        self.extra = extra


def load_infer_body(raw: bytes) -> Any:
    """The JSON value of a ``POST /v1/infer`` or ``/v1/score`` body, read as the stream's decoder reads an
    event it doubts (:func:`~gnnstream.stream.events.strict_json`): integers whole, a field written twice
    refused.

    Raises:
        QueryError: 400 for a body that is not JSON, or repeats a field.
    """
    try:
        return strict_json(raw)
    except InvalidEvent as exc:
        what = {"duplicate_field": "repeats a field", "not_utf8": "is not UTF-8"}.get(exc.reason, "is not JSON")
        raise QueryError(400, f"the body {what}: {exc.detail}") from None


def _node_id(value: Any) -> str:
    """A node id of ``ids`` as the stream's decoder takes an event's: a string, or an integer of any size as its
    decimal string, within :data:`~gnnstream.stream.events.MAX_ID_BYTES`.

    Raises:
        InvalidEvent: ``bad_id`` or ``empty_id``, as for an event.
    """
    return decode_event({"op": "node_delete", "id": value, "ts": 0}).id


class QueryState:
    """The query API's view of a worker's state.

    Args:
        state_dir: the worker's state directory (read, never written).
        model_dir: the model directory the worker runs (None: the one the state records).
        own_dir: a directory of this reader's own (RocksDB secondary instance files).
        head: the fraud head to score with; by default the model directory's ``head.json`` when it has one.
    """

    def __init__(self, state_dir: str | os.PathLike[str], model_dir: str | os.PathLike[str] | None,
                 own_dir: str | os.PathLike[str], head: ScoreHead | None = None):
        self.store = GraphStore(state_dir, follow=own_dir)
        try:
            if model_dir is None:
                raw = self.store.column("meta").get(MODEL_DIR_META)
                if raw is None:
                    raise StateNoEmbeddings(f"state {self.store.path!r} has no model yet; pass --model DIR")
                model_dir = raw.decode()
            self.model = model = load_model_dir(model_dir)
            cfg = model.config
            if self.store.seed != cfg.seed:
                raise StoreConfigError(f"model {cfg.name}:{cfg.version} samples with seed {cfg.seed} but state "
                                       f"{self.store.path!r} holds seed {self.store.seed}")
            # the state's own model only, as apply and run require (the worker beside it, or its last one)
            refused = schema_refusal(self.store.path, self.store.meta(GRAPH_SCHEMA_META), cfg.schema,
                                     f"{cfg.name}:{cfg.version}")
            if refused:
                raise EngineError(refused)
            other = other_model_error(self.store, model_dir, cfg, held_identity(self.store))
            if other is not None:
                raise other
        except BaseException:
            self.store.close()
            raise
        self.model_tag = f"{cfg.name}:{cfg.version}"
        self.fanouts = list(cfg.fanouts)
        schema = cfg.graph_schema
        self.typed = TypedLayout(schema, self.store) if schema is not None else None  # a typed graph's
        self.dims = list(model.model.dims) if self.typed is None else \
            [self.typed.width] + [cfg.hidden_dim] * (cfg.num_layers - 1) + [cfg.out_dim]
        self.policy = model.cold_start
        self.rereads = 0  # answers read again after the worker reused a frame they were reading
        self._kept_raw: tuple[int, set[int] | None] | None = None  # the worker's kept partitions, read on demand
        # nodes with a dirty mark at the last catch-up, read on demand (False: too many to hold, see _unmarked)
        self._marked: set[int] | Literal[False] | None = None
        # h^l of every layer: the page logs of the layers in between, then the final one
        self.logs = {l: PageLog(self.store, family="layerpages", prefix=bytes((l,)), rows_name=f"layer{l}-rows")
                     for l in range(1, len(self.fanouts))}
        self.logs[len(self.fanouts)] = PageLog(self.store, keep_rows=KEPT_ROWS)
        for log in self.logs.values():  # read whole now: later catch-ups index only the pages they bring
            log.follow()
        self.store.warm_ids()  # a lookup of any node then reads no id (catch-ups keep them)
        self._behind: set[int] = set()  # layers whose page log has not yet followed the last catch-up
        self.transactions: TransactionHead | None = None  # a typed model's transaction head (POST /v1/score)
        if self.typed is not None:
            found = load_transaction_head(model.path) if (model.path / HEAD_FILE).exists() else None
            self.transactions = found if found is not None and found.model == self.model_tag else None
        elif head is None and (model.path / HEAD_FILE).exists():
            head = load_head(model.path)
        fits = head is not None and len(head.weights) == self.dims[-1] and head.model in (None, self.model_tag)
        self.head = head if fits else None  # a head trained on another model's embeddings scores nothing here

    def close(self) -> None:
        self.store.close()

    def refresh(self) -> None:
        """See every batch the worker committed so far (a page log indexes the new pages when next read)."""
        self.store.catch_up()
        self._behind = set(self.logs)
        self._kept_raw = None
        self._marked = None

    def log(self, layer: int) -> PageLog:
        """The page log of ``h^layer``, up to date with the last catch-up: lookups read only the final one, so
        the intermediate ones follow only while what-ifs read them."""
        log = self.logs[layer]
        if layer in self._behind:
            self._behind.discard(layer)
            log.follow()
        return log

    def kept(self, name: str) -> int | None:
        """None when the worker keeps ``name``'s final row current; else the output partition it is in (a
        worker of a group keeps only its own partitions', docs/scaling.md)."""
        if self._kept_raw is None:
            count, partitions = kept_partitions(self.store) or (0, None)
            # a worker that keeps every partition keeps every node: no partition to work out per node
            self._kept_raw = (count, None if count and partitions.issuperset(range(count)) else partitions)
        count, partitions = self._kept_raw
        if partitions is None:
            return None
        p = partition_for(name.encode(), count) if count else 0
        return None if p in partitions else p

    def status(self) -> dict[str, Any]:
        """How far this view has caught up: the next offset of every partition the worker applied, and the
        dirty marks it still had to recompute then (0: every answer reflects those offsets exactly)."""
        return {"model": self.model_tag,
                "offsets": {f"{t}:{p}": o for (t, p), o in sorted(self.store.offsets().items())},
                "dirty": self.store.dirty_count(), "rereads": self.rereads}

    # ---------------------------------------------------------------- lookup
    def _node(self, name: str) -> int:
        """The interned id of node ``name``.

        Raises:
            QueryError: 404 for a node that does not exist (a typed graph's nodes are ``type/id``: its slots are
                none).
        """
        iid = self._iid(name)
        if iid is None or not self.store.exists_iid(iid):
            raise QueryError(404, f"no node {name!r}")
        return iid

    def _iid(self, name: str) -> int | None:
        """The interned id of ``name`` (None: never seen, or not a node of the typed graph's types)."""
        if self.typed is not None and name.partition("/")[0] not in self.typed.type_index:
            return None
        return self.store.iid(name)

    def _unmarked(self, iid: int) -> bool:
        """Whether node ``iid`` had no dirty mark at the last catch-up (False for any node where the store keeps
        no marks, it has no fanouts, and for every node while more than :data:`MARKS_HELD` marks are pending:
        their set would cost more than the records it saves)."""
        marked = self._marked
        if marked is None:
            iids = self.store.dirty_mark_arrays()[1] if self.store.fanouts else None
            marked = self._marked = set(iids.tolist()) if iids is not None and len(iids) <= MARKS_HELD else False
        return marked is not False and iid not in marked

    def embedding(self, name: str) -> dict[str, Any]:
        """``{"id", "model", "version", "mode", "embedding"}`` of a node's stored final embedding.

        A node of a kept partition whose final row is stored exists unless it
        has a dirty mark: the worker deletes a node in the WriteBatch that
        marks it dirty, and clears the marks in the one that withdraws its
        row. Such a node is answered without reading its record.

        Raises:
            QueryError: 404 for a node that does not exist, was deleted or has no embedding yet.
        """
        iid = self._iid(name)
        if iid is None:
            raise QueryError(404, f"no node {name!r}")
        return self._read(self._embedding, name, iid)

    def _embedding(self, name: str, iid: int) -> dict[str, Any]:
        pages, dim = self.log(len(self.fanouts)), self.dims[-1]
        row = pages.row(iid, dim) if self.kept(name) is None and self._unmarked(iid) else None
        if row is None:
            if not self.store.exists_iid(iid):
                raise QueryError(404, f"no node {name!r}")
            elsewhere = self.kept(name)
            if elsewhere is not None:
                raise QueryError(421, f"node {name!r} is in output partition {elsewhere}, which another worker of "
                                      f"the group publishes: ask that worker (or POST /v1/infer here)",
                                 partition=elsewhere)
            row = pages.row(iid, dim)
            if row is None:
                raise QueryError(404, f"node {name!r} has no embedding yet")
        return {"id": name, "model": self.model_tag, "version": pages.version.item(iid),
                "mode": pages.names[pages.mode.item(iid)], "embedding": row}

    def samples(self, name: str) -> dict[str, Any]:
        """``{"id", "degree", "layers": [{"layer", "fanout", "sample"}]}``: the node's current samples.

        Raises:
            QueryError: 404 for a node that does not exist.
        """
        iid = self._node(name)
        degree = self.store.degree_iid(iid)
        evaluation = _Evaluation(self, Overlay(self.store, self.model.config.seed), False)
        uses = evaluation.stage(iid) != STAGE_NONE
        layers = [{"layer": l, "fanout": k, "sample": [self.store.name(u) for u in evaluation.sample(l, iid)]}
                  for l, k in enumerate(self.fanouts)]
        return {"id": name, "degree": degree, "uses_neighbours": uses, "layers": layers}

    # ---------------------------------------------------------------- what-if
    def parse_infer(self, body: Any) -> tuple[list[Event], list[str]]:
        """Validate a ``POST /v1/infer`` body: ``{"events": [...], "ids": [...]}``.

        Raises:
            QueryError: 400 naming what is wrong (and ``index`` of a bad event), 413 past the size limits.
        """
        if not isinstance(body, dict):
            raise QueryError(400, "the body must be a JSON object with \"events\" and \"ids\"")
        unknown = sorted(set(body) - {"events", "ids"})
        if unknown:
            raise QueryError(400, f"unknown field(s) {unknown[:5]}; the body takes \"events\" and \"ids\"")
        raw_events, raw_ids = body.get("events", []), body.get("ids")
        if not isinstance(raw_events, list):
            raise QueryError(400, "\"events\" must be a list of event objects")
        if not isinstance(raw_ids, list) or not raw_ids:
            raise QueryError(400, "\"ids\" must be a non-empty list of node ids")
        if len(raw_events) > MAX_EVENTS:
            raise QueryError(413, f"{len(raw_events)} events; a what-if takes at most {MAX_EVENTS}")
        if len(raw_ids) > MAX_IDS:
            raise QueryError(413, f"{len(raw_ids)} ids; a what-if takes at most {MAX_IDS}")
        events = []
        for i, obj in enumerate(raw_events):  # as the worker checks what it consumes
            try:
                events += self.read_event(obj)
            except InvalidEvent as exc:
                raise QueryError(400, f"event {i}: {exc}", index=i, reason=exc.reason) from None
        ids = []
        for i, value in enumerate(raw_ids):
            try:
                ids.append(self.node_name(value))
            except InvalidEvent as exc:
                raise QueryError(400, f"ids[{i}]: {exc.detail}", index=i, reason=exc.reason) from None
        return events, ids

    def node_name(self, value: Any) -> str:
        """A node id of a request as the store names the node: an untyped graph's as the stream's decoder takes
        an event's id; a typed graph's ``type/id``, of a type of the schema and an id the decoder takes.

        Raises:
            InvalidEvent: ``bad_id``, ``empty_id`` or (typed) ``unknown_type``.
        """
        if self.typed is None:
            return _node_id(value)
        node_type, slash, node = value.partition("/") if isinstance(value, str) else ("", "", "")
        if not slash:
            raise InvalidEvent("bad_id", f"a typed graph's node is named type/id (got {str(value)[:80]!r})")
        if node_type not in self.typed.type_index:
            raise InvalidEvent("unknown_type", f"node type {node_type[:80]!r} is not in the schema")
        return f"{node_type}/{_node_id(node)}"

    def read_event(self, obj: Any) -> list[Event]:
        """A decoded JSON event as the events the store applies (a typed one as several, as the worker reads it).

        Raises:
            InvalidEvent: as the worker's decoder.
        """
        if self.typed is not None:
            return self.typed.check(decode_event(obj, typed=True))
        ev = decode_event(obj)
        check_features(ev, self.dims[0])
        return [ev]

    def parse_score(self, body: Any) -> tuple[Any, list[Event]]:
        """Validate a ``POST /v1/score`` body: ``{"event": {an edge_upsert of the scored relation}}``; the
        decoded transaction and the events that apply it.

        Raises:
            QueryError: 404 when the model scores no transactions, 400 naming what is wrong.
        """
        if self.transactions is None:
            raise QueryError(404, f"model {self.model_tag} scores no transactions: POST /v1/score needs a typed "
                                  f"model trained with a transaction head (gnnstream train --schema)")
        if not isinstance(body, dict) or set(body) != {"event"}:
            raise QueryError(400, "the body must be a JSON object {\"event\": {an edge_upsert of the scored "
                                  "relation}}")
        try:
            ev = decode_event(body["event"], typed=True)
            events = self.typed.check(ev)
        except InvalidEvent as exc:
            raise QueryError(400, f"event: {exc}", reason=exc.reason) from None
        if ev.op != "edge_upsert" or edge_type_name((ev.src_type, ev.rel, ev.dst_type)) != self.transactions.relation:
            raise QueryError(400, f"event: a transaction is an edge_upsert of {self.transactions.relation}")
        return ev, events

    def score(self, txn: Any, events: Sequence[Event]) -> dict[str, Any]:
        """The score of transaction ``txn`` as if it landed now: its two ends' embeddings with ``events``
        applied in an overlay (nothing changes), and its edge features, through the transaction head."""
        src, dst = f"{txn.src_type}/{txn.src}", f"{txn.dst_type}/{txn.dst}"
        found = self.infer(events, [src, dst])
        rows = found["embeddings"]
        score = self.transactions.score(rows[src], rows[dst], np.asarray(txn.features, dtype=np.float64))
        return {"model": self.model_tag, "relation": self.transactions.relation, "txn_id": txn.txn_id,
                "score": float(score), "src": src, "dst": dst}

    def infer(self, events: Sequence[Event], ids: Sequence[str]) -> dict[str, Any]:
        """Each of ``ids``' final embedding as if ``events`` were applied to the current graph (nothing changes).

        Returns:
            ``{"model", "embeddings": {id: row}, "modes": {id: mode}}``, and ``"scores"`` with a fraud head.

        Raises:
            QueryError: 404 when one of ``ids`` does not exist once the events are applied; 503 when the
                worker kept rewriting the rows this answer needed.
        """
        return self._read(self._infer, events, ids)

    def _read(self, read: Callable[..., Any], *args: Any) -> Any:
        """``read(*args)``, caught up and done again when the worker reused a frame it was reading."""
        for _ in range(_REREADS):
            try:
                return read(*args)
            except FrameReused:
                self.rereads += 1
                self.refresh()
        try:
            return read(*args)
        except FrameReused:
            raise QueryError(503, "the worker kept rewriting the rows this answer needs; retry") from None

    def _infer(self, events: Sequence[Event], ids: Sequence[str]) -> dict[str, Any]:
        overlay = Overlay(self.store, self.model.config.seed)
        for ev in events:
            overlay.apply(ev)
        overlay.expire()
        targets = []
        for name in dict.fromkeys(ids):
            v = overlay.node(name)
            if v is None or not overlay.alive(v):
                raise QueryError(404, f"no node {name!r} once the events are applied")
            targets.append(v)
        # stored rows are the contract's values when the worker left nothing dirty: reuse those of nodes
        # whose computation tree the events do not reach
        moved = overlay.stream_time != self.store.stream_time and (self.policy.by_age or overlay.ttl)
        clean = self.store.dirty_count() == 0 and all(self.kept(overlay.name(v)) is None for v in targets) \
            and not moved
        evaluation = _Evaluation(self, overlay, clean)
        rows = evaluation.final(targets)
        if rows is None:  # a stored row missing: compute everything from the features
            rows = _Evaluation(self, overlay, False).final(targets)
        names = [overlay.name(v) for v in targets]
        out: dict[str, Any] = {
            "model": self.model_tag,
            "embeddings": {n: rows[i] for i, n in enumerate(names)},
            "modes": {n: self.policy.stage_mode(overlay.has_features(v), overlay.degree(v), evaluation.stage(v))
                      for n, v in zip(names, targets)},
        }
        if self.head is not None:
            scores = self.head.score(rows)
            out["scores"] = {n: float(scores[i]) for i, n in enumerate(names)}
        return out


class _Evaluation:
    """One what-if: the requested nodes' final rows over an overlay, computing only what the events reach.

    ``changed(l, v)``: ``h^l(v)`` may differ from the stored row. ``h^0(v)``
    changes with ``v``'s features or existence; ``h^{l+1}(v)`` when ``h^l`` of
    ``v`` or of a member of its sample changed, or ``v``'s neighbour set did
    (its sample, its degree and so its cold-start decision), or, for a layer
    that reads its neighbours' sample sizes (GCN), a sampled neighbour's
    neighbour set did. Any other row is read from the store (``clean``)
    instead of computed.
    """

    def __init__(self, state: QueryState, overlay: Overlay, clean: bool):
        self.state, self.overlay, self.clean = state, overlay, clean
        self.fanouts = state.fanouts
        self._samples: list[dict[int, list[int]]] = [{} for _ in self.fanouts]
        self._relation_samples: dict[tuple[int, int, tuple[str, str, str]], list[int]] = {}
        self._changed: list[dict[int, bool]] = [{} for _ in range(len(self.fanouts) + 1)]
        self._stages: dict[int, int] = {}
        self.typed = state.typed
        # layers read neighbours' sample sizes (GCN)
        self.counts = self.typed is None and state.model.model.uses_neighbour_counts
        if self.typed is not None:  # a slot's neighbour set changed: its node's did (workers/engine/typed.py)
            self.touched = set(overlay.nbrs) | {self._owner(x) for x in overlay.nbrs}

    def stage(self, v: int) -> int:
        """``v``'s cold-start stage in the overlay (``STAGE_*``), at its stream time."""
        got = self._stages.get(v)
        if got is None:
            ov, policy = self.overlay, self.state.policy
            age = ov.age(v) if policy.by_age else 0.0  # only a staged policy reads ages
            got = self._stages[v] = int(policy.stages(np.asarray([ov.degree(v)]), np.asarray([age]))[0])
        return got

    def _owner(self, v: int) -> int | None:
        """A typed graph's slot's node in the overlay (the node itself for a node)."""
        name = self.overlay.name(v)
        colon, slash = name.find(":"), name.find("/")
        return self.overlay.node(name[colon + 1:]) if 0 <= colon < slash else v

    def relation_sample(self, l: int, v: int, edge_type: tuple[str, str, str]) -> list[int]:
        """``S'_{k_l,ρ}(v)`` of a typed graph's node: its slot's sample (empty without a slot); read once (the
        layer reads it again after :meth:`sample` did)."""
        got = self._relation_samples.get((l, v, edge_type))
        if got is None:
            ov = self.overlay
            slot = ov.node(f"{'__'.join(edge_type)}:{ov.name(v)}")
            got = self._relation_samples[(l, v, edge_type)] = \
                ov.sample(slot, self.fanouts[l]) if slot is not None and ov.alive(slot) else []
        return got

    def sample(self, l: int, v: int) -> list[int]:
        """``S'_{k_l}(v)`` as layer ``l`` reads it (empty for a node that does not use its neighbours, two hops
        for an expanded one; a typed graph's node: the samples of every edge type reaching it, one after the
        other)."""
        got = self._samples[l].get(v)
        if got is None and self.typed is not None:
            t = self.typed.type_of(self.overlay.name(v))
            got = self._samples[l][v] = [u for e in self.typed.schema.inbound(t)
                                         for u in self.relation_sample(l, v, e)]
        if got is None:
            ov, k = self.overlay, self.fanouts[l]
            stage = self.stage(v)
            if stage == STAGE_NONE:
                got = []
            elif stage == STAGE_EXPANDED:
                got = self._expanded(v, k)
            else:
                got = ov.sample(v, k)
            self._samples[l][v] = got
        return got

    def _expanded(self, v: int, k: int) -> list[int]:
        """The ``k`` members of ``(N'(v) ∪ ⋃_{u ∈ N'(v)} S'_k(u)) \\ {v}`` with the smallest ``(r(v, w), w)``."""
        ov = self.overlay
        nbrs = [u for _, u in ov.neighbours(v)]
        pool = set(nbrs).union(*(ov.sample(u, k) for u in nbrs)) - {v}
        rank, name = ov._rank, ov.name(v)
        return [w for _, _, w in sorted((rank(name, n), n, w) for w in pool for n in (ov.name(w),))][:k]

    def changed(self, l: int, v: int) -> bool:
        if not self.clean:
            return True
        got = self._changed[l].get(v)
        if got is None:
            ov = self.overlay
            if l == 0:
                got = v in ov.inputs
            else:
                got = v in (ov.nbrs if self.typed is None else self.touched) or self.changed(l - 1, v)
                if not got and self.stage(v) == STAGE_EXPANDED:  # it merges its neighbours' samples
                    got = any(u in ov.nbrs for _, u in ov.neighbours(v))
                # below layer 1 only features and existence count: without any, no sample need be read
                if not got and (l > 1 or ov.inputs or (self.counts and ov.nbrs)):
                    sample = self.sample(l - 1, v)
                    got = (any(self.changed(l - 1, u) for u in sample)
                           or (self.counts and any(u in ov.nbrs for u in sample)))
            self._changed[l][v] = got
        return got

    def final(self, targets: list[int]) -> np.ndarray | None:
        """The final rows of ``targets``; None when a row that should be stored is not."""
        levels = len(self.fanouts)
        compute: list[list[int]] = [[] for _ in range(levels + 1)]
        stored: list[list[int]] = [[] for _ in range(levels + 1)]
        required = list(dict.fromkeys(targets))
        for l in range(levels, 0, -1):
            compute[l] = [v for v in required if self.changed(l, v)]
            stored[l] = [v for v in required if not self.changed(l, v)]
            below = dict.fromkeys(compute[l])
            for v in compute[l]:
                below.update(dict.fromkeys(self.sample(l - 1, v)))
            required = list(below)
        # level 0: the features of every node a computed row reads
        table = torch.from_numpy(self.overlay.feature_rows(required, self.state.dims[0]))
        at = {v: i for i, v in enumerate(required)}
        gnn = self.state.model.model
        for l, k in enumerate(self.fanouts):
            level = compute[l + 1]
            parts = []
            if level and self.typed is not None:
                parts.append(self._typed_layer(l, level, table, at))
            elif level:
                samples = [self.sample(l, v) for v in level]
                self_count = torch.tensor([len(s) for s in samples], dtype=torch.long)
                nbr = torch.tensor([at[u] for s in samples for u in s], dtype=torch.long)
                index = torch.repeat_interleave(torch.arange(len(level)), self_count)
                nbr_count = torch.tensor([self._sample_size(u, k) for s in samples for u in s], dtype=torch.long) \
                    if self.counts else torch.zeros(len(nbr), dtype=torch.long)
                parts.append(gnn.layer(l, table[[at[v] for v in level]], table[nbr], index, self_count, nbr_count))
            if stored[l + 1]:
                held = self._stored_rows(l + 1, stored[l + 1])
                if held is None:
                    return None
                parts.append(torch.from_numpy(held))
            table = torch.cat(parts) if len(parts) > 1 else parts[0] if parts else \
                torch.zeros((0, self.state.dims[l + 1]), dtype=torch.float32)
            at = {v: i for i, v in enumerate(level + stored[l + 1])}
        return table[[at[v] for v in targets]].numpy()

    def _typed_layer(self, l: int, level: list[int], table: torch.Tensor, at: dict[int, int]) -> torch.Tensor:
        """Layer ``l`` of a typed graph's nodes ``level`` from the rows of ``table`` (positions ``at``): per
        node type, each edge type's samples into :meth:`HeteroSAGE.layer`."""
        gnn, typed, ov = self.state.model.model, self.typed, self.overlay
        widths = gnn.widths[l]
        out = torch.zeros((len(level), self.state.dims[l + 1]), dtype=torch.float32)
        kinds = [typed.type_of(ov.name(v)) for v in level]
        for t in typed.schema.type_names:
            idx = [i for i, kind in enumerate(kinds) if kind == t]
            if not idx:
                continue
            inputs = []
            for e in typed.schema.inbound(t):
                samples = [self.relation_sample(l, level[i], e) for i in idx]
                inputs.append((e, table[:, :widths[e[0]]].contiguous(),
                               torch.tensor([at[u] for s in samples for u in s], dtype=torch.long),
                               torch.tensor([len(s) for s in samples], dtype=torch.long)))
            x_self = table[[at[level[i]] for i in idx], :widths[t]].contiguous()
            with torch.no_grad():
                out[idx] = gnn.layer(l, t, x_self, inputs)
        return out

    def _sample_size(self, v: int, k: int) -> int:
        return len(self.sample(self.fanouts.index(k), v))

    def _stored_rows(self, layer: int, nodes: list[int]) -> np.ndarray | None:
        log = self.state.log(layer)
        rows, present = log.rows(np.asarray(nodes, dtype=np.int64), self.state.dims[layer], checked=True)
        return rows if present.all() else None
