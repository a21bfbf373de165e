"""A typed graph held in the graph store as an untyped one (docs/design.md, Typed graphs).

The store keeps untyped neighbour lists ordered by ``(rank(v, u), u)``, with
``rank(v, u) = blake2b(f"{seed}:{v}:{u}")``. A typed graph fits it unchanged:

- a node ``(type, id)`` is the store's node ``type/id``;
- each edge type ``ρ`` reaching a node ``v`` is a *slot* node ``ρ:type/id`` whose
  neighbour list is ``N_ρ(v)``: its ranks are then
  ``blake2b(f"{seed}:{ρ}:{key(v)}:{key(u)}")``, the typed rank, and its first
  ``k`` entries are ``S_{k,ρ}(v)``;
- the typed edge ``u -r-> v`` of the relation ``ρ = (s, r, t)`` is the two
  untyped edges ``u → ρ:v`` and ``ρ':u → v``, where ``ρ'`` is the reverse edge
  type ``(t, rev_r, s)``, or ``ρ`` itself when ``s = t``. The store's
  neighbourhoods ignore direction, so ``u`` is in the list of ``ρ:v`` and
  ``v`` in the list of ``ρ':u``; within one type, ``u → ρ:v`` and ``v → ρ:u``
  stand for ``u -r-> v`` and ``v -r-> u`` alike, so a pair stays linked while
  either direction is present, as ``ToUndirected()`` makes it. A typed
  self-loop is an untyped self-loop (ignored by samples).
- ``node_delete`` of ``v`` also deletes its slots, and with them every edge
  that links them.

A node's own untyped list holds the slots it is linked to (one per typed
neighbour and edge type): its length is its typed degree. The engine reads
samples from the slots only, computes embeddings of the typed nodes only,
and maps a change to a slot's sample to the slot's node.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gnnstream.graph_state.store import GraphStore
from gnnstream.model.schema import EdgeType, GraphSchema, edge_type_name
from gnnstream.workers.engine.stats import EngineError
from gnnstream.stream.events import (MAX_EVENT_BYTES, EdgeDelete, EdgeUpsert, Event, NodeDelete, NodeUpsert,
                                     check_schema, decode_event_json)

__all__ = ["TypedLayout", "bind_schema", "schema_refusal", "graph_edges", "GRAPH_SCHEMA_META"]

_UNKNOWN = -2  # an iid not learnt yet (TypedLayout)
GRAPH_SCHEMA_META = "graph_schema"  # a typed graph's schema (its model's), fixed when the state is created


def bind_schema(store: GraphStore, schema: dict[str, Any] | None, model_tag: str) -> None:
    """Refuse a typed model on a state of an untyped graph or of another schema, and an untyped model on a
    typed graph; a new (empty) state takes the model's schema.

    Raises:
        EngineError: in one line, naming what the state holds.
    """
    held = store.meta(GRAPH_SCHEMA_META)
    if held is None and schema is not None and store.num_nodes() == 0:
        store.apply([], meta={GRAPH_SCHEMA_META: schema})
        return
    refused = schema_refusal(store.path, held, schema, model_tag)
    if refused:
        raise EngineError(refused)


def schema_refusal(state: str, held: dict[str, Any] | None, schema: dict[str, Any] | None,
                   model_tag: str) -> str | None:
    """Why a model of ``schema`` (None: untyped) does not serve the graph of ``state``, which holds ``held`` (its
    :data:`GRAPH_SCHEMA_META`): one line; None when it does."""
    if _graph_of(held) == _graph_of(schema):
        return None
    if held is None:
        return (f"state {state!r} holds an untyped graph, which typed model {model_tag} does not serve; use an "
                f"untyped model, or a new --state directory")
    if schema is None:
        return (f"state {state!r} holds a typed graph (node types {sorted(held['node_types'])}), which untyped "
                f"model {model_tag} does not serve; use a typed model of its schema")
    return (f"state {state!r} holds a typed graph of another schema (node types {sorted(held['node_types'])}) "
            f"than model {model_tag}; use a model of its schema, or a new --state directory")


def graph_edges(typed: "TypedLayout | None", store_edges: int, loops: int) -> int:
    """How many of the graph's edges ``store_edges`` of the store's are, ``loops`` of them self-loops: as many
    in an untyped graph; in a typed one, an edge is two of the store's and a self-loop one (the module's text)."""
    return store_edges if typed is None else (store_edges - loops) // 2 + loops


def _graph_of(schema: dict[str, Any] | None) -> Any:
    """What of a schema the stored graph depends on: node types and relations (not edge features or the
    scored relation, which only a transaction head reads)."""
    if schema is None:
        return None
    return (sorted(schema["node_types"].items()),
            sorted((r["src_type"], r["rel"], r["dst_type"]) for r in schema["relations"]))


class TypedLayout:
    """The typed graph of ``schema`` in ``store``: events in, slots and node types out.

    Args:
        schema: the model's graph schema.
        store: the graph store holding the graph.
    """

    def __init__(self, schema: GraphSchema, store: GraphStore):
        self.schema, self.store = schema, store
        self.width = max(w for _, w in schema.node_types)  # features are stored padded to the widest type's
        self._node_types = dict(schema.node_types)
        self._relations = {r.edge_type: r.edge_features for r in schema.relations}
        self.type_index = {t: i for i, t in enumerate(schema.type_names)}
        # per declared relation: the edge type of each end's slot (the target's, the source's)
        self._slot_types = {r.edge_type: (edge_type_name(r.edge_type),
                                          edge_type_name(r.edge_type if r.src == r.dst else
                                                         (r.dst, "rev_" + r.rel, r.src)))
                            for r in schema.relations}
        self._inbound = {t: [edge_type_name(e) for e in schema.inbound(t)] for t in schema.type_names}
        # by iid, learnt when first asked: a slot's node (a node itself, -1 for a slot whose node was never
        # seen, _UNKNOWN not learnt yet), a node's type index (-1 for a slot), and by edge type each node's
        # slot of it (-1: none yet; a slot interned later is learnt through owners, which the engine asks of
        # every node an apply marks, and so of every new slot, before it computes)
        self._owner = np.zeros(0, dtype=np.int64)
        self._type = np.zeros(0, dtype=np.int64)
        self._slot = {edge_type_name(e): np.zeros(0, dtype=np.int64) for e in schema.edge_types()}
        self.scored: str | None = None  # the relation whose upserts :meth:`check` keeps (transaction scores)
        self._scored: list[EdgeUpsert] = []

    # ------------------------------------------------------------------ events
    def read(self, data: Any, max_bytes: int = MAX_EVENT_BYTES) -> list[Event]:
        """One typed event (a Kafka value or a JSONL line) as the store's untyped events.

        Raises:
            InvalidEvent: as :func:`decode_event_json` and :func:`check_schema`.
        """
        return self.check(decode_event_json(data, max_bytes=max_bytes, typed=True))

    def check(self, ev: Event) -> list[Event]:
        """A decoded typed event, checked against the schema, as the store's untyped events.

        Raises:
            InvalidEvent: as :func:`check_schema`.
        """
        check_schema(ev, self._node_types, self._relations)
        if self.scored is not None and isinstance(ev, EdgeUpsert) and \
                edge_type_name((ev.src_type, ev.rel, ev.dst_type)) == self.scored:
            self._scored.append(ev)
        return self.translate(ev)

    def take_scored(self) -> list[EdgeUpsert]:
        """The upserts of the :attr:`scored` relation checked since the last call."""
        taken, self._scored = self._scored, []
        return taken

    def type_of(self, name: str) -> str:
        """The node type of a node's name in the store (``type/id``)."""
        return name[:name.find("/")]

    def translate(self, ev: Event) -> list[Event]:
        """A checked typed event as the store's untyped events (the module's text)."""
        if isinstance(ev, NodeUpsert):
            features = ev.features + (0.0,) * (self.width - len(ev.features))
            return [NodeUpsert(f"{ev.type}/{ev.id}", ev.ts, features)]
        if isinstance(ev, NodeDelete):
            key = f"{ev.type}/{ev.id}"
            return [NodeDelete(key, ev.ts)] + [NodeDelete(f"{slot}:{key}", ev.ts) for slot in self._inbound[ev.type]]
        u, v = f"{ev.src_type}/{ev.src}", f"{ev.dst_type}/{ev.dst}"
        if u == v:
            edges = [(u, v)]
        else:
            at_dst, at_src = self._slot_types[(ev.src_type, ev.rel, ev.dst_type)]
            edges = [(u, f"{at_dst}:{v}"), (f"{at_src}:{u}", v)]
        if isinstance(ev, EdgeUpsert):
            return [EdgeUpsert(a, b, ev.ts, ev.weight) for a, b in edges]
        return [EdgeDelete(a, b, ev.ts) for a, b in edges]

    # ------------------------------------------------------------------ nodes and slots
    def _grow(self, size: int) -> None:
        have = len(self._owner)
        if size <= have:
            return
        new = max(size, 2 * have, 1024)
        for name in ("_owner", "_type"):
            grown = np.full(new, _UNKNOWN, dtype=np.int64)
            grown[:have] = getattr(self, name)
            setattr(self, name, grown)
        for relation, slots in self._slot.items():
            grown = np.full(new, _UNKNOWN, dtype=np.int64)
            grown[:have] = slots
            self._slot[relation] = grown

    def _learn(self, iids: np.ndarray) -> None:
        """Learn the owner and type of distinct ``iids`` not learnt yet (a slot's node's slot of its type)."""
        store = self.store
        for iid in iids.tolist():
            name = store.name(iid)
            colon, slash = name.find(":"), name.find("/")
            if 0 <= colon < slash:  # a slot: ρ:type/id
                owner = store.iid(name[colon + 1:])
                self._owner[iid], self._type[iid] = -1 if owner is None else owner, -1
                if owner is not None:
                    self._grow(owner + 1)
                    self._slot[name[:colon]][owner] = iid
            else:
                self._owner[iid] = iid
                self._type[iid] = self.type_index.get(name[:slash], -1)

    def _known(self, iids: np.ndarray) -> None:
        if len(iids):
            self._grow(int(iids.max()) + 1)
            new = iids[self._owner[iids] == _UNKNOWN]
            if len(new):
                self._learn(np.unique(new))

    def owners(self, iids: np.ndarray) -> np.ndarray:
        """Each iid's node: a slot's owner, a node itself (-1 for a slot whose node was never seen)."""
        self._known(iids)
        return self._owner[iids]

    def nodes(self, iids: np.ndarray) -> np.ndarray:
        """The typed nodes among ``iids`` (slots left out)."""
        return iids[self.owners(iids) == iids]

    def types(self, iids: np.ndarray) -> np.ndarray:
        """The type index (:attr:`type_index`) of each node of ``iids``."""
        self._known(iids)
        return self._type[iids]

    def slots(self, iids: np.ndarray, edge_type: EdgeType) -> np.ndarray:
        """The slot of ``edge_type`` of each node of ``iids`` (-1 where it has none: an empty sample)."""
        relation = edge_type_name(edge_type)
        self._known(iids)
        known = self._slot[relation]
        out = known[iids]
        unknown = np.flatnonzero(out == _UNKNOWN)
        for i, v in zip(unknown.tolist(), iids[unknown].tolist()):
            slot = self.store.iid(f"{relation}:{self.store.name(v)}")  # interned ids are never reused
            known[v] = out[i] = -1 if slot is None else slot
            if slot is not None:  # its owner learnt too: a backfill learns every slot here, not one by one later
                self._grow(slot + 1)
                self._owner[slot], self._type[slot] = v, -1
                known = self._slot[relation]  # grown
        return out
