"""The fraud scorer: embeddings in, fraud scores out, following the serving model version.

Reads the embeddings of one or more model versions, each with its logistic
head (trained by ``gnnstream train``; ``head.json``'s ``model`` is its
``NAME:VERSION``), and publishes one score per serving update to
``fraud-scores`` (key = node id)::

    {"id":"a1","score":0.91,"embedding_version":7,"model":"otc-sage:1","event_ts":1700000000,"scored_at":1700000002.5,
     "role":"serving","rollout":0}

``rollout`` is the update's ``gnnstream.rollout`` number: the version topics
are not ordered against each other, so a consumer orders a node's scores by
``(rollout, embedding_version)``.

Input: one consumer (one group) over every head's version topic,
:func:`gnnstream.stream.rollout.version_topic` of its model; or one explicit
``in_topic`` with a single head (the head may then have no model tag, and
scores updates of any model).

Serving: an update of model ``m`` is scored for ``fraud-scores`` when
:func:`gnnstream.stream.rollout.is_serving` says it is the serving one (its
``gnnstream.serving`` header names ``m``, or it has none). During a rollout
each graph change thus gets exactly one serving score, whichever version's
worker publishes first. A serving tombstone (a deleted node) is passed on as
a tombstone; the other tombstones are dropped. Delivery is at least once,
like the embeddings it scores.

Canary (``canary`` > 0): a node is in the canary when ``zlib.crc32`` of its
UTF-8 id divided by ``2**32`` is below ``canary``. For canary nodes the
non-serving updates of models with a head are scored too and published to
``canary_topic`` (default ``<out_topic>.canary``) with ``"role":"canary"``;
their serving scores go there as well (``"role":"serving"``), so that topic
holds every version's scores of the same nodes, each tagged with its
``model``. Non-serving updates of other nodes are counted as ``not_serving``
and not scored (as are non-serving tombstones).

Canary report (:meth:`FraudScorer.canary_report`, :func:`compare_scores`):
from the latest score of each canary node per model (a model's tombstone
drops the node), per model ``nodes``, ``mean``, ``p10``/``p50``/``p90``; per
pair of models (the serving one first: the model of the latest serving
update) the ``nodes`` scored by both and, over those, the mean and maximum
absolute difference and the two-sample Kolmogorov–Smirnov statistic. It is
logged at INFO every ``report_every_s``, produced (JSON, key ``canary``) to
``control_topic`` (default :data:`gnnstream.stream.rollout.CONTROL_TOPIC`; ``None``:
not produced) and returned with :meth:`FraudScorer.run`'s summary, once more
when the scorer stops.

Summary of :meth:`FraudScorer.run`: ``scored`` (serving scores published),
``canary_scored`` (non-serving updates scored for the canary),
``not_serving``, ``deleted`` (serving tombstones passed on), ``invalid``,
``other_model`` (:data:`SUMMARY_KEYS`, whatever the heads and input topics)
and, with a canary, ``canary`` (the report).

Bad input: an update that does not decode (or whose embedding is not its
head's size) is skipped with a warning naming its topic, partition and
offset, and counted as ``invalid``; an update of a model without a head is
skipped and counted as ``other_model``. The rest of the poll is scored and
committed, so one bad message never stops the scorer.

A node's messages keep their order (a tombstone after an update of its node
in the same poll is published after that update's score). Per poll and topic
(split at such a tombstone): the updates are decoded into columns
(:func:`decode_updates`: one ``orjson.loads`` per JSON message, one ``numpy``
matrix of all embeddings), the serving and canary rows selected with boolean
masks, each model's rows scored with one :meth:`ScoreHead.score` call and
encoded with ``orjson``; a poll holding a bad message is decoded message by
message instead.
"""

from __future__ import annotations

import itertools
import logging
import operator
import os
import threading
import time
from typing import Any, Mapping, Sequence

import numpy as np
import orjson

from gnnstream.stream.backends import DEFAULT_KAFKA_CLIENT, open_consumer, open_producer
from gnnstream.stream.clients import Record
from gnnstream.stream.exceptions import InvalidUpdate
from gnnstream.stream.kafka import ensure_topics
from gnnstream.stream.rollout import CONTROL_TOPIC, SERVING_HEADER, is_serving, rollout_of, version_topic
from gnnstream.stream.updates import (BINARY_MAGIC, PACKED_MAGIC, decode_binary_columns, decode_packed_columns,
                                      decode_update)
from gnnstream.model.head import ScoreHead, load_head
from gnnstream.fraud.canary import canary_mask, compare_scores

__all__ = ["FraudScorer", "SCORES_TOPIC", "SUMMARY_KEYS", "encode_scores", "decode_updates", "DecodedUpdates"]

logger = logging.getLogger(__name__)

SCORES_TOPIC = "fraud-scores"  # where serving scores go unless told otherwise
SUMMARY_KEYS = ("scored", "canary_scored", "not_serving", "deleted", "invalid", "other_model")
"""The counts in :meth:`FraudScorer.summary` (and ``gnnstream score``'s JSON), one model or several."""
_NUMBERS = frozenset((int, float))
_BINARY = bytes((BINARY_MAGIC,))
_PACKED = bytes((PACKED_MAGIC,))
_VALUE, _TOPIC, _HEADERS = operator.attrgetter("value"), operator.attrgetter("topic"), operator.attrgetter("headers")


def encode_scores(nodes: Sequence[str], scores: np.ndarray, versions: Sequence[int], models: Sequence[str],
                  event_ts: Sequence[float], scored_at: float, role: str | None = None,
                  rollouts: Sequence[int] | None = None) -> list[bytes]:
    """The score messages of many updates (``scores`` rounded to 6 decimals), one ``orjson.dumps`` each;
    with ``role`` (``"serving"`` or ``"canary"``) and ``rollouts`` (the updates' ``gnnstream.rollout``
    numbers) each message carries them."""
    dumps = orjson.dumps
    rounded = np.round(np.asarray(scores, dtype=np.float64), 6).tolist()
    if rollouts is not None:
        return [dumps({"id": node, "score": score, "embedding_version": version, "model": model, "event_ts": ts,
                       "scored_at": scored_at, "role": role, "rollout": rollout})
                for node, score, version, model, ts, rollout in zip(nodes, rounded, versions, models, event_ts,
                                                                    rollouts)]
    if role is None:
        return [dumps({"id": node, "score": score, "embedding_version": version, "model": model, "event_ts": ts,
                       "scored_at": scored_at})
                for node, score, version, model, ts in zip(nodes, rounded, versions, models, event_ts)]
    return [dumps({"id": node, "score": score, "embedding_version": version, "model": model, "event_ts": ts,
                   "scored_at": scored_at, "role": role})
            for node, score, version, model, ts in zip(nodes, rounded, versions, models, event_ts)]


class DecodedUpdates:
    """Embedding updates as columns: ``ids``, ``versions``, ``models``, ``event_ts`` (lists) and ``rows``
    (an ``(n, dim)`` float32 matrix)."""

    __slots__ = ("ids", "versions", "models", "event_ts", "rows")

    def __init__(self, ids: list[str], versions: list[int], models: list[str], event_ts: list[Any],
                 rows: np.ndarray):
        self.ids, self.versions, self.models, self.event_ts, self.rows = ids, versions, models, event_ts, rows

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, idx: Sequence[int] | np.ndarray) -> "DecodedUpdates":
        """The rows ``idx`` (positions, in order)."""
        idx = [int(i) for i in idx]
        return DecodedUpdates([self.ids[i] for i in idx], [self.versions[i] for i in idx],
                              [self.models[i] for i in idx], [self.event_ts[i] for i in idx],
                              self.rows[idx] if idx else self.rows[:0])


def decode_updates(values: Sequence[bytes]) -> DecodedUpdates:
    """Decode many update messages (JSON or binary, not tombstones) at once.

    Binary messages are read as columns (:func:`gnnstream.stream.updates.decode_binary_columns`);
    JSON messages with one ``orjson.loads`` each, their embeddings turned
    into one float32 matrix. A batch that is not all well-formed updates of
    one encoding and one dimension is decoded message by message with
    :func:`gnnstream.stream.updates.decode_update`, which validates every field.

    Raises:
        InvalidUpdate: a message is not an update (from ``decode_update``).
    """
    if values and values[0][:1] == _BINARY:
        try:
            ids, models, versions, times, rows = decode_binary_columns(values)
        except InvalidUpdate:
            return _decode_each(values)
        return DecodedUpdates(ids, versions, models, times, rows)
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
    """Scores the serving embedding updates of one or more model versions, and a canary of the others.

    Args:
        bootstrap: Kafka bootstrap servers.
        heads: the logistic heads, one per model version (:class:`ScoreHead` or a model directory, see
            :func:`fraud.train.load_head`), or a single one; no two for one model.
        in_topic: read this topic instead of the heads' version topics (one head only; ``None`` or empty:
            the version topics).
        out_topic: the serving scores.
        canary: the fraction of nodes (0..1) whose non-serving updates are scored too.
        canary_topic: every score of the canary nodes (default ``<out_topic>.canary``).
        control_topic: where the canary report is produced (``None``: only logged).
        report_every_s: how often the canary report is logged and produced.
        group: consumer group id.
        partitions: partitions of the topics the scorer creates (the control topic gets 1).
        kafka_client: one of :data:`gnnstream.stream.backends.KAFKA_CLIENTS`.

    Raises:
        ValueError: no head, two heads of one model, a head without a model tag (or several heads) without
            ``in_topic``, a model tag that is not ``NAME:VERSION``, ``canary`` outside 0..1, or a canary
            topic that is the output topic.
    """

    def __init__(self, bootstrap: str, heads: ScoreHead | str | os.PathLike | Sequence[ScoreHead | str | os.PathLike],
                 *, in_topic: str | None = None, out_topic: str = SCORES_TOPIC, canary: float = 0.0,
                 canary_topic: str | None = None, control_topic: str | None = CONTROL_TOPIC,
                 report_every_s: float = 30.0, group: str = "gnnstream-fraud-scorer", partitions: int = 4,
                 kafka_client: str = DEFAULT_KAFKA_CLIENT):
        self.bootstrap = bootstrap
        in_topic = in_topic or None
        if isinstance(heads, (ScoreHead, str, os.PathLike)):
            heads = [heads]
        self.heads: tuple[ScoreHead, ...] = tuple(h if isinstance(h, ScoreHead) else load_head(h) for h in heads)
        if not self.heads:
            raise ValueError("the fraud scorer needs at least one head")
        models = [h.model for h in self.heads]
        if len(set(models)) < len(models):
            raise ValueError(f"two heads for one model among {models}: give one head per model version")
        if in_topic is not None and len(self.heads) > 1:
            raise ValueError(f"an explicit input topic ({in_topic!r}) takes one head, not {len(self.heads)}: "
                             f"without it the scorer reads each model's version topic")
        if in_topic is None and None in models:
            raise ValueError("a head without a model tag (trained before it was recorded) needs an explicit input "
                             "topic: its version topic is unknown")
        if not 0.0 <= canary <= 1.0:
            raise ValueError(f"canary must be a fraction of nodes between 0 and 1 (got {canary!r})")
        self.head = self.heads[0]
        self._by_model: dict[str | None, ScoreHead] = {h.model: h for h in self.heads}
        self._untagged = self._by_model.get(None)
        if in_topic is None:
            self._topic_models: dict[str, str | None] = {version_topic(str(m)): m for m in models}
        else:
            self._topic_models = {in_topic: models[0]}
        self.in_topic = in_topic
        self.in_topics = list(self._topic_models)
        self.out_topic, self.group = out_topic, group
        self.canary = float(canary)
        self.canary_topic = canary_topic or f"{out_topic}.canary"
        if self.canary and self.canary_topic == out_topic:
            raise ValueError(f"the canary topic must differ from the output topic ({out_topic!r})")
        self.control_topic = control_topic
        self.report_every_s = report_every_s
        self.partitions = partitions
        self.kafka_client = kafka_client
        self.scored = 0
        self.canary_scored = 0
        self.not_serving = 0
        self.deleted = 0
        self.invalid = 0
        self.other_model = 0
        self._other_models: set[str] = set()
        self._serving_model: str | None = None
        self._serving_rollout = -1
        # the latest score of each canary node per model: {model: {node: (embedding version, score)}}
        self._latest: dict[str, dict[str, tuple[int, float]]] = {m: {} for m in models if m is not None}
        self._model_bytes: dict[str, bytes] = {}
        self._stop = threading.Event()

    def stop(self, *_: Any) -> None:
        self._stop.set()

    def summary(self) -> dict[str, Any]:
        """The counts (and the canary report) :meth:`run` returns; see the module doc."""
        out: dict[str, Any] = {key: getattr(self, key) for key in SUMMARY_KEYS}
        if self.canary:
            out["canary"] = self.canary_report()
        return out

    def canary_report(self) -> dict[str, Any]:
        """:func:`compare_scores` of the canary nodes' latest scores, with the canary ``fraction``."""
        latest = {m: {node: score for node, (_, score) in scores.items()} for m, scores in self._latest.items()}
        return {"fraction": self.canary, **compare_scores(latest, self._serving_model)}

    def run(self, max_idle_s: float | None = None) -> dict[str, Any]:
        topics = {t: self.partitions for t in (*self.in_topics, self.out_topic)}
        reporting = bool(self.canary)
        if reporting:
            topics[self.canary_topic] = self.partitions
            if self.control_topic is not None:
                topics[self.control_topic] = 1
        ensure_topics(self.bootstrap, topics)
        consumer = open_consumer(self.kafka_client, self.bootstrap, self.in_topics, self.group)
        producer = open_producer(self.kafka_client, self.bootstrap)
        idle_since = last_report = time.monotonic()
        try:
            while not self._stop.is_set():
                records = consumer.poll_batch(2000, 0.5)
                if records or not consumer.assignment():
                    idle_since = time.monotonic()
                elif max_idle_s is not None and time.monotonic() - idle_since > max_idle_s:
                    break
                if records:
                    self._score_poll(records, producer.send)
                    producer.flush(30.0)
                    consumer.commit()
                if reporting and time.monotonic() - last_report >= self.report_every_s:
                    last_report = time.monotonic()
                    self._report(producer)
            if reporting:
                self._report(producer)
        finally:
            consumer.close()
            producer.close()
        return self.summary()

    def _report(self, producer: Any) -> None:
        report = self.canary_report()
        logger.info("canary report: %s", orjson.dumps(report).decode())
        if self.control_topic is not None:
            message = {"kind": "canary", **report, "group": self.group, "at": time.time()}
            producer.send(self.control_topic, b"canary", orjson.dumps(message))
            producer.flush(30.0)

    def _score_poll(self, records: Sequence[Record], send: Any) -> None:
        """Score, publish and count one poll: packed frames one at a time, the messages between them as
        :meth:`_score_messages` does, in the poll's order."""
        if not any(v is not None and v[:1] == _PACKED for v in map(_VALUE, records)):
            self._score_messages(records, send)
            return
        run: list[Record] = []
        for r in records:
            if r.value is not None and r.value[:1] == _PACKED:
                self._score_messages(run, send)
                run = []
                self._score_frame(r, send)
            else:
                run.append(r)
        self._score_messages(run, send)

    def _score_frame(self, record: Record, send: Any) -> None:
        """Score the rows of a packed frame in order, a tombstone row passed on where it comes."""
        try:
            c = decode_packed_columns(record.value)
        except InvalidUpdate as exc:
            self._skip_invalid(record, exc.reason, exc.detail)
            return
        live = len(c) - int(c.deleted.sum())
        head = self._head_of(c.model)
        if live and head is None:
            self.other_model += live - 1
            self._count_other_model(c.model, record.topic)
        elif live and len(head.weights) != c.rows.shape[1]:
            self.invalid += live - 1
            self._skip_invalid(record, "bad_dim", f"embeddings of {c.rows.shape[1]} values, the fraud head of "
                                                  f"{c.model} takes {len(head.weights)}")
        scorable = live and head is not None and len(head.weights) == c.rows.shape[1]
        versions, times = c.versions.tolist(), c.event_ts.tolist()
        start = 0
        for stop in [*np.flatnonzero(c.deleted).tolist(), len(c)]:
            if scorable and stop > start:
                cols = DecodedUpdates(c.ids[start:stop], versions[start:stop], [c.model] * (stop - start),
                                      times[start:stop], c.rows[start:stop])
                self._score(cols, [record] * (stop - start), send)
            if stop < len(c):
                self._tombstone(record._replace(key=c.ids[stop].encode(), value=None), send)
            start = stop + 1

    def _score_messages(self, records: Sequence[Record], send: Any) -> None:
        """Score, publish and count messages of one update each, batched per topic. A tombstone is handled
        where it comes unless the batch pending holds an update of its node: that batch is scored first, so a
        node's messages keep their order."""
        if not records:
            return
        if None not in map(_VALUE, records):  # no tombstone: the updates of each topic in one batch
            topics = set(map(_TOPIC, records))
            if len(topics) == 1:
                self._score_batches({topics.pop(): records}, send)
                return
            by_topic: dict[str, list[Record]] = {t: [] for t in topics}
            for r in records:
                by_topic[r.topic].append(r)
            self._score_batches(by_topic, send)
            return
        pending: dict[str, list[Record]] = {}
        keys: set[bytes | None] = set()
        for r in records:
            if r.value is not None:
                pending.setdefault(r.topic, []).append(r)
                keys.add(r.key)
                continue
            if r.key in keys:
                self._score_batches(pending, send)
                pending, keys = {}, set()
            self._tombstone(r, send)
        self._score_batches(pending, send)

    def _score_batches(self, by_topic: Mapping[str, Sequence[Record]], send: Any) -> None:
        for group in by_topic.values():
            for cols, kept in self._decode_rows(group):
                if len(cols):
                    self._score(cols, group if kept is None else [group[i] for i in kept], send)

    def _tombstone(self, record: Record, send: Any) -> None:
        model = self._topic_models.get(record.topic)
        header = record.header(SERVING_HEADER)
        if header is None or model is None or header == self._bytes(model):
            send(self.out_topic, record.key, None)
            self.deleted += 1
        else:
            self.not_serving += 1
        if self.canary and model is not None and record.key:
            self._latest.get(model, {}).pop(record.key.decode("utf-8", "replace"), None)

    def _bytes(self, model: str) -> bytes:
        encoded = self._model_bytes.get(model)
        if encoded is None:
            encoded = self._model_bytes[model] = model.encode()
        return encoded

    def _score(self, cols: DecodedUpdates, records: Sequence[Record], send: Any) -> None:
        """Score the serving rows of ``cols`` (and the canary's), publish them and count the rest."""
        n = len(cols)
        models = cols.models
        kinds = set(models)
        all_headers = set(map(_HEADERS, records))
        if len(all_headers) == 1:  # the usual poll: one worker, one marker
            rollouts = np.full(n, rollout_of(next(iter(all_headers))), dtype=np.int64)
        else:
            number = {h: rollout_of(h) for h in all_headers}
            rollouts = np.fromiter(map(number.__getitem__, map(_HEADERS, records)), dtype=np.int64, count=n)
        if len(kinds) == 1 and len(all_headers) == 1:  # the usual poll: one version, the same headers
            serving = np.full(n, is_serving(models[0], next(iter(all_headers))))
        else:
            serving = np.fromiter((h is None or h == self._bytes(m)
                                   for h, m in zip((r.header(SERVING_HEADER) for r in records), models)),
                                  dtype=bool, count=n)
        canary = canary_mask(cols.ids, self.canary)
        wanted = serving | canary
        self.not_serving += n - int(wanted.sum())
        if not wanted.any():
            return
        scores = np.zeros(n, dtype=np.float64)
        if len(kinds) == 1:
            head = self._head_of(models[0])
            if wanted.all():
                scores = head.score(cols.rows)
            else:
                idx = np.flatnonzero(wanted)
                scores[idx] = head.score(cols.rows[idx])
        else:
            model_array = np.asarray(models)
            for m in kinds:
                idx = np.flatnonzero(wanted & (model_array == m))
                if len(idx):
                    scores[idx] = self._head_of(m).score(cols.rows[idx])
        scores = np.round(scores, 6)
        now = time.time()
        out_topic = self.out_topic
        if serving.any():
            served = cols if serving.all() else cols.take(np.flatnonzero(serving))
            served_scores = scores if serving.all() else scores[serving]
            served_rollouts = rollouts[serving].tolist()
            messages = encode_scores(served.ids, served_scores, served.versions, served.models, served.event_ts, now,
                                     "serving", served_rollouts)
            for node, message in zip(served.ids, messages):
                send(out_topic, node.encode(), message)
            self.scored += len(served)
            newest = int(np.argmax(served_rollouts))  # the topics are not ordered: the highest marker tells
            if served_rollouts[newest] >= self._serving_rollout:
                self._serving_rollout, self._serving_model = served_rollouts[newest], served.models[newest]
        if canary.any():
            self._publish_canary(cols, scores, serving & canary, "serving", now, send)
            extra = canary & ~serving
            self._publish_canary(cols, scores, extra, "canary", now, send)
            self.canary_scored += int(extra.sum())

    def _publish_canary(self, cols: DecodedUpdates, scores: np.ndarray, mask: np.ndarray, role: str, now: float,
                        send: Any) -> None:
        idx = np.flatnonzero(mask)
        if not len(idx):
            return
        rows = cols.take(idx)
        picked = scores[idx]
        topic = self.canary_topic
        for node, message in zip(rows.ids, encode_scores(rows.ids, picked, rows.versions, rows.models,
                                                         rows.event_ts, now, role)):
            send(topic, node.encode(), message)
        latest = self._latest
        for node, model, version, score in zip(rows.ids, rows.models, rows.versions, picked.tolist()):
            per_model = latest.setdefault(model, {})
            kept = per_model.get(node)
            if kept is None or version >= kept[0]:
                per_model[node] = (version, score)

    def _head_of(self, model: str) -> ScoreHead | None:
        """The head that scores updates of ``model`` (the untagged head scores every model), ``None`` if none."""
        return self._by_model.get(model, self._untagged)

    def _decode_rows(self, records: Sequence[Record]) -> list[tuple[DecodedUpdates, list[int] | None]]:
        """The scorable updates of ``records`` (no tombstones), one chunk per embedding size, each with the
        positions in ``records`` it was read from (``None``: all of them): one :func:`decode_updates` call for
        the whole batch, message by message when that fails; bad updates and those of a model without a head
        are counted and left out."""
        try:
            cols = decode_updates([r.value for r in records])
        except InvalidUpdate:
            return self._decode_each_record(records)
        dim = cols.rows.shape[1]
        kinds = set(cols.models)
        if len(kinds) == 1:
            head = self._head_of(cols.models[0])
            if head is not None and len(head.weights) == dim:
                return [(cols, None)]
        kept: list[int] = []
        for i, (r, m) in enumerate(zip(records, cols.models)):
            head = self._head_of(m)
            if head is None:
                self._count_other_model(m, r.topic)
            elif len(head.weights) != dim:
                self._skip_invalid(r, "bad_dim", f"embedding of {dim} values, the fraud head of {m} takes "
                                                 f"{len(head.weights)}")
            else:
                kept.append(i)
        return [(cols.take(kept), kept)] if kept else []

    def _decode_each_record(self, records: Sequence[Record]) -> list[tuple[DecodedUpdates, list[int]]]:
        by_dim: dict[int, tuple[list[int], list[Any]]] = {}
        for i, r in enumerate(records):
            try:
                u = decode_update(r.value)
            except InvalidUpdate as exc:
                self._skip_invalid(r, exc.reason, exc.detail)
                continue
            head = self._head_of(u.model)
            if head is None:
                self._count_other_model(u.model, r.topic)
                continue
            if len(u.embedding) != len(head.weights):
                self._skip_invalid(r, "bad_dim", f"embedding of {len(u.embedding)} values, the fraud head of "
                                                 f"{u.model} takes {len(head.weights)}")
                continue
            kept, updates = by_dim.setdefault(len(u.embedding), ([], []))
            kept.append(i)
            updates.append(u)
        return [(DecodedUpdates([u.id for u in updates], [u.version for u in updates], [u.model for u in updates],
                                [u.event_ts for u in updates],
                                np.stack([np.asarray(u.embedding, dtype=np.float32) for u in updates])), kept)
                for kept, updates in by_dim.values()]

    def _skip_invalid(self, record: Record, reason: str, detail: str) -> None:
        self.invalid += 1
        logger.warning("skipped an invalid update at %s partition %d offset %d (%s: %s); it is not scored",
                       record.topic, record.partition, record.offset, reason, detail)

    def _count_other_model(self, model: str, topic: str) -> None:
        """Count an update of a model without a head (warned once per model)."""
        self.other_model += 1
        if model not in self._other_models:
            self._other_models.add(model)
            logger.warning("skipping updates of model %s on %s: the fraud scorer has heads for %s only (train a "
                           "head for it with `gnnstream train`, or give the scorer the head of %s)", model, topic,
                           ", ".join(str(h.model) for h in self.heads), model)
