"""The fraud scorer: embeddings in, fraud scores out.

Consumes ``node-embeddings``, applies the logistic head trained by
``gnnstream train`` and publishes one score per update to ``fraud-scores``
(key = node id)::

    {"id":"a1","score":0.91,"embedding_version":7,"model":"otc-sage:1","event_ts":1700000000,"scored_at":1700000002.5}

A deleted node's tombstone is passed on as a tombstone. Delivery is at least
once, like the embeddings it scores.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import numpy as np

from stream.kafka import EventConsumer, Producer, ensure_topics
from stream.updates import decode_update
from workers.train import FraudHead, load_head

__all__ = ["FraudScorer", "encode_score"]

logger = logging.getLogger(__name__)


def encode_score(node: str, score: float, version: int, model: str, event_ts: float) -> bytes:
    return json.dumps({"id": node, "score": round(float(score), 6), "embedding_version": version,
                       "model": model, "event_ts": event_ts, "scored_at": time.time()},
                      separators=(",", ":")).encode()


class FraudScorer:
    """Scores every embedding update it reads.

    Args:
        bootstrap: Kafka bootstrap servers.
        head: the logistic head (see :func:`workers.train.load_head`).
        in_topic / out_topic: embeddings in, scores out.
        group: consumer group id.
    """

    def __init__(self, bootstrap: str, head: FraudHead | str, *, in_topic: str = "node-embeddings",
                 out_topic: str = "fraud-scores", group: str = "gnnstream-fraud-scorer", partitions: int = 4):
        self.bootstrap = bootstrap
        self.head = head if isinstance(head, FraudHead) else load_head(head)
        self.in_topic, self.out_topic, self.group = in_topic, out_topic, group
        self.partitions = partitions
        self.scored = 0
        self.deleted = 0
        self._stop = threading.Event()

    def stop(self, *_: Any) -> None:
        self._stop.set()

    def run(self, max_idle_s: float | None = None) -> dict[str, int]:
        ensure_topics(self.bootstrap, {self.in_topic: self.partitions, self.out_topic: self.partitions})
        consumer = EventConsumer(self.bootstrap, self.in_topic, self.group)
        producer = Producer(self.bootstrap)
        idle_since = time.monotonic()
        try:
            while not self._stop.is_set():
                records = consumer.poll_batch(2000, 0.5)
                if records or not consumer.assignment():
                    idle_since = time.monotonic()
                elif max_idle_s is not None and time.monotonic() - idle_since > max_idle_s:
                    break
                updates, keys = [], []
                for r in records:
                    if r.value is None:
                        producer.send(self.out_topic, r.key, None)
                        self.deleted += 1
                    else:
                        updates.append(decode_update(r.value))
                if updates:
                    scores = self.head.score(np.stack([np.asarray(u.embedding, dtype=np.float32) for u in updates]))
                    for u, s in zip(updates, scores):
                        producer.send(self.out_topic, u.id.encode(), encode_score(u.id, s, u.version, u.model, u.event_ts))
                    self.scored += len(updates)
                if records:
                    producer.flush(30.0)
                    consumer.commit()
        finally:
            consumer.close()
            producer.close()
        return {"scored": self.scored, "deleted": self.deleted}
