"""A worker publishing ``--output-format packed``: the frames, tail, the scorer and the reference agree."""

from __future__ import annotations

import io
import json
import uuid
from pathlib import Path

import numpy as np
import pytest

from gnnstream.stream.backends import KAFKA_CLIENTS
from gnnstream.stream.broker import EmbeddedBroker
from gnnstream.stream.kafka import ensure_topics
from gnnstream.stream.partitioning import partition_for
from gnnstream.stream.updates import decode_packed
from tests.support import (JOIN_TIMEOUT_S, PARTITIONS, Names, event_messages, fold, health, produce, read_topic,
                           running_worker, stop_worker, wait_for, worker_cmd)
from tests.workers.reference import assert_embeddings_close, reference_embeddings

pytestmark = [pytest.mark.broker, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(params=KAFKA_CLIENTS)
def kafka_client(request: pytest.FixtureRequest) -> str:
    """The worker's (and the tail's) ``--kafka-client``: the test runs once per backend."""
    return request.param


def test_packed_output_reads_back_exact(kafka_client: str, broker: EmbeddedBroker, events: list,
                                        model_dir: str, tmp_path: Path) -> None:
    from gnnstream.fraud.scorer import FraudScorer
    from gnnstream.model.head import ScoreHead
    from gnnstream.workers.offline.jobs import export_embeddings
    from gnnstream.workers.offline.replay import tail_embeddings
    n = Names(tmp_path)
    ensure_topics(broker.bootstrap, {n.events: PARTITIONS, n.output: PARTITIONS, n.dlq: 1})
    produce(broker.bootstrap, n.events, event_messages(events))
    log = tmp_path / "worker.log"
    with running_worker(lambda port: worker_cmd(broker.bootstrap, n, model_dir, port, "--output-format", "packed",
                                                client=kafka_client), log) as (proc, port):
        wait_for(lambda: (h := health(port)) and h["applied"] >= len(events), JOIN_TIMEOUT_S,
                 f"{len(events)} applied events", proc, log)
        summary = stop_worker(proc, log)
    assert summary["applied"] == len(events)
    records = read_topic(broker.bootstrap, n.output, PARTITIONS)
    assert records, "nothing was published"
    latest: dict = {}
    rows = 0
    for r in records:
        assert r.value is not None and r.key == str(r.partition).encode()
        for u in decode_packed(r.value):
            rows += 1
            assert not u.deleted
            assert partition_for(u.id.encode(), PARTITIONS) == r.partition
            if u.id in latest:  # per node, versions never go down within its partition
                assert u.version >= latest[u.id].version, (u.id, u.version, latest[u.id].version)
            latest[u.id] = u
    assert len(records) < rows  # many updates per message
    out = tmp_path / f"emb-{uuid.uuid4().hex[:6]}.jsonl"
    with open(out, "w") as fh:
        export_embeddings(n.state, fh)
    stored = {o["id"]: o for o in map(json.loads, out.read_text().splitlines())}
    assert set(latest) == set(stored)
    for node, obj in stored.items():
        assert latest[node].version == obj["version"]
        np.testing.assert_allclose(latest[node].embedding, obj["embedding"], rtol=0, atol=1e-5, err_msg=node)
    g = fold(events)
    assert_embeddings_close({v: u.embedding for v, u in latest.items()},
                            reference_embeddings(g.nodes, g.edges, g.features, model_dir),
                            what="packed embeddings vs the PyG reference")
    text = io.StringIO()
    count = tail_embeddings(broker.bootstrap, topic=n.output, from_beginning=True, idle_s=3.0, out=text,
                            kafka_client=kafka_client)
    lines = text.getvalue().splitlines()
    assert count == rows == len(lines)
    assert {line.split()[0] for line in lines} == set(latest)
    dim = len(next(iter(latest.values())).embedding)
    head = ScoreHead(tuple(np.linspace(-1, 1, dim)), 0.1, next(iter(latest.values())).model)
    scorer = FraudScorer("unused:9092", head, in_topic=n.output)
    scores: dict = {}
    scorer._score_poll(records, lambda topic, key, value: scores.update({json.loads(value)["id"]: json.loads(value)}))
    assert scorer.scored == rows and scorer.invalid == 0
    for node, u in latest.items():
        assert scores[node]["embedding_version"] == u.version
        assert scores[node]["score"] == pytest.approx(float(head.score(np.asarray(u.embedding)[None, :])[0]), abs=1e-6)
