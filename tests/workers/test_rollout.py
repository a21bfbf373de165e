"""Model rollout under a continuous stream: v2 beside v1, promote, roll back, promote, retire.

A v1 worker streams Bitcoin OTC while ``gnnstream rollout start`` prepares v2
(other weights) from a copy of v1's live state; a v2 worker catches up and
publishes to its own topic; ``promote``, ``rollback`` and ``promote`` switch
the serving version in the stream while a scorer with both heads runs, and
each worker is SIGKILLed and restarted on the way. At the end both topics are
checked against the independent PyG reference with each version's weights and
cold-start policy (v2 stages new users by age, v1 does not), and the scorer's
output against the serving header of every message. Waits
end on progress (positions, messages), never on a clock.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gnnstream.stream.broker import EmbeddedBroker
from gnnstream.stream.kafka import ensure_topics
from gnnstream.stream.rollout import SERVING_HEADER, Marker, encode_marker, is_serving, version_topic
from gnnstream.stream.updates import decode_update
from tests.support import Proc, expected, healthz, otc_stream, wait_for_workers
from tests.workers.reference import ATOL, GraphFold, call_gnnstream, fold_embeddings, gnnstream_command

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.xdist_group("scale-out")]  # several workers at once: one such test at a time

DEADLINE_S = 300.0
PARTS = 6  # of the events and output topics
RATE = 40  # events per feeder step (a step every 0.05 s: a continuous stream, paced by the feeder only)


# ---------------------------------------------------------------------- models
STAGED = {"policy": "staged", "feature_only_s": 86_400, "expand_s": 7 * 86_400, "min_neighbours": 3}


def make_models(tmp_path: Path, name: str) -> tuple[str, str]:
    """v1 and v2 of one model: same sampling seed, other weights, v2 with the staged cold-start policy; each
    with a fraud head."""
    from gnnstream.model import init_model_dir
    from gnnstream.model.directory import load_model_dir, save_model_dir
    v1, v2, other = tmp_path / "v1", tmp_path / "v2", tmp_path / "other-weights"
    args = dict(arch="sage", in_dim=8, hidden=16, out_dim=8, layers=2, fanouts=[10, 5], name=name)
    init_model_dir(str(v1), seed=0, **args)
    init_model_dir(str(other), seed=1, **args)
    loaded = load_model_dir(other)
    save_model_dir(v2, replace(loaded.config, seed=0, version=2, weights_sha256=None, cold_start=STAGED),
                   loaded.model.state_dict())
    rng = np.random.default_rng(3)
    for path, model in ((v1, f"{name}:1"), (v2, f"{name}:2")):
        head = {"weights": rng.normal(size=8).round(4).tolist(), "bias": 0.1, "model": model}
        (path / "head.json").write_text(json.dumps(head))
    return str(v1), str(v2)


# ---------------------------------------------------------------------- the stream
class Feeder:
    """Produces events in order, RATE at a time, on a thread, up to the count :meth:`allow` last raised it to."""

    def __init__(self, bootstrap: str, topic: str, events: list):
        from kafka import KafkaProducer
        from gnnstream.stream.events import encode_event, event_key
        self.producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5, client_id="feeder")
        self.topic, self.events, self.sent, self.cap = topic, events, 0, 0
        self._encode, self._key = encode_event, event_key
        self._stop = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self._stop:
            chunk = self.events[self.sent:min(self.sent + RATE, self.cap)]
            if not chunk:
                time.sleep(0.05)
                continue
            for ev in chunk:
                self.producer.send(self.topic, key=self._key(ev), value=self._encode(ev))
            self.producer.flush(60)
            self.sent += len(chunk)
            time.sleep(0.05)

    def allow(self, count: int) -> None:
        """Go on producing until ``count`` events in all were produced."""
        assert count <= len(self.events)
        self.cap = count

    def done(self) -> bool:
        return self.sent >= self.cap

    def close(self) -> None:
        self._stop = True
        self.thread.join(5)
        self.producer.close(5)


def ends(bootstrap: str, topic: str) -> dict[int, int]:
    """The high watermark of every partition of ``topic`` (read from fetches, not ListOffsets)."""
    from kafka import KafkaConsumer, TopicPartition
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None,
                             client_id="test-ends")
    tps = [TopicPartition(topic, p) for p in range(PARTS)]
    consumer.assign(tps)
    consumer.seek_to_beginning(*tps)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            consumer.poll(timeout_ms=200, max_records=1)
            marks = [consumer.highwater(tp) for tp in tps]
            if all(m is not None for m in marks):
                return dict(enumerate(marks))
        pytest.fail(f"no high watermarks for {topic}")
    finally:
        consumer.close()


class Topic:
    """Every message of a topic so far, read incrementally from the start."""

    def __init__(self, bootstrap: str, topic: str, partitions: int = PARTS):
        from kafka import KafkaConsumer, TopicPartition
        self.consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None,
                                      auto_offset_reset="earliest", client_id="test-topic")
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        self.consumer.assign(tps)
        self.consumer.seek_to_beginning(*tps)
        self.records: list = []

    def poll(self) -> list:
        for msgs in self.consumer.poll(timeout_ms=200, max_records=50_000).values():
            self.records.extend(msgs)
        return self.records

    def close(self) -> None:
        self.consumer.close()


# ---------------------------------------------------------------------- processes
class Rollout:
    def __init__(self, bootstrap: str, tmp_path: Path, procs: list[Proc], names: dict[str, str]):
        self.bootstrap, self.tmp_path, self.procs, self.n = bootstrap, tmp_path, procs, names
        self.workers: dict[str, tuple[Proc, int]] = {}

    def kafka(self) -> list[Any]:
        return ["--bootstrap", self.bootstrap, "--control-topic", self.n["control"]]

    def run(self, name: str, state: str, model: str) -> None:
        proc, (port,) = Proc.on_ports(
            lambda port: gnnstream_command("run", *self.kafka(), "--state", state, "--model", model, "--events-topic",
                                           self.n["events"], "--dlq-topic", self.n["dlq"], "--group", self.n["group"],
                                           "--worker-id", name, "--partitions", PARTS, "--metrics-port", port,
                                           "--batch-size", "200"),
            self.tmp_path / f"{name}.log")
        self.procs.append(proc)
        self.workers[name] = (proc, port)

    def health(self, name: str) -> dict[str, Any]:
        proc, port = self.workers[name]
        got = healthz(port)
        if proc.proc.poll() is not None:
            pytest.fail(f"worker {name} exited with {proc.proc.returncode}:\n{proc.tail()}")
        return got[1] if got else {}

    def kill(self, name: str) -> None:
        proc, _ = self.workers.pop(name)
        proc.proc.send_signal(signal.SIGKILL)
        proc.proc.communicate()

    def command(self, *argv: Any, ok: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(gnnstream_command(*argv), capture_output=True, text=True, timeout=DEADLINE_S)
        if ok:
            assert done.returncode == 0, f"{argv}: exit {done.returncode}\n{done.stderr[-3000:]}"
        return done

    def marker(self, step: str, *argv: Any) -> dict[str, Any]:
        done = self.command("rollout", step, *argv, *self.kafka(), "--events-topic", self.n["events"])
        return json.loads(done.stdout)

    def wait(self, cond: Any, what: str) -> Any:
        return wait_for_workers(cond, what, {name: proc for name, (proc, _) in self.workers.items()}, DEADLINE_S)

    def caught_up(self, *names: str) -> None:
        """Every named worker has read the events topic to its current end (markers included)."""
        total = sum(ends(self.bootstrap, self.n["events"]).values())
        self.wait(lambda: all(self.health(n).get("position", -1) >= total for n in names),
                  f"{names} at position {total}")


def repeat_marker(bootstrap: str, topic: str, marker: Marker) -> None:
    from kafka import KafkaProducer
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", client_id="test-marker")
    key, value, headers = encode_marker(marker)
    for p in range(PARTS):
        producer.send(topic, key=key, value=value, headers=headers, partition=p)
    producer.flush(30)
    producer.close(5)


def newest(records: list) -> dict[str, Any]:
    """The newest update of each node (highest version)."""
    best: dict[str, Any] = {}
    for r in records:
        if r.value is None:
            continue
        u = decode_update(r.value)
        if u.id not in best or u.version > best[u.id].version:
            best[u.id] = u
    return best


def mismatch(records: list, want: dict[str, np.ndarray]) -> str | None:
    got = newest(records)
    for v, emb in want.items():
        if v not in got:
            return f"nothing published for {v}"
        diff = np.abs(np.asarray(got[v].embedding, dtype=np.float64) - emb).max()
        if diff > ATOL:
            return f"{v}: newest version differs by {diff:.3g}"
    return None


def serving_of(r: Any) -> str:
    return dict(r.headers)[SERVING_HEADER].decode()


# ---------------------------------------------------------------------- the test
@pytest.mark.broker
@pytest.mark.slow  # 14,000 Bitcoin OTC events through Kafka
def test_rollout_promote_rollback_retire_under_stream(broker: EmbeddedBroker, tmp_path: Path,
                                                      procs: list[Proc]) -> None:
    tag = uuid.uuid4().hex[:8]
    name = f"roll-{tag}"
    m1, m2 = f"{name}:1", f"{name}:2"
    n = {"events": f"ev-{tag}", "dlq": f"dlq-{tag}", "control": f"ctl-{tag}", "group": f"g-{tag}",
         "scores": f"sc-{tag}"}
    bootstrap = broker.bootstrap
    ensure_topics(bootstrap, {n["events"]: PARTS, n["dlq"]: 1, n["control"]: 1})
    v1, v2 = make_models(tmp_path, name)
    events = otc_stream(tmp_path)[0][:14_000]
    ro = Rollout(bootstrap, tmp_path, procs, n)
    s1, s2 = str(tmp_path / "state-v1"), str(tmp_path / "state-v2")
    feeder = Feeder(bootstrap, n["events"], events)
    out1, out2, scores = (Topic(bootstrap, version_topic(m1)), Topic(bootstrap, version_topic(m2)),
                          Topic(bootstrap, n["scores"]))
    scorer = Proc(gnnstream_command("score", "--bootstrap", bootstrap, "--model", v1, "--model", v2,
                                    "--scores-topic", n["scores"], "--scorer-group", f"scorer-{tag}",
                                    "--canary", "0.25"), tmp_path / "scorer.log")
    procs.append(scorer)
    try:
        # v1 serves, the stream flows
        ro.run("v1", s1, v1)
        feeder.allow(3000)
        ro.wait(lambda: ro.health("v1").get("position", 0) >= 3000, "v1 to apply 3000 events")
        feeder.allow(6000)

        # 1. v2 is prepared from v1's live state while v1 goes on publishing
        before = len(out1.poll())
        t0 = time.time()
        started = ro.command("rollout", "start", "--from", s1, "--state", s2, "--model", v2, *ro.kafka())
        t1 = time.time()
        prepared = json.loads(started.stdout)
        assert prepared["model"] == m2 and prepared["from"] == m1 and prepared["serving"] == m1, prepared
        during = [r for r in out1.poll()[before:] if t0 * 1000 <= r.timestamp <= t1 * 1000]
        assert during, "v1 published nothing while v2 was prepared"
        report = ro.wait(lambda: [r for r in status(ro)["versions"].get(m1, {}).get("workers", {}).values()
                                  if r["at"] > t1 and r["latency_batches"]], "a report of v1 after the backfill")[0]
        print(f"v2 prepared in {t1 - t0:.1f} s ({prepared['seconds']} s by its own count); v1 meanwhile published "
              f"{len(during)} updates; v1 freshness (publish - produce) over the last minute: p50 "
              f"{report['latency_p50_s']} s, p99 {report['latency_p99_s']} s ({report['latency_batches']} batches)")

        # 2. v2 catches up (killed on the way, restarted), publishing both versions
        ro.run("v2", s2, v2)
        feeder.allow(8000)  # each step below comes with more events, produced while it takes effect
        ro.wait(lambda: ro.health("v2").get("applied", 0) > 300, "v2 to apply 300 events")
        ro.kill("v2")
        ro.run("v2", s2, v2)
        ro.wait(lambda: ro.health("v2").get("status") == "consuming", "v2 to consume again")
        ro.wait(feeder.done, "the feeder to produce 8000 events")
        feeder.allow(10_000)

        # 3. promote v2; kill v1 and restart it; roll back; promote again
        refused = ro.command("rollout", "retire", m1, *ro.kafka(), "--events-topic", n["events"], ok=False)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "serving version" in refused.stderr
        marker = ro.marker("promote", m2)
        assert (marker["rollout"], marker["serving"], marker["previous"]) == (1, m2, m1), marker
        ro.wait(lambda: feeder.sent >= 9000, "the feeder to produce 1000 events after the promote")
        ro.kill("v1")
        ro.run("v1", s1, v1)
        ro.wait(lambda: ro.health("v1").get("status") == "consuming", "v1 to consume again")
        ro.wait(feeder.done, "the feeder to produce 10000 events")
        feeder.allow(12_000)
        marker = ro.marker("rollback")
        assert (marker["rollout"], marker["serving"]) == (2, m1), marker
        ro.wait(feeder.done, "the feeder to produce 12000 events")
        feeder.allow(14_000)
        marker = ro.marker("promote", m2)
        assert (marker["rollout"], marker["serving"]) == (3, m2), marker
        repeat_marker(bootstrap, n["events"], Marker(3, m2, at=marker["at"]))  # the same marker again: passed over
        ro.wait(feeder.done, "the feeder to produce 14000 events")
        refused = ro.command("rollout", "retire", m2, *ro.kafka(), "--events-topic", n["events"], ok=False)
        assert refused.returncode == 2 and "serving version" in refused.stderr, refused.stderr

        # the stream ends: both versions exact with their own weights
        produced = feeder.sent
        ro.caught_up("v1", "v2")
        want1, _ = expected(events[:produced], [], v1)
        fold = GraphFold()
        for ev in events[:produced]:
            fold.apply_event(ev)
        want2 = fold_embeddings(fold, v2)  # ages at the stream's time
        assert any(age < STAGED["expand_s"] for age in fold.ages().values()), "no node young enough to stage"
        assert any(np.abs(want1[v] - want2[v]).max() > ATOL for v in want1), "the policies give the same embeddings"
        ro.wait(lambda: mismatch(out1.poll(), want1) is None, "v1's newest output to be exact")
        ro.wait(lambda: mismatch(out2.poll(), want2) is None, "v2's newest output to be exact")
        print(f"{produced} events: {len(out1.records)} v1 updates, {len(out2.records)} v2 updates, both exact")

        # the scorer scored every serving message once, and nothing else
        serving = {(r.key.decode(), m, decode_update(r.value).version)
                   for m, out in ((m1, out1), (m2, out2)) for r in out.records
                   if r.value is not None and is_serving(m, r.headers)}
        others = {(r.key.decode(), m, decode_update(r.value).version)
                  for m, out in ((m1, out1), (m2, out2)) for r in out.records
                  if r.value is not None and not is_serving(m, r.headers)}

        def scored() -> list[dict[str, Any]]:
            return [json.loads(r.value) for r in scores.poll() if r.value is not None]
        ro.wait(lambda: {(s["id"], s["model"], s["embedding_version"]) for s in scored()} >= serving,
                "a score for every serving update")
        got = [(s["id"], s["model"], s["embedding_version"]) for s in scored()]
        assert set(got) == serving and not (set(got) & others)
        table: dict[tuple[str, str], int] = {}
        for m, out in ((m1, out1), (m2, out2)):
            for r in out.records:
                if r.value is not None:
                    key = (m, serving_of(r))
                    table[key] = table.get(key, 0) + 1
        print("updates by (model, serving when computed):", table, f"; scores: {len(got)} "
              f"({len(set(got))} distinct)")
        assert table.get((m2, m2), 0) and table.get((m1, m1), 0) and table.get((m1, m2), 0) \
            and table.get((m2, m1), 0)

        # 4. retire v1: its worker stops at the marker, exit 0
        marker = ro.marker("retire", m1)
        assert (marker["rollout"], marker["serving"], marker["retire"]) == (4, m2, m1), marker
        proc, _ = ro.workers.pop("v1")
        out, _ = proc.proc.communicate(timeout=DEADLINE_S)
        assert proc.proc.returncode == 0 and json.loads(out)["status"] == "retired", proc.tail()
        view = status(ro)
        assert view["serving"] == m2 and view["versions"][m1]["retired"] == 4, view
    finally:
        feeder.close()
        for t in (out1, out2, scores):
            t.close()


def status(ro: Rollout) -> dict[str, Any]:
    return json.loads(ro.command("rollout", "status", "--json", *ro.kafka()).stdout)


# ---------------------------------------------------------------------- refusals
def test_rollout_start_refuses_a_model_that_does_not_fit(tmp_path: Path) -> None:
    """Another input dimension or sampling seed is refused in one line before anything is written."""
    from gnnstream.model import init_model_dir
    from gnnstream.workers.cli import main
    from tests.support import random_graph
    live = tmp_path / "live"
    v1 = tmp_path / "v1"
    init_model_dir(str(v1), arch="sage", in_dim=4, hidden=8, out_dim=4, layers=2, fanouts=[3, 2], seed=5,
                   name="fit", version=1)
    path = tmp_path / "events.jsonl"
    from gnnstream.stream.events import encode_event
    path.write_bytes(b"\n".join(encode_event(ev) for ev in random_graph("a", 40, 120, seed=1)) + b"\n")
    assert main(["apply", "--state", str(live), "--model", str(v1), str(path)]) == 0
    bad = {"dim": dict(in_dim=6, seed=5), "seed": dict(in_dim=4, seed=6)}
    for what, fields in bad.items():
        model = tmp_path / f"v2-{what}"
        init_model_dir(str(model), arch="sage", hidden=8, out_dim=4, layers=2, fanouts=[3, 2], name="fit",
                       version=2, **fields)
        done = call_gnnstream("rollout", "start", "--from", live, "--state", tmp_path / "new", "--model", model,
                              "--no-record")
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert ("input features" if what == "dim" else "seed") in done.stderr, done.stderr
        assert not (tmp_path / "new").exists() and not list(tmp_path.glob("new*"))
    same = call_gnnstream("rollout", "start", "--from", live, "--state", tmp_path / "new", "--model", v1,
                          "--no-record")
    assert same.returncode == 2 and "another version" in same.stderr, same.stderr
    model = tmp_path / "v2"
    init_model_dir(str(model), arch="sage", in_dim=4, hidden=8, out_dim=4, layers=2, fanouts=[3, 2], seed=5,
                   name="fit", version=2)
    ok = call_gnnstream("rollout", "start", "--from", live, "--state", tmp_path / "new", "--model", model,
                        "--no-record")
    assert ok.returncode == 0, ok.stderr
    result = json.loads(ok.stdout)
    assert result["model"] == "fit:2" and result["serving"] == "fit:1" and result["nodes"] > 0, result
    done = call_gnnstream("verify", "--state", tmp_path / "new", "--model", model)
    assert done.returncode == 0 and json.loads(done.stdout)["ok"], done.stdout + done.stderr


# ---------------------------------------------------------------------- a partition held at its marker
@pytest.mark.broker
def test_a_partition_held_at_its_marker_applies_nothing_past_it(broker: EmbeddedBroker, tmp_path: Path,
                                                                procs: list[Proc]) -> None:
    """Partition 0 reaches the marker long before partition 1: the events after it in partition 0 wait, over
    many polls, and are applied (and stamped with the new serving version) only once partition 1 got there."""
    from kafka import KafkaProducer

    from gnnstream.stream.events import EdgeUpsert, event_key
    from gnnstream.stream.partitioning import partition_for
    from tests.support import make_model, random_graph
    from tests.support import produce_events as produce
    tag = uuid.uuid4().hex[:8]
    events, output, control = f"ev-{tag}", f"emb-{tag}", f"ctl-{tag}"
    ensure_topics(broker.bootstrap, {events: 2, output: 2, control: 1})
    model = make_model(tmp_path / "model")  # model:1
    proc, (port,) = Proc.on_ports(
        lambda port: gnnstream_command("run", "--bootstrap", broker.bootstrap, "--state", tmp_path / "state",
                                       "--model", model, "--events-topic", events, "--output-topic", output,
                                       "--dlq-topic", f"dlq-{tag}", "--control-topic", control, "--group", f"g-{tag}",
                                       "--partitions", 2, "--metrics-port", port, "--batch-size", "20"),
        tmp_path / "worker.log")
    procs.append(proc)

    def health() -> dict[str, Any]:
        got = healthz(port)
        return got[1] if got else {}
    before = random_graph("a", 30, 80, seed=2)
    produce(broker.bootstrap, events, before)
    proc.wait_for(lambda: health().get("applied") == len(before), "the first events")
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap, acks="all", client_id="test-marker")
    key, value, headers = encode_marker(Marker(1, "other:2"))
    producer.send(events, key=key, value=value, headers=headers, partition=0).get(30)
    proc.wait_for(lambda: health().get("held_at_marker") == [0], "partition 0 to be held at its marker")
    late = [f"late{i}" for i in range(200) if partition_for(f"late{i}".encode(), 2) == 0][:20]
    after = [EdgeUpsert(v, f"late-dst{i}", 10.0 + i) for i, v in enumerate(late)]
    assert {partition_for(event_key(ev), 2) for ev in after} == {0}
    produce(broker.bootstrap, events, after)
    polls = health()["polls"]
    proc.wait_for(lambda: health().get("polls", 0) > polls + 20, "20 more polls")
    h = health()
    assert h["applied"] == len(before) and h["held_at_marker"] == [0] and h["rollout"] == 0, h
    producer.send(events, key=key, value=value, headers=headers, partition=1).get(30)
    producer.close(5)
    total = len(before) + len(after) + 2
    proc.wait_for(lambda: health().get("position") == total and health().get("applied") == len(before) + len(after),
                  "the marker passed and the late events applied")
    assert health()["rollout"] == 1 and health()["serving"] == "other:2"
    records = Topic(broker.bootstrap, output, 2)
    try:
        deadline = time.monotonic() + DEADLINE_S
        late_nodes = set(late) | {f"late-dst{i}" for i in range(len(late))}
        while time.monotonic() < deadline:
            seen = {r.key.decode() for r in records.poll()}
            if late_nodes <= seen:
                break
            time.sleep(0.2)
        stamps = {(r.key.decode() in late_nodes, dict(r.headers)[SERVING_HEADER].decode(),
                   dict(r.headers)["gnnstream.rollout"].decode()) for r in records.records}
    finally:
        records.close()
    assert stamps == {(False, "model:1", "0"), (True, "other:2", "1")}, stamps


# ---------------------------------------------------------------------- the view of the rollout topic
def test_rollout_view_follows_what_the_workers_follow() -> None:
    """Raced numbers resolve as the workers resolve them; workers ahead of the records win; promote wants a
    live worker of the version."""
    from gnnstream.workers.rollout.commands import _running
    from gnnstream.workers.rollout.topic import RolloutError, RolloutView

    def report(model: str, rollout: int, serving: str, at: float, status: str = "consuming") -> dict[str, Any]:
        return {"kind": "worker", "model": model, "worker": "w", "topic": version_topic(model), "status": status,
                "serving": serving, "rollout": rollout, "at": at}

    def marker(number: int, serving: str, at: float) -> dict[str, Any]:
        return {"kind": "marker", "rollout": number, "serving": serving, "retire": None, "at": at,
                "previous": None}
    base = [report("m:1", 0, "m:1", 100.0), report("m:2", 0, "m:1", 101.0)]
    assert RolloutView.of(base).serving == "m:1" and RolloutView.of(base).next_rollout == 1
    raced = base + [marker(1, "m:2", 110.0), marker(1, "m:1", 105.0)]  # recorded out of order: the later wins
    view = RolloutView.of(raced)
    assert view.serving == "m:2" and [m["serving"] for m in view.markers] == ["m:2"] and view.next_rollout == 2
    assert RolloutView.of(raced + [marker(1, "m:1", 120.0)]).serving == "m:1"
    ahead = raced + [report("m:1", 2, "m:1", 130.0)]  # marker 2 appended, its record lost
    assert RolloutView.of(ahead).serving == "m:1" and RolloutView.of(ahead).next_rollout == 3
    view = RolloutView.of(base)
    _running(view, "m:2", force=False, now=150.0)
    with pytest.raises(RolloutError, match="no worker of m:2 has reported consuming"):
        _running(view, "m:2", force=False, now=200.0)
    _running(view, "m:2", force=True, now=200.0)
    with pytest.raises(RolloutError, match="no worker of m:1"):
        _running(RolloutView.of([report("m:1", 0, "m:1", 100.0, status="joining")]), "m:1", force=False, now=101.0)


@pytest.mark.parametrize("argv", [["rollout", "status"], ["rollout", "promote", "m:2"], ["rollout", "rollback"],
                                  ["tail"], ["rollout", "start", "--from", "live", "--state", "new", "--model", "m"]])
def test_an_empty_control_topic_is_one_line_naming_the_flag(argv: list[str], capsys: pytest.CaptureFixture,
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--control-topic ''`` ("do not record") where a rollout topic is needed: one line naming the flag, before
    Kafka (no broker at 127.0.0.1:1) or any state is touched."""
    from gnnstream.workers.cli import main
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main([*argv, "--bootstrap", "127.0.0.1:1", "--control-topic", ""]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("gnnstream: error: --control-topic is empty") and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())
