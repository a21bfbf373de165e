"""Helpers shared by the test modules (no test module imports another one).

* ports: :func:`closed_port` (an address that refuses connections) and
  :func:`start_on_ports` (a server process on picked ports, started again on
  others when a port was taken between the pick and its bind);
* Kafka: topic names, producing, reading a topic, ``/healthz``, the worker
  command line and its process;
* workloads: Bitcoin OTC streams, small random graphs and their reference
  embeddings (:mod:`tests.workers.reference`), the engine's random event groups.

Deadlines here are safety nets that end a wait when nothing happens; no
helper measures time.
"""

from __future__ import annotations

import contextlib
import http.client
import gzip
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from gnnstream.stream.broker import free_port, listening_on
from gnnstream.stream.clients import Record
from gnnstream.stream.events import EdgeDelete, EdgeUpsert, NodeDelete, NodeUpsert, encode_event, event_key
from gnnstream.stream.updates import VERSION_HEADER, decode_update
from gnnstream.workers.settings import WorkerSettings
from tests.workers.reference import ATOL, gnnstream_command

__all__ = [
    "Group",
    "Output",
    "GROUP_PARTITIONS",
    "version_of",
    "Client",
    "answers",
    "GNNSTREAM", "JOIN_TIMEOUT_S", "PARTITIONS", "DEADLINE_S", "free_port", "closed_port", "descendants",
    "start_on_ports", "Names", "group_worker", "group_of_three", "killed_after", "newest_mismatch", "latest_updates", "produce", "produce_events", "event_messages",
    "high_watermarks", "read_topic",
    "health", "healthz", "scrape", "wait_for", "wait_for_workers", "worker_cmd", "running_worker", "stop_worker",
    "Proc", "fold", "random_graph", "make_model", "otc_stream", "expected", "small_otc_csv",
    "SEED", "DIM", "FANOUTS", "POOL", "LEAVES", "HUB", "SETTINGS", "MODELS", "event_group", "to_event",
    "nonzero_features",
]

GNNSTREAM = Path(sys.executable).with_name("gnnstream")
PARTITIONS = 4  # of the events and output topics of worker_cmd
JOIN_TIMEOUT_S = 90.0
DEADLINE_S = 120.0  # safety net for anything a test waits for
_ADDRESS_IN_USE = os.strerror(98)  # "Address already in use", as the worker and serve report a taken port


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GNNSTREAM_")}
    env["GNNSTREAM_NO_PROGRESS"] = "1"
    return env


# ---------------------------------------------------------------------- ports
@contextlib.contextmanager
def closed_port() -> Iterator[int]:
    """A loopback port that refuses connections while the block runs: bound (so no one else gets it), never
    listening."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux ``/proc``; just ``pid`` elsewhere)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                todo.extend(int(c) for c in (task / "children").read_text().split())
            except OSError:
                continue
    return out


def start_on_ports(make_cmd: Callable[..., list[Any]], log: Path, ports: int = 1,
                   attempts: int = 5) -> tuple[subprocess.Popen, tuple[int, ...]]:
    """Start ``make_cmd(*ports)`` (stderr appended to ``log``) once it holds every one of its picked ports.

    A picked port can be taken before the child binds it: a child that exits saying the address is in use
    is started again on other ports. Returns once the child (or a process below it) listens on every port,
    or has exited for another reason (the caller's waits report that), or after :data:`DEADLINE_S`.
    """
    for attempt in range(1, attempts + 1):
        picked = tuple(free_port() for _ in range(ports))
        start = log.stat().st_size if log.exists() else 0
        with open(log, "ab") as fh:
            proc = subprocess.Popen([str(a) for a in make_cmd(*picked)], stdout=subprocess.PIPE, stderr=fh,
                                    env=_env())
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                with open(log, "rb") as fh:
                    fh.seek(start)
                    said = fh.read().decode(errors="replace")
                if _ADDRESS_IN_USE in said and attempt < attempts:
                    break  # another process took a port first: pick others
                return proc, picked
            tree = descendants(proc.pid)
            if all(listening_on(tree, port) for port in picked):
                return proc, picked
            time.sleep(0.05)
        else:
            return proc, picked
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------- kafka
class Names:
    """Fresh uuid names of one test's topics, group and state directory."""

    def __init__(self, tmp_path: Path):
        tag = uuid.uuid4().hex[:10]
        self.events, self.output, self.dlq, self.group = f"ev-{tag}", f"emb-{tag}", f"dlq-{tag}", f"g-{tag}"
        self.state = str(tmp_path / f"state-{tag}")

    def topics(self, partitions: int = PARTITIONS) -> dict[str, int]:
        return {self.events: partitions, self.output: partitions, self.dlq: 1}


def produce(bootstrap: str, topic: str, messages: list[tuple[bytes | None, bytes | None]]) -> list[tuple[int, int]]:
    """Send ``(key, value)`` messages in order (kafka-python, independent of the client under test); returns
    the ``(partition, offset)`` of each."""
    from kafka import KafkaProducer
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5, max_request_size=4 << 20,
                             client_id="test-producer")
    try:
        futures = [producer.send(topic, key=k, value=v) for k, v in messages]
        producer.flush(60)
        metas = [f.get(timeout=30) for f in futures]
    finally:
        producer.close(5)
    return [(m.partition, m.offset) for m in metas]


def event_messages(evs: list) -> list[tuple[bytes, bytes]]:
    return [(event_key(ev), encode_event(ev)) for ev in evs]


def high_watermarks(placed: list[tuple[int, int]], topic: str) -> dict[tuple[str, int], int]:
    """The end offset of every partition that got one of the ``placed`` messages."""
    hw: dict[tuple[str, int], int] = {}
    for p, o in placed:
        hw[(topic, p)] = max(hw.get((topic, p), 0), o + 1)
    return hw


def produce_events(bootstrap: str, topic: str, events: list) -> dict[tuple[str, int], int]:
    """Send events in order; returns the end offset of every partition that got one."""
    return high_watermarks(produce(bootstrap, topic, event_messages(events)), topic)


def read_topic(bootstrap: str, topic: str, partitions: int, idle_s: float = 2.0,
               timeout_s: float = 60.0) -> list[Record]:
    """Every message of ``topic`` (manual assignment, no group), until ``idle_s`` without news."""
    from kafka import KafkaConsumer, TopicPartition
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None,
                             auto_offset_reset="earliest", client_id="test-reader")
    tps = [TopicPartition(topic, p) for p in range(partitions)]
    consumer.assign(tps)
    consumer.seek_to_beginning(*tps)
    out: list[Record] = []
    deadline = time.monotonic() + timeout_s
    last = time.monotonic()
    try:
        while time.monotonic() - last < idle_s and time.monotonic() < deadline:
            batch = consumer.poll(timeout_ms=300, max_records=5000)
            for tp, msgs in batch.items():
                for m in msgs:
                    out.append(Record(m.topic, m.partition, m.offset, m.key, m.value, m.timestamp,
                                      tuple((k, v) for k, v in (m.headers or ()))))
                if msgs:
                    last = time.monotonic()
    finally:
        consumer.close()
    return out


def healthz(port: int) -> tuple[int, dict[str, Any]] | None:
    """``(status, JSON)`` of ``/healthz`` on ``port``, None while nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except (OSError, ValueError):
        return None


def health(port: int) -> dict[str, Any] | None:
    """The ``/healthz`` JSON on ``port``, None while nothing answers."""
    got = healthz(port)
    return got[1] if got else None


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def wait_for(cond: Callable[[], Any], timeout_s: float, what: str, proc: subprocess.Popen | None = None,
             log: Path | None = None) -> Any:
    """``cond()`` once it is true; a failure (with the log's tail) when ``proc`` exits or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log else ""
            pytest.fail(f"worker exited with {proc.returncode} while waiting for {what}:\n{tail}")
        time.sleep(0.1)
    tail = log.read_text()[-3000:] if log else ""
    pytest.fail(f"timed out after {timeout_s}s waiting for {what}:\n{tail}")


def wait_for_workers(cond: Callable[[], Any], what: str, workers: dict[str, "Proc"], deadline_s: float) -> Any:
    """``cond()`` once it is true (polled every 0.2 s); a failure with the workers' log tails after
    ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    tails = "\n".join(f"--- {name}\n{proc.tail()[-1500:]}" for name, proc in workers.items())
    pytest.fail(f"timed out waiting for {what}:\n{tails}")


def worker_cmd(bootstrap: str, n: Names, model: str, port: int, *extra: str,
               client: str = "kafka-python") -> list[str]:
    """``gnnstream run`` on ``n``'s topics (:data:`PARTITIONS` partitions), ``/healthz`` on ``port``."""
    return [str(GNNSTREAM), "run", "--bootstrap", bootstrap, "--kafka-client", client, "--state", n.state,
            "--model", model,
            "--events-topic", n.events, "--output-topic", n.output, "--dlq-topic", n.dlq, "--group", n.group,
            "--metrics-port", str(port), "--batch-size", "200", "--partitions", str(PARTITIONS), *extra]


@contextlib.contextmanager
def running_worker(cmd: list[str] | Callable[[int], list[str]], log: Path) -> Iterator[Any]:
    """A worker process, killed on leaving the block if it is still running.

    ``cmd`` is a command line, or a function of a metrics port that makes one: then the block gets
    ``(process, port)``, the port one the worker holds (:func:`start_on_ports`).
    """
    if callable(cmd):
        proc, (port,) = start_on_ports(cmd, log)
        given: Any = (proc, port)
    else:
        with open(log, "ab") as fh:
            proc = given = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=fh,
                                            env=dict(os.environ, GNNSTREAM_NO_PROGRESS="1"))
    try:
        yield given
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def stop_worker(proc: subprocess.Popen, log: Path, timeout_s: float = 60.0) -> dict[str, Any]:
    """SIGTERM; the worker's exit-0 JSON summary."""
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"worker ignored SIGTERM for {timeout_s}s:\n{log.read_text()[-3000:]}")
    assert proc.returncode == 0, f"worker exit code {proc.returncode}:\n{log.read_text()[-3000:]}"
    return json.loads(out)


class Proc:
    """A ``gnnstream`` process with its stderr in a file; killed if a test leaves it running (``procs``)."""

    def __init__(self, cmd: list[Any], log: Path, proc: subprocess.Popen | None = None):
        self.log = log
        if proc is None:
            with open(log, "ab") as fh:
                proc = subprocess.Popen([str(a) for a in cmd], stdout=subprocess.PIPE, stderr=fh, env=_env())
        self.proc = proc

    @classmethod
    def on_ports(cls, make_cmd: Callable[..., list[Any]], log: Path, ports: int = 1) -> tuple["Proc", tuple[int, ...]]:
        """``make_cmd(*ports)`` started on picked ports it holds (:func:`start_on_ports`)."""
        proc, picked = start_on_ports(make_cmd, log, ports)
        return cls([], log, proc), picked

    def tail(self) -> str:
        return self.log.read_text()[-4000:]

    def wait_for(self, cond: Callable[[], Any], what: str) -> Any:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            value = cond()
            if value:
                return value
            if self.proc.poll() is not None:
                pytest.fail(f"worker exited with {self.proc.returncode} while waiting for {what}:\n{self.tail()}")
            time.sleep(0.1)
        pytest.fail(f"timed out waiting for {what}:\n{self.tail()}")

    def sigterm(self) -> dict[str, Any]:
        self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            pytest.fail(f"worker ignored SIGTERM:\n{self.tail()}")
        assert self.proc.returncode == 0, f"exit code {self.proc.returncode}:\n{self.tail()}"
        return json.loads(out)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


# ---------------------------------------------------------------------- workloads
def fold(events: list) -> Any:
    """The final graph of ``events`` (:class:`tests.workers.reference.GraphFold`)."""
    from tests.workers.reference import GraphFold
    g = GraphFold()
    for ev in events:
        g.apply_event(ev)
    return g


def random_graph(prefix: str, nodes: int, edges: int, seed: int, ts: float = 1.0, dim: int = 4) -> list:
    """Upserts only: features for most nodes (every seventh stays cold-start), then random edges."""
    rng = random.Random(seed)
    names = [f"{prefix}{i}" for i in range(nodes)]
    events: list = []
    for i, v in enumerate(names):
        if i % 7:
            events.append(NodeUpsert(v, ts, tuple(rng.randrange(-64, 64) / 32 for _ in range(dim))))
    for j in range(edges):
        a, b = rng.sample(names, 2)
        events.append(EdgeUpsert(a, b, ts + j, rng.randrange(1, 9) / 2))
    return events


def make_model(path: Path, seed: int = 0) -> str:
    """A small 2-layer GraphSAGE for :func:`random_graph` (4 -> 8 -> 6, fanouts 4,3)."""
    from gnnstream.model import init_model_dir
    init_model_dir(str(path), arch="sage", in_dim=4, hidden=8, out_dim=6, layers=2, fanouts=[4, 3], seed=seed)
    return str(path)


def otc_stream(tmp_path: Path) -> tuple[list, list]:
    """``(events, node deletes)``: the whole Bitcoin OTC stream (ratings and their feature updates) with an
    edge delete after every 40th rating (of the rating 300 events earlier: same key, so ordered after it in
    every worker), and 25 node deletes to produce once everything before them was applied (a node delete
    races with edges keyed by other nodes, docs/design.md)."""
    from gnnstream.stream.events import decode_event_json
    from gnnstream.workers.cli import main
    from tests.workers.reference import DATA_DIR
    path = tmp_path / "otc.jsonl"
    assert main(["events", "from-snap", str(DATA_DIR / "soc-sign-bitcoinotc.csv.gz"), "--out", str(path)]) == 0
    base = [decode_event_json(line) for line in path.read_bytes().splitlines()]
    events: list = []
    upserts: list[EdgeUpsert] = []
    for ev in base:
        events.append(ev)
        if isinstance(ev, EdgeUpsert):
            upserts.append(ev)
            if len(upserts) % 40 == 0 and len(upserts) > 300:
                old = upserts[-300]
                events.append(EdgeDelete(old.src, old.dst, ev.ts))
    nodes = sorted(fold(events).nodes)
    gone = random.Random(7).sample(nodes, 25)
    last = max(ev.ts for ev in events)
    return events, [NodeDelete(v, last + 1) for v in gone]


def expected(events: list, deletes: list, model: str) -> tuple[dict[str, np.ndarray], set[str]]:
    """The reference embedding of every node of the final graph, and the deleted nodes."""
    from tests.workers.reference import reference_embeddings
    g = fold(events + deletes)
    want = reference_embeddings(g.nodes, g.edges, g.features, model)
    return {v: np.asarray(e, dtype=np.float64) for v, e in want.items()}, {d.id for d in deletes}


def small_otc_csv(tmp_path: Path, lines: int = 1500) -> Path:
    """The first ``lines`` ratings of Bitcoin OTC as a SNAP CSV."""
    from gnnstream.fraud.datasets import BITCOIN_OTC
    csv = tmp_path / "otc-small.csv"
    with gzip.open(BITCOIN_OTC, "rt") as fh:
        csv.write_text("".join(line for _, line in zip(range(lines), fh)))
    return csv


# ---------------------------------------------------------------------- the engine's random streams
SEED = 11
DIM = 4
FANOUTS = (3, 2)
POOL = ["a", "b", "c", "d", "e", "f", "7", "42"]
LEAVES = [f"l{i}" for i in range(48)]
HUB = "hub"

SETTINGS = settings(max_examples=25, deadline=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# name -> init_model_dir arguments
MODELS: dict[str, dict[str, Any]] = {
    "sage": dict(arch="sage"),
    "gcn": dict(arch="gcn"),
    "gat": dict(arch="gat", heads=2),
    "sage_feature_only": dict(arch="sage", cold_start={"policy": "feature_only", "min_neighbours": 2}),
    "gcn_feature_only": dict(arch="gcn", cold_start={"policy": "feature_only", "min_neighbours": 2}),
    "gat_feature_only": dict(arch="gat", heads=2, cold_start={"policy": "feature_only", "min_neighbours": 3}),
    # three layers, two of them sharing a fanout (and so the store's sample marks)
    "gcn_3_layers": dict(arch="gcn", layers=3, fanouts=(2, 3, 2)),
}

_floats = st.floats(-2.0, 2.0, allow_nan=False, allow_infinity=False, width=32)
# An all-zero feature vector makes a node's h^0 equal to the cold-start zero vector; that case
# has its own test (test_mode_changes_when_features_equal_the_zero_default), so it is kept
# out of the streams here so that a failure points at one bug.
_features = st.tuples(*[_floats] * DIM).filter(lambda f: any(x != 0 for x in f))
_any_node = st.sampled_from(POOL + LEAVES[:8] + [HUB])
_KINDS = ["edge", "edge", "edge", "reciprocal", "self_loop", "edge_delete", "edge_delete", "features",
          "features", "node_delete", "hub_edge", "hub_edge", "hub_edge_delete", "leaf_delete", "hub_delete",
          "hub_features"]


@st.composite
def event_group(draw: Any) -> list[tuple]:
    """One logical step as ``(op, ...)`` tuples (timestamps are added later)."""
    kind = draw(st.sampled_from(_KINDS))
    if kind == "edge":
        return [("edge_upsert", draw(_any_node), draw(_any_node))]
    if kind == "reciprocal":
        a, b = draw(_any_node), draw(_any_node)
        return [("edge_upsert", a, b), ("edge_upsert", b, a)]
    if kind == "self_loop":
        a = draw(_any_node)
        return [("edge_upsert", a, a)]
    if kind == "edge_delete":
        return [("edge_delete", draw(_any_node), draw(_any_node))]
    if kind == "features":
        return [("node_upsert", draw(_any_node), draw(_features))]
    if kind == "node_delete":
        return [("node_delete", draw(_any_node))]
    leaf = draw(st.sampled_from(LEAVES))
    if kind == "hub_edge":
        return [("edge_upsert", HUB, leaf) if draw(st.booleans()) else ("edge_upsert", leaf, HUB)]
    if kind == "hub_edge_delete":
        return [("edge_delete", HUB, leaf) if draw(st.booleans()) else ("edge_delete", leaf, HUB)]
    if kind == "leaf_delete":
        return [("node_delete", leaf)]
    if kind == "hub_features":
        return [("node_upsert", draw(st.sampled_from([HUB, leaf])), draw(_features))]
    assert kind == "hub_delete"
    return [("node_delete", HUB)]


def to_event(step: tuple, ts: int) -> Any:
    """The event of an :func:`event_group` step at time ``ts``."""
    op = step[0]
    if op == "edge_upsert":
        return EdgeUpsert(step[1], step[2], ts, float(ts % 7) - 3.0)
    if op == "edge_delete":
        return EdgeDelete(step[1], step[2], ts)
    if op == "node_upsert":
        return NodeUpsert(step[1], ts, tuple(step[2]))
    return NodeDelete(step[1], ts)


def nonzero_features(rnd: random.Random) -> tuple[float, ...]:
    """A random ``DIM`` feature vector that is not all zeros."""
    vec = [round(rnd.uniform(-2, 2), 3) for _ in range(DIM)]
    if not any(vec):
        vec[0] = 1.0
    return tuple(vec)


class Client:
    """A keep-alive HTTP/1.1 client of the query API (reconnects when the server closed the connection)."""

    def __init__(self, port: int):
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def request(self, method: str, path: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        for attempt in range(2):
            try:
                self.conn.request(method, path, body=data, headers={"content-type": "application/json"})
                resp = self.conn.getresponse()
                payload = resp.read()
                if resp.getheader("connection", "").lower() == "close":
                    self.conn.close()
                try:
                    return resp.status, json.loads(payload)
                except ValueError:
                    return resp.status, payload.decode(errors="replace")
            except (ConnectionError, http.client.RemoteDisconnected, http.client.CannotSendRequest, BrokenPipeError):
                self.conn.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.conn.close()


def answers(client: Client) -> bool:
    """Whether the query API behind ``client`` answers ``/v1/health`` with 200."""
    try:
        return client.request("GET", "/v1/health")[0] == 200
    except OSError:
        return False


GROUP_PARTITIONS = 6  # of the output topic (and the events topic) of a Group
GROUP_DEADLINE_S = 240.0


# ---------------------------------------------------------------------- a group of workers
class Group:
    """Workers of one group: ``gnnstream run`` processes with their own states and health ports."""

    def __init__(self, bootstrap: str, n: Names, model: str, tmp_path: Path, procs: list[Proc],
                 client: str = WorkerSettings.kafka_client):
        self.bootstrap, self.n, self.model, self.tmp_path, self.procs = bootstrap, n, model, tmp_path, procs
        self.client = client
        self.workers: dict[str, tuple[Proc, int, str]] = {}  # name -> (process, health port, state)

    def start(self, name: str, state: str | None = None, query: bool = False) -> int | None:
        """Start worker ``name``; with ``query``, with a query API too, on the port returned."""
        state = state or str(self.tmp_path / f"state-{name}")

        def cmd(port: int, query_port: int | None = None) -> list[Any]:
            return gnnstream_command("run", "--bootstrap", self.bootstrap, "--state", state, "--model", self.model,
                                     "--events-topic", self.n.events, "--output-topic", self.n.output,
                                     "--dlq-topic", self.n.dlq, "--group", self.n.group, "--worker-id", name,
                                     "--partitions", GROUP_PARTITIONS, "--metrics-port", port, "--batch-size", "200",
                                     "--kafka-client", self.client,
                                     *(("--query-port", query_port) if query_port else ()))
        proc, ports = Proc.on_ports(cmd, self.tmp_path / f"{name}.log", 2 if query else 1)
        self.procs.append(proc)
        self.workers[name] = (proc, ports[0], state)
        return ports[1] if query else None

    def health(self, name: str) -> dict[str, Any]:
        proc, port, _ = self.workers[name]
        got = healthz(port)
        if proc.proc.poll() is not None:
            pytest.fail(f"worker {name} exited with {proc.proc.returncode}:\n{proc.tail()}")
        return got[1] if got else {}

    def owners(self) -> dict[int, str] | None:
        """``{partition: worker}`` once the running workers own every partition exactly once."""
        owned: dict[int, str] = {}
        for name in self.workers:
            for p in self.health(name).get("owned_partitions", []):
                if p in owned:
                    return None
                owned[p] = name
        return owned if len(owned) == GROUP_PARTITIONS else None

    def wait(self, cond: Any, what: str) -> Any:
        return wait_for_workers(cond, what, {name: proc for name, (proc, _, _) in self.workers.items()}, GROUP_DEADLINE_S)

    def stable(self, size: int) -> dict[int, str]:
        """Wait until ``size`` workers share the partitions, each owning some."""
        return self.wait(lambda: (o := self.owners()) and len(set(o.values())) == size and o,
                         f"{size} workers sharing {GROUP_PARTITIONS} partitions")

    def applied(self, position: int) -> None:
        self.wait(lambda: all(self.health(name).get("position", -1) >= position for name in self.workers),
                  f"every worker at position {position}")

    def kill(self, name: str) -> None:
        proc, _, _ = self.workers.pop(name)
        proc.proc.send_signal(signal.SIGKILL)
        proc.proc.communicate()


class Output:
    """Every message of the output topic so far, read incrementally from the start of each partition."""

    def __init__(self, bootstrap: str, topic: str):
        from kafka import KafkaConsumer, TopicPartition
        self.consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None,
                                      auto_offset_reset="earliest", client_id="test-output")
        tps = [TopicPartition(topic, p) for p in range(GROUP_PARTITIONS)]
        self.consumer.assign(tps)
        self.consumer.seek_to_beginning(*tps)
        self.records: list = []
        self.latest: dict[str, tuple[int, Any]] = {}  # node -> (version, record)

    def poll(self) -> None:
        for msgs in self.consumer.poll(timeout_ms=200, max_records=20_000).values():
            for r in msgs:
                self.records.append(r)
                version = version_of(r)
                node = r.key.decode()
                if node not in self.latest or version > self.latest[node][0]:
                    self.latest[node] = (version, r)

    def mismatch(self, want: dict[str, np.ndarray], gone: set[str]) -> str | None:
        """None when the newest message of every node is its reference embedding (or, deleted, a tombstone)."""
        self.poll()
        for v, emb in want.items():
            if v not in self.latest:
                return f"nothing published for {v}"
            r = self.latest[v][1]
            if r.value is None:
                return f"{v}: newest message is a tombstone"
            got = np.asarray(decode_update(r.value).embedding, dtype=np.float64)
            if not np.allclose(got, emb, rtol=0, atol=ATOL):
                return f"{v}: newest version differs by {np.abs(got - emb).max():.3g}"
        for v in gone:
            if v in self.latest and self.latest[v][1].value is not None:
                return f"{v} was deleted but its newest message is an embedding"
        return None

    def close(self) -> None:
        self.consumer.close()


def version_of(r: Any) -> int:
    """The version of an output record: the update's, or a tombstone's header."""
    if r.value is not None:
        return decode_update(r.value).version
    return int(dict(r.headers)[VERSION_HEADER])


def group_worker(bootstrap: str, n: Names, model: str, tmp_path: Path, name: str, parts: int) -> tuple[Proc, int]:
    """``gnnstream run`` as worker ``name`` of the group of ``n`` (topics of ``parts`` partitions), on its own
    state: the process and its metrics port."""

    def cmd(port: int) -> list:
        return gnnstream_command("run", "--bootstrap", bootstrap, "--state", tmp_path / f"state-{name}", "--model",
                                 model, "--events-topic", n.events, "--output-topic", n.output, "--dlq-topic", n.dlq,
                                 "--group", n.group, "--worker-id", name, "--partitions", parts, "--metrics-port",
                                 port, "--batch-size", "200")
    proc, ports = Proc.on_ports(cmd, tmp_path / f"{name}.log", 1)
    return proc, ports[0]


def killed_after(cmd: Callable[[int], list[str]], log: Path, applied: int) -> None:
    """Run the worker of ``cmd(port)`` until it has applied ``applied`` events, then SIGKILL it."""
    with running_worker(cmd, log) as (proc, port):
        wait_for(lambda: (h := health(port)) and h["applied"] >= applied, JOIN_TIMEOUT_S,
                 f"{applied} applied events", proc, log)
        proc.kill()
        proc.wait()


def group_of_three(bootstrap: str, n: Names, model: str, tmp_path: Path, procs: list, parts: int,
                   prepare: Callable[[str], None] | None = None) -> tuple[dict[str, Proc], Callable[[int], bool]]:
    """Workers ``w1``..``w3`` of the group of ``n`` (``prepare(name)`` first), started and sharing the ``parts``
    output partitions: the processes by name, and ``at(position)``: whether every one has consumed that many
    events."""
    workers = {}
    for name in ("w1", "w2", "w3"):
        if prepare is not None:
            prepare(name)
        workers[name] = group_worker(bootstrap, n, model, tmp_path, name, parts)
        procs.append(workers[name][0])
    running = {name: proc for name, (proc, _) in workers.items()}

    def owned() -> list:
        return sorted(p for _, port in workers.values() for p in (health(port) or {}).get("owned_partitions", []))

    def at(position: int) -> bool:
        return all((health(port) or {}).get("position", -1) >= position for _, port in workers.values())

    wait_for_workers(lambda: owned() == list(range(parts)), "three workers sharing the partitions", running, 240.0)
    return running, at


def latest_updates(bootstrap: str, topic: str, partitions: int) -> dict[str, Any]:
    """The newest update of every node on an output topic (highest version), decoded."""
    latest: dict[str, Any] = {}
    for r in read_topic(bootstrap, topic, partitions):
        u = decode_update(r.value)
        if u.id not in latest or u.version > latest[u.id].version:
            latest[u.id] = u
    return latest


def newest_mismatch(bootstrap: str, topic: str, parts: int, want: dict, gone: set) -> str | None:
    """None once the newest message of every node of ``want`` is its embedding and of every ``gone`` node a
    tombstone."""
    newest: dict[str, tuple[int, Any]] = {}
    for r in read_topic(bootstrap, topic, parts, idle_s=0.5):
        version = decode_update(r.value).version if r.value is not None else int(dict(r.headers)[VERSION_HEADER])
        node = r.key.decode()
        if node not in newest or version > newest[node][0]:
            newest[node] = (version, r.value)
    for v, emb in want.items():
        if v not in newest or newest[v][1] is None:
            return f"no embedding published for {v}"
        got = np.asarray(decode_update(newest[v][1]).embedding, dtype=np.float64)
        if not np.allclose(got, emb, rtol=0, atol=1e-4):
            return f"{v}: newest version differs by {np.abs(got - emb).max():.3g}"
    return next((f"{v}: not withdrawn" for v in gone if v in newest and newest[v][1] is not None), None)
