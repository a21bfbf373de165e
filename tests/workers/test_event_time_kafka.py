"""The streaming worker on a windowed state with the staged cold start: SIGKILLed mid-stream, restarted, and
exact at the end against the reference folded event by event.

The state is created by ``gnnstream graph load --edge-ttl`` (an empty file);
``gnnstream run`` takes the window from the state. The first 3,000 Bitcoin
OTC events span 181 days of event time: a 30-day window expires about 800 edges
on the way, and stages of two and ten days fire timers while the stream runs.
Kafka reorders events of different keys across partitions; the graph a
window leaves does not depend on that order (docs/design.md, "Event time").
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from gnnstream.stream.backends import KAFKA_CLIENTS
from gnnstream.stream.broker import EmbeddedBroker
from gnnstream.stream.kafka import ensure_topics
from tests.support import (JOIN_TIMEOUT_S, PARTITIONS, Names, event_messages, health, high_watermarks,
                           killed_after, latest_updates, produce, running_worker, stop_worker, wait_for,
                           worker_cmd)
from tests.workers.reference import GraphFold, assert_embeddings_close, call_gnnstream, fold_embeddings

pytestmark = [pytest.mark.broker, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

DAY = 86_400
TTL = 30 * DAY
STAGED = {"policy": "staged", "feature_only_s": 2 * DAY, "expand_s": 10 * DAY, "min_neighbours": 3}


@pytest.fixture(scope="module")
def staged_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from gnnstream.model import init_model_dir
    d = tmp_path_factory.mktemp("model") / "staged"
    init_model_dir(str(d), arch="sage", in_dim=8, hidden=16, out_dim=8, layers=2, fanouts=[10, 5], seed=0,
                   cold_start=STAGED)
    return str(d)


@pytest.mark.parametrize("kafka_client", KAFKA_CLIENTS)
def test_a_windowed_staged_worker_killed_mid_stream_ends_exact(kafka_client: str, broker: EmbeddedBroker,
                                                               events: list, staged_model: str,
                                                               tmp_path: Path) -> None:
    from gnnstream.graph_state.store import GraphStore
    n = Names(tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    made = call_gnnstream("graph", "load", "--state", n.state, "--model", staged_model, "--edge-ttl", TTL,
                          tmp_path / "empty.jsonl")
    assert made.returncode == 0, made.stderr
    ensure_topics(broker.bootstrap, {n.events: PARTITIONS, n.output: PARTITIONS, n.dlq: 1})
    messages = event_messages(events)
    rng = random.Random(7)
    log = tmp_path / "worker.log"
    placed: list[tuple[int, int]] = []
    for _ in range(2):  # two runs, each SIGKILLed once it applied part of its input
        placed += produce(broker.bootstrap, n.events, messages[len(placed):len(placed) + 900])
        killed_after(lambda port: worker_cmd(broker.bootstrap, n, staged_model, port, "--batch-size", "50",
                                             "--max-batch-size", "50", client=kafka_client),
                     log, rng.randint(100, 600))
    placed += produce(broker.bootstrap, n.events, messages[len(placed):])
    hw = high_watermarks(placed, n.events)
    with GraphStore(n.state) as store:
        remaining = len(events) - sum(store.offsets().values())
    with running_worker(lambda port: worker_cmd(broker.bootstrap, n, staged_model, port, client=kafka_client),
                        log) as (proc, port):
        wait_for(lambda: (h := health(port)) and h["applied"] >= remaining, JOIN_TIMEOUT_S, "every event applied",
                 proc, log)
        summary = stop_worker(proc, log)
    assert summary["applied"] == remaining and summary["pending_marks"] == 0

    fold = GraphFold(TTL)
    for ev in events:
        fold.apply_event(ev)
    with GraphStore(n.state) as store:
        assert store.offsets() == hw
        assert store.stream_time == fold.T
        assert {(s, d) for s, d, _, _ in store.edges()} == fold.edges
        assert fold.expired > 500  # the window expired many edges on the way
    verified = call_gnnstream("verify", "--state", n.state)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    out = call_gnnstream("embeddings", "--state", n.state, "--out", "-")
    stored = {row["id"]: row for row in map(json.loads, out.stdout.splitlines())}
    want = fold_embeddings(fold, staged_model)
    assert_embeddings_close({v: r["embedding"] for v, r in stored.items()}, want, what="stored vs reference")
    published = latest_updates(broker.bootstrap, n.output, PARTITIONS)
    assert set(published) == set(stored)
    for v, row in stored.items():
        assert published[v].version == row["version"] and published[v].mode == row["mode"]
        np.testing.assert_allclose(published[v].embedding, row["embedding"], rtol=0, atol=1e-5)
    assert {r["mode"] for r in stored.values()} >= {"full", "expanded"}


PARTS = 6  # of the group's events and output topics


@pytest.mark.slow
@pytest.mark.xdist_group("scale-out")  # several workers at once: one such test at a time
def test_three_windowed_staged_workers_publish_exactly(broker: EmbeddedBroker, events: list, staged_model: str,
                                                       tmp_path: Path, procs: list) -> None:
    """A group of three workers, each on its own windowed state: the newest output of every node is the
    reference's at the final stream time, and deleted nodes end on a tombstone."""
    from gnnstream.stream.events import NodeDelete
    from tests.support import group_of_three, newest_mismatch, produce_events, wait_for_workers
    n = Names(tmp_path)
    ensure_topics(broker.bootstrap, {n.events: PARTS, n.output: PARTS, n.dlq: 1})
    (tmp_path / "empty.jsonl").write_text("")

    def windowed_state(name: str) -> None:
        made = call_gnnstream("graph", "load", "--state", tmp_path / f"state-{name}", "--model", staged_model,
                              "--edge-ttl", TTL, tmp_path / "empty.jsonl")
        assert made.returncode == 0, made.stderr

    running, at = group_of_three(broker.bootstrap, n, staged_model, tmp_path, procs, PARTS, windowed_state)
    produce_events(broker.bootstrap, n.events, events)
    wait_for_workers(lambda: at(len(events)), "every event applied", running, 240.0)
    fold = GraphFold(TTL)
    for ev in events:
        fold.apply_event(ev)
    gone = sorted(fold.nodes)[::97][:12]
    deletes = [NodeDelete(v, fold.T) for v in gone]
    produce_events(broker.bootstrap, n.events, deletes)
    wait_for_workers(lambda: at(len(events) + len(deletes)), "the deletes applied", running, 240.0)
    for ev in deletes:
        fold.apply_event(ev)
    want = fold_embeddings(fold, staged_model)
    wait_for_workers(lambda: newest_mismatch(broker.bootstrap, n.output, PARTS, want, set(gone)) is None,
                     "the newest output of every node to be exact", running, 240.0)
    assert fold.expired > 500
