"""A typed graph through Kafka: the worker SIGKILLed twice mid-stream and restarted, under both clients, ends
with every stored and published embedding equal to the independent typed reference; three workers of a group
publish the same."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from gnnstream.graph_state.store import GraphStore
from gnnstream.stream.backends import KAFKA_CLIENTS
from gnnstream.stream.broker import EmbeddedBroker
from gnnstream.stream.kafka import ensure_topics
from tests.support import (JOIN_TIMEOUT_S, PARTITIONS, Names, health, high_watermarks, produce, read_topic,
                           running_worker, stop_worker, wait_for, worker_cmd)
from tests.workers.reference import assert_embeddings_close, run_gnnstream
from tests.workers.typed_reference import typed_embeddings
from tests.workers.typed_streams import SCHEMA, typed_messages, typed_model, typed_stream

pytestmark = [pytest.mark.broker, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(typed_model(tmp_path_factory.mktemp("typed") / "model", 6, [3, 2]))


def _latest(bootstrap: str, topic: str) -> dict[str, object]:
    from gnnstream.stream.updates import decode_update
    latest: dict[str, object] = {}
    for r in read_topic(bootstrap, topic, PARTITIONS):
        u = decode_update(r.value)
        if u.id not in latest or u.version > latest[u.id].version:
            latest[u.id] = u
    return latest


@pytest.mark.parametrize("kafka_client", KAFKA_CLIENTS)
def test_a_typed_worker_killed_mid_stream_ends_exact(kafka_client: str, broker: EmbeddedBroker, model: str,
                                                     tmp_path: Path) -> None:
    n = Names(tmp_path)
    events = typed_stream(11, 1500, node_deletes=False)
    ensure_topics(broker.bootstrap, {n.events: PARTITIONS, n.output: PARTITIONS, n.dlq: 1})
    messages = typed_messages(events)
    rng = random.Random(3)
    log = tmp_path / "worker.log"
    placed: list[tuple[int, int]] = []
    for _ in range(2):  # two runs, each SIGKILLed once it applied part of its input
        placed += produce(broker.bootstrap, n.events, messages[len(placed):len(placed) + 500])
        with running_worker(lambda port: worker_cmd(broker.bootstrap, n, model, port, "--batch-size", "40",
                                                    "--max-batch-size", "40", client=kafka_client),
                            log) as (proc, port):
            target = rng.randint(60, 300)
            wait_for(lambda: (h := health(port)) and h["applied"] >= target, JOIN_TIMEOUT_S,
                     f"{target} applied events", proc, log)
            proc.kill()
            proc.wait()
    placed += produce(broker.bootstrap, n.events, messages[len(placed):])
    hw = high_watermarks(placed, n.events)
    with GraphStore(n.state) as store:
        remaining = len(events) - sum(store.offsets().values())
    with running_worker(lambda port: worker_cmd(broker.bootstrap, n, model, port, client=kafka_client),
                        log) as (proc, port):
        wait_for(lambda: (h := health(port)) and h["applied"] >= remaining, JOIN_TIMEOUT_S, "every event applied",
                 proc, log)
        summary = stop_worker(proc, log)
    assert summary["applied"] == remaining and summary["pending_marks"] == 0
    with GraphStore(n.state) as store:
        assert store.offsets() == hw
    verified = run_gnnstream("verify", "--state", n.state)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    out = run_gnnstream("embeddings", "--state", n.state, "--out", "-")
    stored = {row["id"]: row for row in map(json.loads, out.stdout.splitlines())}
    want = typed_embeddings(events, SCHEMA, model)
    assert_embeddings_close({v: r["embedding"] for v, r in stored.items()}, want, what="stored vs typed reference")
    published = _latest(broker.bootstrap, n.output)
    assert set(published) == set(stored) == set(want)
    for v, row in stored.items():
        assert published[v].version == row["version"]
        np.testing.assert_allclose(published[v].embedding, row["embedding"], rtol=0, atol=1e-5)
