"""Transaction scores: every applied ``edge_upsert`` of a typed model's scored relation, scored from the
embeddings of the batch that applied it and published to the transaction topic (docs/design.md, Typed graphs).

A batch's transactions are stored with its offsets (``TRANSACTIONS_META``),
in the WriteBatch that applies them; once the batch is recomputed their
scores are produced and flushed. A crash in between leaves them stored:
the worker scores them again when it starts, with the embeddings it holds
then. Delivery is at least once; a consumer keeps one score per key. A
transaction one of whose ends a later event of its batch deleted has no
embedding left to be scored with: it is logged and counted as unscored.

A record: key the event's ``txn_id`` (without one, ``SRC>DST@TS`` of the
two nodes' keys), value JSON ``{"txn_id", "relation", "src", "dst", "ts",
"score", "model", "src_version", "dst_version"}``: the versions of the two
embeddings it read (null for a node whose final row this worker of a group
does not keep: computed for the score, never published). Every worker of a
group applies every event and publishes every score: a partition changing
hands can then lose none.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

from gnnstream.graph_state.store import GraphStore
from gnnstream.model.head import HEAD_FILE, TransactionHead, load_transaction_head
from gnnstream.stream.clients import ProducerClient
from gnnstream.stream.events import EdgeUpsert
from gnnstream.workers.engine import Engine
from gnnstream.workers.engine.rows import CachedRows

__all__ = ["TransactionScores", "TRANSACTIONS_META"]

logger = logging.getLogger(__name__)

TRANSACTIONS_META = "transactions"  # the transactions of the last applied batch, until their scores are out
_FLUSH_S = 30.0  # how long a batch's scores may take to be acknowledged


def _key(txn: dict[str, Any]) -> str:
    """A transaction's record key: its ``txn_id``, else ``SRC>DST@TS``."""
    ts = int(txn["ts"]) if float(txn["ts"]).is_integer() else repr(txn["ts"])
    return txn["txn_id"] or f"{txn['src']}>{txn['dst']}@{ts}"


def _record(ev: EdgeUpsert) -> dict[str, Any]:
    return {"txn_id": ev.txn_id, "src": f"{ev.src_type}/{ev.src}", "dst": f"{ev.dst_type}/{ev.dst}", "ts": ev.ts,
            "features": list(ev.features)}


class TransactionScores:
    """Scores the scored relation's transactions of each batch and publishes them.

    Args:
        engine: the typed model's engine (its layout collects the transactions it reads).
        head: the model's transaction head.
        producer: where the scores go.
        topic: the transaction topic.
        store: the state (transactions held from before a restart are read from it).
    """

    def __init__(self, engine: Engine, head: TransactionHead, producer: ProducerClient, topic: str,
                 store: GraphStore):
        self.engine, self.head, self.producer, self.topic = engine, head, producer, topic
        assert engine.typed is not None
        engine.typed.scored = head.relation  # the layout keeps this relation's upserts as it reads them
        self.pending: list[dict[str, Any]] = list(store.meta(TRANSACTIONS_META) or [])
        self.published = 0
        self.unscored = 0  # transactions with an end deleted before their batch was recomputed

    @classmethod
    def of(cls, engine: Engine, producer: ProducerClient, topic: str, store: GraphStore) -> "TransactionScores | None":
        """The transaction scores of ``engine``'s model: None unless it is typed with a transaction head (its
        ``head.json``, trained for this model)."""
        path = engine.model.path
        if engine.typed is None or not (path / HEAD_FILE).exists():
            return None
        head = load_transaction_head(path)
        if head is None or head.model != engine.model_tag:
            return None
        return cls(engine, head, producer, topic, store)

    def take(self) -> dict[str, Any]:
        """The transactions read since the last call, as the meta stored with the batch that applies them."""
        batch = [_record(ev) for ev in self.engine.typed.take_scored()]
        self.pending += batch
        return {TRANSACTIONS_META: self.pending}

    def publish(self) -> int:
        """Score the pending transactions with the embeddings held now, produce them and flush; returns how
        many went out."""
        if not self.pending:
            return 0
        store, engine = self.engine.store, self.engine
        names = [t[end] for t in self.pending for end in ("src", "dst")]
        iids = np.asarray([store.iid(n) if store.iid(n) is not None else -1 for n in names], dtype=np.int64)
        rows, versions = self._final_rows(iids)
        sent, unscored = 0, []
        for i, txn in enumerate(self.pending):
            s, d = 2 * i, 2 * i + 1
            if rows[s] is None or rows[d] is None:  # an end deleted since: no embedding to score it with
                unscored.append(txn)
                continue
            key = _key(txn)
            score = float(self.head.score(rows[s], rows[d], np.asarray(txn["features"], dtype=np.float64)))
            value = {"txn_id": txn["txn_id"], "relation": self.head.relation, "src": txn["src"],
                     "dst": txn["dst"], "ts": txn["ts"], "score": score, "model": engine.model_tag,
                     "src_version": versions[s], "dst_version": versions[d]}
            self.producer.send(self.topic, key.encode(), json.dumps(value).encode())
            sent += 1
        self.producer.flush(_FLUSH_S)  # raises DeliveryError when any was not acknowledged: they stay pending
        self.pending = []
        self.published += sent
        if unscored:
            self.unscored += len(unscored)
            first = ", ".join(map(_key, unscored[:3]))
            logger.warning("%d transactions not scored: an end was deleted in the batch that applied them (first: "
                           "%s)", len(unscored), first)
        return sent

    def _final_rows(self, iids: np.ndarray) -> tuple[list[Any], list[int | None]]:
        """The final embedding (None: no such node) and its stored version (None: not kept here) of each iid."""
        engine, store = self.engine, self.engine.store
        final = engine.num_layers
        alive = (iids >= 0) & (store.node_arrays(np.maximum(iids, 0))[0] >= 0)
        rows, present = engine.tables.get(final, np.where(alive, iids, 0))
        present &= alive & engine.shards.kept(np.maximum(iids, 0))  # rows of partitions given up are stale
        missing = np.flatnonzero(alive & ~present)
        out: list[Any] = [rows[i] if present[i] else None for i in range(len(iids))]
        if len(missing):  # not kept by this worker of a group: computed from the layer below
            ids = np.unique(iids[missing])
            computed, _ = engine.compute_layer(final - 1, ids, CachedRows(engine.tables, final - 1))
            at = {int(v): r for v, r in zip(ids.tolist(), computed)}
            for i in missing.tolist():
                out[i] = at[int(iids[i])]
        version, _, _ = engine.meta.get(np.where(present, iids, 0))
        versions = [int(version[i]) if present[i] else None for i in range(len(iids))]
        return out, versions
