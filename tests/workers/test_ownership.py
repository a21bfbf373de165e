"""The worker's side of the group, without a broker: the member's callbacks driven by hand, in the orders a
rebalance can produce, against Worker._sync_ownership with an engine that records what it is asked."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

import gnnstream.workers.runtime.group as ownership
from gnnstream.workers.settings import WorkerSettings
from gnnstream.workers.runtime.worker import Worker

TOPIC = "node-embeddings"


class _Member:
    """Stands in for the Kafka consumer of the group: keeps the hooks, commits offsets to a dict."""

    def __init__(self) -> None:
        self.committed_offsets: dict[tuple[str, int], int] = {}
        self.on_assign: Callable | None = None
        self.on_revoke: Callable | None = None

    def poll_batch(self, max_records: int = 1, timeout_s: float = 0.0) -> list:
        time.sleep(0.01)
        return []

    def partitions_of(self, topic: str, timeout_s: float = 10.0) -> set[int]:
        return {0, 1, 2, 3}

    def committed(self, keys: list, timeout_s: float = 10.0) -> dict:
        return {k: self.committed_offsets.get(k) for k in keys}

    def commit(self, offsets: dict, wait: bool = False) -> bool:
        self.committed_offsets.update(offsets)
        return True

    def close(self) -> None:
        pass


class _Engine:
    def __init__(self) -> None:
        self.taken: list[tuple[list[int], list[int]]] = []
        self.epoch = 0

    def own(self, keep: Any, publish: Any = None, count: int = 0, epoch: int | None = None) -> None:
        self.epoch = self.epoch if epoch is None else epoch

    def take_over(self, parts: set[int], computed: Any = frozenset()) -> Any:
        self.taken.append((sorted(parts), sorted(computed)))
        return type("Stats", (), {"recomputed": [0], "published": 0})()


def _wait(cond: Callable[[], Any]) -> None:
    for _ in range(2000):  # the member thread claims within a few of its 10 ms polls
        if cond():
            return
        time.sleep(0.005)
    pytest.fail("the member thread did not act")


def test_a_revocation_before_the_worker_took_an_assignment_drops_it(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    """A standby worker is assigned partition 2 during a long batch; before the batch ends a new rebalance
    revokes it, and later gives it back. The worker must take it over then (compute and publish it), and
    every claim must take a higher epoch."""
    member = _Member()

    def fake_open(client: str, bootstrap: str, topic: str, group: str, **kw: Any) -> _Member:
        member.on_assign, member.on_revoke = kw["on_assign"], kw["on_revoke"]
        return member

    monkeypatch.setattr(ownership, "open_consumer", fake_open)
    own = ownership.Ownership("confluent", "unused:9092", TOPIC, "g", revoke_wait_s=30.0)
    worker = Worker(WorkerSettings(state=str(tmp_path / "s"), metrics_port=0))
    worker.group.ownership, worker.group.partitions = own, 4
    engine = _Engine()
    try:
        _wait(lambda: member.on_assign is not None)

        def assign(parts: list[int]) -> None:
            member.on_assign([(TOPIC, p) for p in parts])
            _wait(lambda: own._claiming is None)

        assign([])  # standby
        _wait(own.joined.is_set)
        worker._sync_ownership(engine)
        assert worker.group.owned == set()
        assign([2])  # the batch runs on: nothing taken yet
        first = engine.epoch
        revoking = threading.Thread(target=member.on_revoke, args=([(TOPIC, 2)],))
        revoking.start()  # waits for the worker
        _wait(lambda: own._removed)
        worker._sync_ownership(engine)  # the batch ended: the revocation, and no stale assignment
        revoking.join(10)
        assert not revoking.is_alive()
        assert engine.taken == [] and worker.group.owned == set() and worker.group.rebalancing
        assign([])  # partition 2 went elsewhere
        worker._sync_ownership(engine)
        member.on_revoke([])
        assign([2])  # and comes back
        outbox = type("Outbox", (), {"forgot": 0, "forget_sent": lambda self: setattr(self, "forgot", 1)})()
        worker._outbox = outbox
        worker._sync_ownership(engine)
        assert worker.group.owned == {2} and engine.taken == [([2], [])], engine.taken
        assert outbox.forgot == 1, "--min-change must not hold back the takeover's republish"
        assert first == 0 and engine.epoch == member.committed_offsets[(TOPIC, 2)] == 2  # A1 took 1
    finally:
        own.close()
