"""Bad starts and stops of the streaming worker (issue 19), against real embedded brokers.

* a worker started before its broker waits for it (``/healthz`` 503 with a reason), then consumes;
* a stored offset past the end of its partition (the broker was replaced by an empty one) stops the
  worker with one line, unless ``--on-offset-reset earliest|latest`` says where to resume;
* SIGTERM with deferred hub work drains it, so ``gnnstream verify`` passes at once; with no time to
  drain, the marks stay recorded and are counted;
* ``gnnstream_deferred_hub_propagations_total`` counts a deferral once, not at every loop;
* a model whose sampling seed is not 0 serves a fresh state.

"Exact" always means: the stored and the latest published embedding of every node equal an
independent PyTorch Geometric computation on the final graph (``tests/workers/reference.py``), and
the stored offsets equal the end of each partition. Graphs are small and synthetic, so the tests run
in seconds; deadlines are only safety nets, never what a test measures.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gnnstream.stream.broker import EmbeddedBroker
from gnnstream.stream.events import EdgeUpsert, NodeUpsert
from gnnstream.stream.kafka import ensure_topics
from tests.support import Names, Proc, closed_port, fold, healthz, make_model, random_graph, scrape
from tests.support import produce_events as produce
from tests.workers.reference import assert_embeddings_close, call_gnnstream, gnnstream_command, reference_embeddings

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PARTITIONS = 3
IN_DIM = 4  # of make_model and random_graph
DEADLINE_S = 120.0  # safety net for anything a test waits for


# ---------------------------------------------------------------------- workload
def star(hub: str, leaves: int, ts: float = 1.0) -> list:
    """A hub every leaf samples (each leaf's only neighbour), plus features."""
    events: list = [NodeUpsert(hub, ts, (1.0,) * IN_DIM)]
    for i in range(leaves):
        leaf = f"{hub}-leaf{i}"
        events.append(NodeUpsert(leaf, ts, tuple(float((i + j) % 5) / 4 for j in range(IN_DIM))))
        events.append(EdgeUpsert(leaf, hub, ts + i))
    return events


# ---------------------------------------------------------------------- kafka helpers
def read_all(bootstrap: str, topic: str, partitions: int) -> list:
    """Every record of ``topic``: read until each partition's position reaches its high watermark."""
    from kafka import KafkaConsumer, TopicPartition
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None,
                             auto_offset_reset="earliest", client_id="test-reader")
    tps = [TopicPartition(topic, p) for p in range(partitions)]
    consumer.assign(tps)
    consumer.seek_to_beginning(*tps)
    out = []
    deadline = time.monotonic() + DEADLINE_S
    try:
        while True:
            for msgs in consumer.poll(timeout_ms=300, max_records=5000).values():
                out.extend(msgs)
            ends = [consumer.highwater(tp) for tp in tps]
            if all(e is not None for e in ends) and all(consumer.position(tp) >= e for tp, e in zip(tps, ends)):
                return out
            if time.monotonic() > deadline:
                pytest.fail(f"could not read {topic} to its end: high watermarks {ends}")
    finally:
        consumer.close()


def latest_published(bootstrap: str, topic: str) -> dict[str, Any]:
    from gnnstream.stream.updates import decode_update
    latest: dict[str, Any] = {}
    for r in read_all(bootstrap, topic, PARTITIONS):
        assert r.value is not None, f"unexpected tombstone for {r.key!r}"
        u = decode_update(r.value)
        if u.id not in latest or u.version > latest[u.id].version:
            latest[u.id] = u
    return latest


# ---------------------------------------------------------------------- exactness
def stored_embeddings(state: str) -> dict[str, dict[str, Any]]:
    import io
    from gnnstream.workers.offline.jobs import export_embeddings
    buf = io.StringIO()
    export_embeddings(state, buf)
    return {obj["id"]: obj for obj in map(json.loads, buf.getvalue().splitlines())}


def assert_exact(state: str, model_dir: str, events: list, ends: dict[tuple[str, int], int],
                 published: dict[str, Any] | None, published_nodes: set[str] | None = None) -> None:
    """Stored (and published) embeddings equal the PyG reference of the final graph of ``events``.

    Args:
        published: the latest published update per node on the broker, or None to skip that check.
        published_nodes: the nodes that must have been published there (default: every node).
    """
    from gnnstream.graph_state.store import GraphStore
    g = fold(events)
    want = reference_embeddings(g.nodes, g.edges, g.features, model_dir)
    with GraphStore(state) as store:
        assert store.offsets() == ends, "stored offsets differ from the ends of the partitions"
        assert set(store.nodes()) == g.nodes
    stored = stored_embeddings(state)
    assert_embeddings_close({v: obj["embedding"] for v, obj in stored.items()}, want, what="stored embeddings")
    if published is None:
        return
    nodes = g.nodes if published_nodes is None else published_nodes
    assert set(published) == nodes, (f"unpublished: {sorted(nodes - set(published))[:10]}, "
                                     f"unexpected: {sorted(set(published) - nodes)[:10]}")
    assert_embeddings_close({v: u.embedding for v, u in published.items()}, {v: want[v] for v in nodes},
                            what="published embeddings")
    for v, u in published.items():
        assert u.version == stored[v]["version"], (v, u.version, stored[v]["version"])


# ---------------------------------------------------------------------- worker helpers
def worker_cmd(bootstrap: str, n: Names, model: str, metrics_port: int, *extra: str) -> list[str]:
    return gnnstream_command("run", "--bootstrap", bootstrap, "--state", n.state, "--model", model,
                             "--events-topic", n.events, "--output-topic", n.output, "--dlq-topic", n.dlq,
                             "--group", n.group, "--partitions", PARTITIONS, "--metrics-port", metrics_port,
                             "--batch-size", "100", *extra)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GNNSTREAM_")}
    env["GNNSTREAM_NO_PROGRESS"] = "1"
    return env


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, flags=re.M)
    assert m, f"{name}{labels} not in /metrics"
    return float(m.group(1))


def run_in_thread(worker: Any, max_idle_s: float | None = None) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["summary"] = worker.run(max_idle_s=max_idle_s)
        except BaseException as exc:  # reported by the test
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result


def settings(bootstrap: str, n: Names, model: str, **extra: Any) -> Any:
    from gnnstream.workers.settings import WorkerSettings
    values: dict[str, Any] = dict(bootstrap=bootstrap, state=n.state, model=model, events_topic=n.events,
                                  output_topic=n.output, dlq_topic=n.dlq, group=n.group, partitions=PARTITIONS,
                                  batch_size=100, metrics_port=0)
    values.update(extra)
    return WorkerSettings(**values)


def run_until_idle(bootstrap: str, n: Names, model: str, idle_s: float = 3.0, **extra: Any) -> dict[str, Any]:
    """Run a worker in this process until it has been idle for ``idle_s`` with everything done."""
    from gnnstream.workers.runtime.worker import Worker
    return Worker(settings(bootstrap, n, model, **extra)).run(max_idle_s=idle_s)


# ---------------------------------------------------------------------- (a) broker down at start
@pytest.mark.broker
def test_worker_started_before_its_broker(tmp_path: Path, procs: list[Proc]) -> None:
    model = make_model(tmp_path / "model")
    n = Names(tmp_path)
    events = random_graph("n", nodes=60, edges=150, seed=1)
    with closed_port() as port:  # refuses the worker's connections, and is nobody else's, until the broker starts
        bootstrap = f"127.0.0.1:{port}"
        worker, (metrics_port,) = Proc.on_ports(lambda mp: worker_cmd(bootstrap, n, model, mp), tmp_path / "worker.log")
        procs.append(worker)
        status, h = worker.wait_for(lambda: (r := healthz(metrics_port)) and r[1]["status"] == "waiting_for_kafka"
                                    and r, "/healthz to say it waits for Kafka")
        assert status == 503 and h["ok"] is False
        assert h["reason"] == f"waiting for Kafka at {bootstrap}"
        # at least 10 s and a few attempts without a broker (the worker gave up at 30 s and never
        # picked up a broker started 12 s in)
        status, h = worker.wait_for(lambda: (r := healthz(metrics_port)) and r[1]["kafka_attempts"] >= 3
                                    and r[1]["uptime_s"] >= 10 and r, "10 s of attempts to reach Kafka")
        assert status == 503 and h["reason"] == f"waiting for Kafka at {bootstrap}"
        assert bootstrap in h["last_error"]
        assert metric(scrape(metrics_port), "gnnstream_errors_total", '{kind="kafka_setup"}') >= 3
        assert worker.proc.poll() is None

    with EmbeddedBroker(port) as broker:
        ensure_topics(broker.bootstrap, n.topics(PARTITIONS))  # the worker may create them first: both are fine
        ends = produce(broker.bootstrap, n.events, events)
        status, h = worker.wait_for(lambda: (r := healthz(metrics_port)) and r[1]["applied"] >= len(events) and r,
                                    "every event applied")
        assert status == 200 and h["ok"] is True and h["status"] == "consuming" and h["reason"] is None
        assert h["last_error"] is None, "the error cleared once Kafka was there"
        summary = worker.sigterm()
        assert summary["applied"] == len(events) and summary["invalid"] == 0
        assert_exact(n.state, model, events, ends, latest_published(broker.bootstrap, n.output))


def test_broker_wait_bound_is_one_line(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model")
    n = Names(tmp_path)
    with closed_port() as port:
        result = subprocess.run(worker_cmd(f"127.0.0.1:{port}", n, model, 0, "--broker-wait-s", "1"),
                                capture_output=True, text=True, env=_env(), timeout=DEADLINE_S)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("gnnstream: error:")]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0] and "--broker-wait-s" in errors[0], result.stderr
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------------- (b) topic reset
@pytest.mark.broker
def test_offset_reset(tmp_path: Path) -> None:
    from gnnstream.graph_state.store import GraphStore
    from gnnstream.workers.runtime.offsets import OffsetResetError
    from gnnstream.workers.runtime.worker import Worker
    model = make_model(tmp_path / "model")
    n = Names(tmp_path)
    first = random_graph("a", nodes=80, edges=240, seed=2)
    with EmbeddedBroker() as a:
        ensure_topics(a.bootstrap, n.topics(PARTITIONS))
        ends_a = produce(a.bootstrap, n.events, first)
        assert run_until_idle(a.bootstrap, n, model)["applied"] == len(first)
        # its last progress record says it stopped: `rollout status` does not count it as consuming
        from gnnstream.workers.rollout.topic import read_rollout
        reports = [r for r in read_rollout(a.bootstrap) if r.get("kind") == "worker"]
        assert reports and {r["status"] for r in reports[:-1]} <= {"consuming"}, reports
        assert reports[-1]["status"] == "stopped" and reports[-1]["applied"] == len(first), reports[-1]
    assert len(ends_a) == PARTITIONS

    # the broker is replaced by an empty one, which gets a few new events
    second = random_graph("b", nodes=12, edges=30, seed=3, ts=1000.0)
    with EmbeddedBroker() as b:
        ensure_topics(b.bootstrap, n.topics(PARTITIONS))
        ends_b = produce(b.bootstrap, n.events, second)
        assert len(ends_b) == PARTITIONS and all(ends_b[tp] < ends_a[tp] for tp in ends_a), (ends_a, ends_b)

        # default: refuse, name the partition and both offsets, count it, apply nothing
        worker = Worker(settings(b.bootstrap, n, model))
        with pytest.raises(OffsetResetError) as info:
            worker.run()
        message = str(info.value)
        (topic, partition), (stored, end) = min(info.value.partitions.items())
        assert stored == ends_a[(topic, partition)] and end == ends_b[(topic, partition)]
        for part in (repr(n.events), f"partition {partition}", f"stored offset {stored}", f"end offset {end}",
                     "--on-offset-reset"):
            assert part in message, (part, message)
        assert metric(worker.metrics.render().decode(), "gnnstream_errors_total", '{kind="offset_reset"}') >= 1
        assert worker.health.applied == 0
        with GraphStore(n.state) as store:
            assert store.offsets() == ends_a

        # the command line: one line, non-zero exit
        result = subprocess.run(worker_cmd(b.bootstrap, n, model, 0), capture_output=True, text=True, env=_env(),
                                timeout=DEADLINE_S)
        assert result.returncode != 0, result.stderr
        lines = [line for line in result.stderr.splitlines() if "stored offset" in line]
        assert len(lines) == 1 and lines[0].startswith("gnnstream: error:"), result.stderr
        assert "Traceback" not in result.stderr, result.stderr

        # --on-offset-reset earliest: read the new partitions from their start
        summary = run_until_idle(b.bootstrap, n, model, on_offset_reset="earliest")
        assert summary["applied"] == len(second)
        changed = {x for ev in second for x in ((ev.src, ev.dst) if isinstance(ev, EdgeUpsert) else (ev.id,))}
        published = latest_published(b.bootstrap, n.output)
        assert changed <= set(published)
        assert_exact(n.state, model, first + second, ends_b, published, published_nodes=set(published))

    # --on-offset-reset latest: skip what the next replacement holds, read what comes after
    third, fourth = random_graph("c", 3, 2, seed=4, ts=2000.0), random_graph("d", 8, 10, seed=5, ts=3000.0)
    with EmbeddedBroker() as c:
        ensure_topics(c.bootstrap, n.topics(PARTITIONS))
        ends_c = produce(c.bootstrap, n.events, third)
        ends_c = {(n.events, p): ends_c.get((n.events, p), 0) for p in range(PARTITIONS)}
        assert all(ends_c[tp] < ends_b[tp] for tp in ends_b), (ends_b, ends_c)
        assert run_until_idle(c.bootstrap, n, model, on_offset_reset="latest")["applied"] == 0
        with GraphStore(n.state) as store:
            assert store.offsets() == ends_c
        ends_d = produce(c.bootstrap, n.events, fourth)
        assert run_until_idle(c.bootstrap, n, model)["applied"] == len(fourth)
        ends = {tp: ends_d.get(tp, ends_c[tp]) for tp in ends_c}
        assert_exact(n.state, model, first + second + fourth, ends, None)


# ---------------------------------------------------------------------- (c), (d) SIGTERM with deferred hub work
@pytest.mark.broker
def test_sigterm_drains_deferred_hubs(broker: EmbeddedBroker, tmp_path: Path, procs: list[Proc]) -> None:
    model = make_model(tmp_path / "model")
    n = Names(tmp_path)
    ensure_topics(broker.bootstrap, n.topics(PARTITIONS))
    worker, (metrics_port,) = Proc.on_ports(lambda mp: worker_cmd(broker.bootstrap, n, model, mp, "--hub-bound", "3",
                                                                  "--max-staleness-s", "3600", "--drain-timeout-s",
                                                                  "60"), tmp_path / "worker.log")
    procs.append(worker)
    events = star("h", leaves=20) + random_graph("r", nodes=30, edges=60, seed=6)
    ends = produce(broker.bootstrap, n.events, events)
    worker.wait_for(lambda: (r := healthz(metrics_port)) and r[1]["applied"] >= len(events), "the first events")
    more = [NodeUpsert("h", 50.0, (0.5, -0.25, 2.0, 1.5))]  # the hub moves: 20 dependents > --hub-bound 3
    ends.update(produce(broker.bootstrap, n.events, more))
    events += more
    worker.wait_for(lambda: (r := healthz(metrics_port)) and r[1]["applied"] >= len(events), "the hub update")
    text = worker.wait_for(lambda: (t := scrape(metrics_port)) and metric(t, "gnnstream_deferred_hubs") > 0 and t,
                           "deferred hub work")
    deferred_total = metric(text, "gnnstream_deferred_hub_propagations_total")
    assert deferred_total >= 1
    # the loop keeps recomputing while the deferral waits: the counter must not grow with it
    polls = healthz(metrics_port)[1]["polls"]
    worker.wait_for(lambda: healthz(metrics_port)[1]["polls"] >= polls + 10, "ten more polls")
    text = scrape(metrics_port)
    assert metric(text, "gnnstream_deferred_hubs") > 0, "the deferral must still be pending for this check"
    assert metric(text, "gnnstream_deferred_hub_propagations_total") == deferred_total

    summary = worker.sigterm()
    assert summary["pending_marks"] == 0
    result = call_gnnstream("verify", "--state", n.state)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["pending_dirty"] == 0
    assert_exact(n.state, model, events, ends, latest_published(broker.bootstrap, n.output))


@pytest.mark.broker
def test_stop_without_time_to_drain_keeps_marks(broker: EmbeddedBroker, tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    from gnnstream.graph_state.store import GraphStore
    from gnnstream.workers.offline.jobs import verify
    from gnnstream.workers.runtime.worker import Worker
    model = make_model(tmp_path / "model")
    n = Names(tmp_path)
    ensure_topics(broker.bootstrap, n.topics(PARTITIONS))
    events = star("h", leaves=12)
    produce(broker.bootstrap, n.events, events)
    worker = Worker(settings(broker.bootstrap, n, model, hub_bound=3, max_staleness_s=3600, drain_timeout_s=0))
    thread, result = run_in_thread(worker)
    deadline = time.monotonic() + DEADLINE_S
    while not (worker.health.applied >= len(events) and worker.engine is not None and worker.engine.pending()):
        assert "error" not in result and time.monotonic() < deadline, result.get("error")
        time.sleep(0.1)
    more = [NodeUpsert("h", 50.0, (0.5, -0.25, 2.0, 1.5))]
    produce(broker.bootstrap, n.events, more)
    while worker.health.applied < len(events) + 1:
        assert "error" not in result and time.monotonic() < deadline, result.get("error")
        time.sleep(0.1)
    with caplog.at_level("WARNING", logger="gnnstream.workers.runtime.worker"):
        worker.stop()
        thread.join(DEADLINE_S)
    assert not thread.is_alive() and "error" not in result, result.get("error")
    left = result["summary"]["pending_marks"]
    assert left > 0
    assert any(f"{left} dirty marks pending" in r.getMessage() for r in caplog.records), caplog.text
    with GraphStore(n.state) as store:
        assert store.dirty_count() == left, "the marks left must be recorded in the state"
    report = verify(n.state)
    assert report["ok"] is False and report["pending_dirty"] == left


# ---------------------------------------------------------------------- (e) a model with seed 7
@pytest.mark.broker
def test_seed7_model_on_fresh_state(broker: EmbeddedBroker, tmp_path: Path) -> None:
    from gnnstream.graph_state.store import GraphStore
    model = str(tmp_path / "m7")
    init = call_gnnstream("model", "init", model, "--in-dim", IN_DIM, "--hidden", 8, "--out-dim", 6, "--fanouts", "4,3",
                          "--seed", 7)
    assert init.returncode == 0, init.stderr
    n = Names(tmp_path)
    ensure_topics(broker.bootstrap, n.topics(PARTITIONS))
    events = random_graph("s", nodes=40, edges=120, seed=7)
    ends = produce(broker.bootstrap, n.events, events)
    result = subprocess.run(worker_cmd(broker.bootstrap, n, model, 0, "--exit-when-idle", "3"),
                            capture_output=True, text=True, env=_env(), timeout=DEADLINE_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["applied"] == len(events)
    with GraphStore(n.state) as store:
        assert store.seed == 7
    # the reference samples with the model's seed (7): a state fixed at seed 0 would differ
    assert_exact(n.state, model, events, ends, latest_published(broker.bootstrap, n.output))
