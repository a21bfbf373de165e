"""The fraud scorer: embeddings in, fraud scores out.

Consumes ``node-embeddings``, applies the logistic head trained by
``gnnstream train`` and publishes one score per update to ``fraud-scores``
(key = node id)::

    {"id":"a1","score":0.91,"embedding_version":7,"model":"otc-sage:1","event_ts":1700000000,"scored_at":1700000002.5}

A deleted node's tombstone is passed on as a tombstone. Delivery is at least
once, like the embeddings it scores.

An update that does not decode (or whose embedding is not the head's size) is
skipped with a warning naming its topic, partition and offset, and counted as
``invalid``; an update of a model other than the one the head was trained for
(``head.json``'s ``model``) is skipped and counted as ``other_model``. The rest
of the poll is scored and committed, so one bad message never stops the scorer.

Per poll: the updates are decoded into columns (:func:`decode_updates`: one
``orjson.loads`` per JSON message, one ``numpy`` matrix of all embeddings),
scored with one :meth:`FraudHead.score` call and encoded with ``orjson``; a
poll holding a bad message is decoded message by message instead.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any, Sequence

import numpy as np
import orjson

from stream.backends import DEFAULT_KAFKA_CLIENT, open_consumer, open_producer
from stream.clients import Record
from stream.exceptions import InvalidUpdate
from stream.kafka import ensure_topics
from stream.updates import BINARY_MAGIC, decode_update
from workers.train import FraudHead, load_head

__all__ = ["FraudScorer", "encode_score", "encode_scores", "decode_updates", "DecodedUpdates"]

logger = logging.getLogger(__name__)

_NUMBERS = frozenset((int, float))


def encode_score(node: str, score: float, version: int, model: str, event_ts: float) -> bytes:
    return encode_scores([node], np.asarray([score]), [version], [model], [event_ts], time.time())[0]


def encode_scores(nodes: Sequence[str], scores: np.ndarray, versions: Sequence[int], models: Sequence[str],
                  event_ts: Sequence[float], scored_at: float) -> list[bytes]:
    """The score messages of many updates (``scores`` rounded to 6 decimals), one ``orjson.dumps`` each."""
    dumps = orjson.dumps
    return [dumps({"id": node, "score": score, "embedding_version": version, "model": model, "event_ts": ts,
                   "scored_at": scored_at})
            for node, score, version, model, ts in zip(nodes, np.round(np.asarray(scores, dtype=np.float64), 6)
                                                       .tolist(), versions, models, event_ts)]


class DecodedUpdates:
    """Embedding updates as columns: ``ids``, ``versions``, ``models``, ``event_ts`` (lists) and ``rows``
    (an ``(n, dim)`` float32 matrix)."""

    __slots__ = ("ids", "versions", "models", "event_ts", "rows")

    def __init__(self, ids: list[str], versions: list[int], models: list[str], event_ts: list[Any],
                 rows: np.ndarray):
        self.ids, self.versions, self.models, self.event_ts, self.rows = ids, versions, models, event_ts, rows

    def __len__(self) -> int:
        return len(self.ids)


def decode_updates(values: Sequence[bytes]) -> DecodedUpdates:
    """Decode many update messages (JSON or binary, not tombstones) at once.

    JSON messages are read with one ``orjson.loads`` each and their
    embeddings turned into one float32 matrix; a batch that is not all
    well-formed JSON updates of one dimension is decoded message by message
    with :func:`stream.updates.decode_update`, which validates every field.

    Raises:
        InvalidUpdate: a message is not an update (from ``decode_update``).
    """
    if any(v[:1] == bytes((BINARY_MAGIC,)) for v in values):
        return _decode_each(values)
    try:
        objs = list(map(orjson.loads, values))
        ids = [o["id"] for o in objs]
        versions = [o["version"] for o in objs]
        models = [o["model"] for o in objs]
        times = [o["event_ts"] for o in objs]
        embeddings = [o["embedding"] for o in objs]
        # element types as sets built in C (a bool is an int subclass but its type is bool)
        valid = (set(map(type, ids)) <= {str} and all(ids) and set(map(type, models)) <= {str} and all(models)
                 and set(map(type, versions)) <= {int} and min(versions) >= 0
                 and set(map(type, times)) <= _NUMBERS and set(map(type, embeddings)) <= {list}
                 and set(map(type, itertools.chain.from_iterable(embeddings))) <= _NUMBERS
                 and len(set(map(len, embeddings))) == 1)
        rows = np.array(embeddings, dtype=np.float32) if valid else None
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        valid = False
    if not valid:
        return _decode_each(values)
    return DecodedUpdates(ids, versions, models, list(map(float, times)), rows)


def _decode_each(values: Sequence[bytes]) -> DecodedUpdates:
    updates = [decode_update(v) for v in values]
    dims = {len(u.embedding) for u in updates}
    if len(dims) > 1:
        raise InvalidUpdate("bad_field", f"updates of one poll have embeddings of {len(dims)} sizes {sorted(dims)}")
    rows = (np.stack([np.asarray(u.embedding, dtype=np.float32) for u in updates]) if updates
            else np.zeros((0, 0), dtype=np.float32))
    return DecodedUpdates([u.id for u in updates], [u.version for u in updates], [u.model for u in updates],
                         [u.event_ts for u in updates], rows)


class FraudScorer:
    """Scores every embedding update it reads.

    Args:
        bootstrap: Kafka bootstrap servers.
        head: the logistic head (see :func:`workers.train.load_head`).
        in_topic / out_topic: embeddings in, scores out.
        group: consumer group id.
        kafka_client: one of :data:`stream.backends.KAFKA_CLIENTS`.
    """

    def __init__(self, bootstrap: str, head: FraudHead | str, *, in_topic: str = "node-embeddings",
                 out_topic: str = "fraud-scores", group: str = "gnnstream-fraud-scorer", partitions: int = 4,
                 kafka_client: str = DEFAULT_KAFKA_CLIENT):
        self.bootstrap = bootstrap
        self.head = head if isinstance(head, FraudHead) else load_head(head)
        self.in_topic, self.out_topic, self.group = in_topic, out_topic, group
        self.partitions = partitions
        self.kafka_client = kafka_client
        self.scored = 0
        self.deleted = 0
        self.invalid = 0
        self.other_model = 0
        self._other_models: set[str] = set()
        self._stop = threading.Event()

    def stop(self, *_: Any) -> None:
        self._stop.set()

    def run(self, max_idle_s: float | None = None) -> dict[str, int]:
        ensure_topics(self.bootstrap, {self.in_topic: self.partitions, self.out_topic: self.partitions})
        consumer = open_consumer(self.kafka_client, self.bootstrap, self.in_topic, self.group)
        producer = open_producer(self.kafka_client, self.bootstrap)
        idle_since = time.monotonic()
        try:
            while not self._stop.is_set():
                records = consumer.poll_batch(2000, 0.5)
                if records or not consumer.assignment():
                    idle_since = time.monotonic()
                elif max_idle_s is not None and time.monotonic() - idle_since > max_idle_s:
                    break
                send, out_topic = producer.send, self.out_topic
                updates = []
                for r in records:
                    if r.value is None:
                        send(out_topic, r.key, None)
                        self.deleted += 1
                    else:
                        updates.append(r)
                cols = self._decode(updates) if updates else None
                if cols:
                    scores = self.head.score(cols.rows)
                    messages = encode_scores(cols.ids, scores, cols.versions, cols.models, cols.event_ts,
                                             time.time())
                    for node, message in zip(cols.ids, messages):
                        send(out_topic, node.encode(), message)
                    self.scored += len(cols)
                if records:
                    producer.flush(30.0)
                    consumer.commit()
        finally:
            consumer.close()
            producer.close()
        return {"scored": self.scored, "deleted": self.deleted, "invalid": self.invalid,
                "other_model": self.other_model}

    def _decode(self, records: Sequence[Record]) -> DecodedUpdates:
        """The scorable updates of ``records`` (no tombstones): one :func:`decode_updates` call for the whole
        poll, message by message when that fails; bad and other-model updates are counted and left out."""
        dim = len(self.head.weights)
        try:
            cols = decode_updates([r.value for r in records])
        except InvalidUpdate:
            kept: list[Any] = []
            for r in records:
                try:
                    u = decode_update(r.value)
                except InvalidUpdate as exc:
                    self._skip_invalid(r, exc.reason, exc.detail)
                    continue
                if self._is_other_model(u.model):
                    continue
                if len(u.embedding) != dim:
                    self._skip_invalid(r, "bad_dim", f"embedding of {len(u.embedding)} values, the fraud head "
                                                     f"takes {dim}")
                    continue
                kept.append(u)
            rows = (np.stack([np.asarray(u.embedding, dtype=np.float32) for u in kept]) if kept
                    else np.zeros((0, dim), dtype=np.float32))
            return DecodedUpdates([u.id for u in kept], [u.version for u in kept], [u.model for u in kept],
                                 [u.event_ts for u in kept], rows)
        model = self.head.model
        keep = ([True] * len(cols) if model is None or set(cols.models) == {model}
                else [m == model for m in cols.models])
        for m, ok in zip(cols.models, keep):
            if not ok:
                self._is_other_model(m)
        if cols.rows.shape[1] != dim:
            for r, ok in zip(records, keep):
                if ok:
                    self._skip_invalid(r, "bad_dim", f"embedding of {cols.rows.shape[1]} values, the fraud head "
                                                     f"takes {dim}")
            keep = [False] * len(keep)
        if all(keep):
            return cols
        idx = [i for i, ok in enumerate(keep) if ok]
        return DecodedUpdates([cols.ids[i] for i in idx], [cols.versions[i] for i in idx],
                             [cols.models[i] for i in idx], [cols.event_ts[i] for i in idx],
                             cols.rows[idx] if idx else np.zeros((0, dim), dtype=np.float32))

    def _skip_invalid(self, record: Record, reason: str, detail: str) -> None:
        self.invalid += 1
        logger.warning("skipped an invalid update at %s partition %d offset %d (%s: %s); it is not scored",
                       record.topic, record.partition, record.offset, reason, detail)

    def _is_other_model(self, model: str) -> bool:
        """True (counted; warned once per model) when ``model`` is not the one the head was trained for."""
        if self.head.model is None or model == self.head.model:
            return False
        self.other_model += 1
        if model not in self._other_models:
            self._other_models.add(model)
            logger.warning("skipping updates of model %s on %s: the fraud head was trained for %s (retrain it with "
                           "`gnnstream train`, or score with the head of %s)", model, self.in_topic,
                           self.head.model, model)
        return True
