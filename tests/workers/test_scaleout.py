"""Several workers, one output: a group of ``gnnstream run`` processes shares out the output topic.

Every worker reads every event and keeps the whole graph; each publishes the
nodes of the output partitions the group assigned it (header
``gnnstream.worker``). The published stream is checked against the
independent PyG reference (:mod:`tests.workers.reference`) on a Bitcoin OTC
stream with feature updates, edge deletes and node deletes: for every node of
the final graph the highest version published is its exact embedding, and for
every deleted node it is a tombstone. Waits end on progress (events applied,
the output reaching the reference), never on a clock.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gnnstream.stream.backends import KAFKA_CLIENTS
from gnnstream.stream.broker import EmbeddedBroker
from gnnstream.stream.delivery import WORKER_HEADER
from gnnstream.stream.kafka import ensure_topics
from gnnstream.stream.partitioning import partition_for
from gnnstream.workers.settings import WorkerSettings
from tests.support import GROUP_PARTITIONS, Group, Names, Output, Proc, expected, otc_stream
from tests.support import produce_events as produce
from tests.workers.reference import ATOL, gnnstream_command

# the whole Bitcoin OTC stream through Kafka: slow
pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.xdist_group("scale-out")]  # several workers at once: one such test at a time

PARTS = GROUP_PARTITIONS  # of the output topic (and the events topic)


# ---------------------------------------------------------------------- the model
def make_model(path: Path) -> str:
    from gnnstream.model import init_model_dir
    init_model_dir(str(path), arch="sage", in_dim=8, hidden=16, out_dim=8, layers=2, fanouts=[10, 5], seed=0)
    return str(path)


def _worker(r: Any) -> str:
    return dict(r.headers)[WORKER_HEADER].decode()


def setup(broker: EmbeddedBroker, tmp_path: Path, procs: list[Proc],
          client: str = WorkerSettings.kafka_client) -> tuple[Group, Output, list, list]:
    n = Names(tmp_path)
    ensure_topics(broker.bootstrap, {n.events: PARTS, n.output: PARTS, n.dlq: 1})
    events, deletes = otc_stream(tmp_path)
    group = Group(broker.bootstrap, n, make_model(tmp_path / "model"), tmp_path, procs, client)
    return group, Output(broker.bootstrap, n.output), events, deletes


def finish(group: Group, out: Output, events: list, deletes: list) -> None:
    """Produce the node deletes once every worker applied the rest; wait for the output to be exact."""
    group.applied(len(events))
    produce(group.bootstrap, group.n.events, deletes)
    group.applied(len(events) + len(deletes))
    want, gone = expected(events, deletes, group.model)
    group.wait(lambda: out.mismatch(want, gone) is None, "the newest output of every node to be exact")


# ---------------------------------------------------------------------- tests
@pytest.mark.parametrize("client", KAFKA_CLIENTS)
def test_three_workers_publish_disjoint_shares_exactly(client: str, broker: EmbeddedBroker, tmp_path: Path,
                                                       procs: list[Proc]) -> None:
    group, out, events, deletes = setup(broker, tmp_path, procs, client)
    try:
        query_port = group.start("w1", query=True)
        for name in ("w2", "w3"):
            group.start(name)
        owners = group.stable(3)
        produce(group.bootstrap, group.n.events, events)
        finish(group, out, events, deletes)
        assert group.owners() == owners, "the group rebalanced while nothing joined or left"
        published: dict[str, set[str]] = {name: set() for name in ("w1", "w2", "w3")}
        for r in out.records:
            name = _worker(r)
            node = r.key.decode()
            assert r.partition == partition_for(r.key, PARTS), (node, r.partition)
            assert owners[r.partition] == name, f"{name} published {node} of partition {r.partition}"
            published[name].add(node)
        shares = {name: group.health(name)["final_recomputed"] for name in published}
        print(f"final-layer recomputes per worker: {shares}; nodes published: "
              f"{ {k: len(v) for k, v in published.items()} }")
        assert not (published["w1"] & published["w2"]) and not (published["w1"] & published["w3"]) \
            and not (published["w2"] & published["w3"])
        want, gone = expected(events, deletes, group.model)
        assert set().union(*published.values()) == set(want) | gone
        total = sum(shares.values())
        for name, count in shares.items():  # each computes its own share of the final layer, not all of it
            assert 0 < count < 0.7 * total, shares
        check_query_api(query_port, owners, want)
        # w1's state, stopped: verify checks the nodes whose final rows it keeps, and says how many it does not
        proc, _, state = group.workers.pop("w1")
        proc.sigterm()
        done = subprocess.run(gnnstream_command("verify", "--state", state), capture_output=True, text=True,
                              timeout=300)
        report = json.loads(done.stdout)
        assert done.returncode == 0 and report["ok"], report
        ones = {v for v in want if owners[partition_for(v.encode(), PARTS)] == "w1"}
        assert report["nodes"] == len(ones) and report["not_kept"] == len(want) - len(ones), report
    finally:
        out.close()


def check_query_api(port: int, owners: dict[int, str], want: dict[str, np.ndarray]) -> None:
    """w1's query API: lookups of its own nodes are exact, of others' refused with 421 naming the partition;
    a what-if of another worker's node (no events) is exact too."""
    import urllib.error
    import urllib.request

    def call(path: str, body: dict | None = None) -> tuple[int, dict]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    mine = sorted(v for v in want if owners[partition_for(v.encode(), PARTS)] == "w1")[:20]
    theirs = sorted(v for v in want if owners[partition_for(v.encode(), PARTS)] != "w1")[:20]
    for v in mine:
        status, body = call(f"/v1/embeddings/{v}")
        assert status == 200, body
        np.testing.assert_allclose(body["embedding"], want[v], rtol=0, atol=ATOL)
    for v in theirs:
        status, body = call(f"/v1/embeddings/{v}")
        assert status == 421 and body["partition"] == partition_for(v.encode(), PARTS), (v, status, body)
    status, body = call("/v1/infer", {"events": [], "ids": theirs})
    assert status == 200, body
    for v in theirs:
        np.testing.assert_allclose(body["embeddings"][v], want[v], rtol=0, atol=ATOL)


def test_failover_restart_and_a_fourth_worker_from_a_snapshot(broker: EmbeddedBroker, tmp_path: Path,
                                                              procs: list[Proc]) -> None:
    group, out, events, deletes = setup(broker, tmp_path, procs)
    try:
        for name in ("w1", "w2", "w3"):
            group.start(name)
        owners = group.stable(3)
        third = len(events) // 3
        first, second, third = events[:third], events[third:2 * third], events[2 * third:]
        produce(group.bootstrap, group.n.events, first)
        # SIGKILL w2 mid-stream: once it applied part of the first slice
        group.wait(lambda: group.health("w2").get("position", 0) >= len(first) // 3, "w2 to apply some events")
        lost = {p for p, name in owners.items() if name == "w2"}
        killed_at = time.time()
        group.kill("w2")
        after = group.stable(2)

        def taken() -> list:
            out.poll()
            return [r for r in out.records if r.partition in lost and _worker(r) != "w2"
                    and r.timestamp / 1000 >= killed_at]
        taken = group.wait(taken, "a survivor to publish a node of w2's partitions")
        print(f"kill to first publish of a taken-over node: {min(r.timestamp for r in taken) / 1000 - killed_at:.2f} s "
              f"(partitions {sorted(lost)} now owned by {sorted({after[p] for p in lost})})")
        produce(group.bootstrap, group.n.events, second)
        group.applied(len(first) + len(second))
        # w2 restarts on its own state; w4 starts from a snapshot of w1's, taken while w1 runs
        group.start("w2", state=str(tmp_path / "state-w2"))
        snap = tmp_path / "state-w4"
        done = subprocess.run(gnnstream_command("snapshot", "--state", str(tmp_path / "state-w1"), "--out", str(snap)),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        group.start("w4", state=str(snap))
        group.stable(4)
        produce(group.bootstrap, group.n.events, third)
        finish(group, out, events, deletes)
    finally:
        out.close()


def test_epochs_survive_a_group_that_lost_its_offsets(broker: EmbeddedBroker, tmp_path: Path,
                                                      procs: list[Proc]) -> None:
    """A worker restarted under a group with no committed offsets (as after the broker expired them) claims
    epochs above those its state recorded: its new versions still beat everything it published before."""
    group, out, events, _ = setup(broker, tmp_path, procs)
    try:
        events = events[:3000]
        group.start("w1")
        group.stable(1)
        produce(group.bootstrap, group.n.events, events)
        want, _ = expected(events, [], group.model)
        group.wait(lambda: out.mismatch(want, set()) is None, "the output to be exact")
        before = {v: version for v, (version, _) in out.latest.items()}
        proc, _, state = group.workers.pop("w1")
        proc.sigterm()
        group.n.group += "-fresh"
        group.start("w1", state)
        group.stable(1)
        group.wait(lambda: out.poll() or all(out.latest[v][0] > before[v] for v in want),
                   "every node republished at a higher version")
        assert min(version >> 32 for version, _ in out.latest.values()) >= 2
        assert out.mismatch(want, set()) is None
    finally:
        out.close()
