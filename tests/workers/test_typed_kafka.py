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
from tests.support import (JOIN_TIMEOUT_S, PARTITIONS, Names, health, high_watermarks, killed_after,
                           latest_updates, produce, read_topic, running_worker, stop_worker, wait_for, worker_cmd)
from tests.workers.reference import assert_embeddings_close, call_gnnstream
from tests.workers.typed_reference import typed_embeddings
from tests.workers.typed_streams import SCHEMA, typed_messages, typed_model, typed_stream

pytestmark = [pytest.mark.broker, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


HEAD_WEIGHTS = tuple(np.random.default_rng(13).normal(size=2 * 4 + 2).tolist())  # h_src, h_dst (4 each), x_e (2)
HEAD_BIAS = -0.5


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A typed model with a transaction head: the worker publishes a score per payment."""
    from gnnstream.model.head import TransactionHead
    path = typed_model(tmp_path_factory.mktemp("typed") / "model", 6, [3, 2])
    TransactionHead("account__pays__merchant", HEAD_WEIGHTS, HEAD_BIAS, "model:1").save(path)
    return str(path)


def _check_transaction_scores(bootstrap: str, topic: str, events: list[dict], final: dict[str, dict]) -> None:
    """Every payment scored at least once; a score taken at the final embeddings' versions is the head's of
    those."""
    scores: dict[str, list[dict]] = {}
    for r in read_topic(bootstrap, topic, PARTITIONS):
        scores.setdefault(r.key.decode(), []).append(json.loads(r.value))
    payments = {ev["txn_id"]: ev for ev in events if ev.get("txn_id")}
    assert set(scores) == set(payments) and len(payments) > 100
    checked = 0
    for txn, records in scores.items():
        ev = payments[txn]
        for rec in records:
            assert rec["src"] == f"account/{ev['src']}" and rec["dst"] == f"merchant/{ev['dst']}"
            assert rec["relation"] == "account__pays__merchant" and 0 < rec["score"] < 1
            src, dst = final[rec["src"]], final[rec["dst"]]
            if (rec["src_version"], rec["dst_version"]) == (src["version"], dst["version"]):
                z = np.concatenate([src["embedding"], dst["embedding"], ev["features"]]) @ np.asarray(HEAD_WEIGHTS)
                assert abs(rec["score"] - 1 / (1 + np.exp(-z - HEAD_BIAS))) < 1e-5, txn
                checked += 1
    assert checked > 0


@pytest.mark.slow
@pytest.mark.parametrize("kafka_client", KAFKA_CLIENTS)
def test_a_typed_worker_killed_mid_stream_ends_exact(kafka_client: str, broker: EmbeddedBroker, model: str,
                                                     tmp_path: Path) -> None:
    n = Names(tmp_path)
    events = typed_stream(11, 900, node_deletes=False)
    topic = f"{n.output}-txn"
    ensure_topics(broker.bootstrap, {n.events: PARTITIONS, n.output: PARTITIONS, n.dlq: 1, topic: PARTITIONS})
    messages = typed_messages(events)
    rng = random.Random(3)
    log = tmp_path / "worker.log"
    placed: list[tuple[int, int]] = []
    for _ in range(2):  # two runs, each SIGKILLed once it applied part of its input
        placed += produce(broker.bootstrap, n.events, messages[len(placed):len(placed) + 300])
        killed_after(lambda port: worker_cmd(broker.bootstrap, n, model, port, "--batch-size", "40",
                                             "--max-batch-size", "40", "--transaction-topic", topic,
                                             client=kafka_client),
                     log, rng.randint(60, 200))
    placed += produce(broker.bootstrap, n.events, messages[len(placed):])
    hw = high_watermarks(placed, n.events)
    with GraphStore(n.state) as store:
        remaining = len(events) - sum(store.offsets().values())
    with running_worker(lambda port: worker_cmd(broker.bootstrap, n, model, port, "--transaction-topic", topic,
                                                client=kafka_client),
                        log) as (proc, port):
        wait_for(lambda: (h := health(port)) and h["applied"] >= remaining, JOIN_TIMEOUT_S, "every event applied",
                 proc, log)
        summary = stop_worker(proc, log)
    assert summary["applied"] == remaining and summary["pending_marks"] == 0
    with GraphStore(n.state) as store:
        assert store.offsets() == hw
    verified = call_gnnstream("verify", "--state", n.state)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    out = call_gnnstream("embeddings", "--state", n.state, "--out", "-")
    stored = {row["id"]: row for row in map(json.loads, out.stdout.splitlines())}
    want = typed_embeddings(events, SCHEMA, model)
    assert_embeddings_close({v: r["embedding"] for v, r in stored.items()}, want, what="stored vs typed reference")
    published = latest_updates(broker.bootstrap, n.output, PARTITIONS)
    assert set(published) == set(stored) == set(want)
    for v, row in stored.items():
        assert published[v].version == row["version"]
        np.testing.assert_allclose(published[v].embedding, row["embedding"], rtol=0, atol=1e-5)
    _check_transaction_scores(broker.bootstrap, topic, events, stored)


PARTS = 6  # of the group's events and output topics


def test_three_typed_workers_publish_exactly(broker: EmbeddedBroker, model: str, tmp_path: Path,
                                             procs: list) -> None:
    """A group of three workers, each on its own state of the typed graph: the newest output of every node is
    the typed reference's, and nodes deleted at the end are withdrawn."""
    from tests.support import group_of_three, newest_mismatch, wait_for_workers
    n = Names(tmp_path)
    ensure_topics(broker.bootstrap, {n.events: PARTS, n.output: PARTS, n.dlq: 1})
    running, at = group_of_three(broker.bootstrap, n, model, tmp_path, procs, PARTS)
    events = typed_stream(12, 1200, node_deletes=False)
    produce(broker.bootstrap, n.events, typed_messages(events))
    wait_for_workers(lambda: at(len(events)), "every event applied", running, 240.0)
    gone = sorted(typed_embeddings(events, SCHEMA, model))[::9][:8]  # deleted once everything else is applied
    deletes = [{"op": "node_delete", "type": v.split("/")[0], "id": v.split("/")[1], "ts": 10_000} for v in gone]
    produce(broker.bootstrap, n.events, typed_messages(deletes))
    wait_for_workers(lambda: at(len(events) + len(deletes)), "the deletes applied", running, 240.0)
    want = typed_embeddings(events + deletes, SCHEMA, model)
    assert not set(gone) & set(want) and len(want) > 40
    wait_for_workers(lambda: newest_mismatch(broker.bootstrap, n.output, PARTS, want, set(gone)) is None,
                     "the newest output of every node to be exact", running, 240.0)
