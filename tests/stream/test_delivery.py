"""The delivery process: what it sends, a child that dies, a batch it refuses, a parent that goes away."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

from gnnstream.stream.backends import KAFKA_CLIENTS
from gnnstream.stream.delivery import CHUNK, DeliveryProcess, UpdateColumns, encode_columns
from gnnstream.stream.exceptions import DeliveryError
from gnnstream.stream.kafka import ensure_topics
from tests.support import read_topic

pytestmark = [pytest.mark.broker, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def columns(n: int, start: int = 0, seed: int = 0) -> UpdateColumns:
    """``n`` nodes, every seventh one withdrawn (a tombstone)."""
    rng = np.random.default_rng(seed)
    iids = np.arange(start, start + n)
    deleted = iids % 7 == 3
    rows = rng.standard_normal((n, 8)).astype(np.float32)
    rows[deleted] = 0
    return UpdateColumns([f"node-{i}" for i in iids.tolist()], iids * 3 + 1, 1_700_000_000 + iids / 4, 1_700_000_500.5,
                         ["deleted" if d else "full" for d in deleted.tolist()], rows, deleted, iids,
                         deleted.astype(np.int16))


def sent(bootstrap: str, topic: str, all_headers: bool = False) -> list[tuple[bytes, bytes | None, list]]:
    """``(key, value, headers)`` of every message (headers of tombstones only, unless ``all_headers``)."""
    return [(r.key, r.value, [(k, v) for k, v in r.headers] if all_headers or r.value is None else None)
            for r in read_topic(bootstrap, topic, 1, idle_s=1.5)]


def _exited(pid: int, polls: int = 300) -> bool:
    """Whether process ``pid`` is gone (or a zombie) within ``polls`` looks, 0.1 s apart."""
    for _ in range(polls):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().split(") ")[1].startswith("Z"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("client", KAFKA_CLIENTS)
@pytest.mark.parametrize("fmt", ["json", "binary"])
def test_the_child_sends_in_order_what_encode_columns_makes(broker: Any, unique_name: Any, client: str,
                                                             fmt: str) -> None:
    topic = unique_name("emb")
    ensure_topics(broker.bootstrap, {topic: 1})
    later = columns(50, start=CHUNK + 280, seed=1)  # 20 nodes again, at later versions
    later = UpdateColumns(later.names, later.versions + 1000, later.event_ts, later.computed_at, later.modes,
                          later.rows, later.deleted)
    batch = [columns(CHUNK + 300), later]  # more than one chunk
    delivery = DeliveryProcess(client, broker.bootstrap, topic, "sage:2", fmt, worker="w1")
    stamp = [("gnnstream.serving", b"sage:2")]
    try:
        assert delivery.deliver(batch, 30.0, stamp) == CHUNK + 350
    finally:
        delivery.close(5.0)
    common = [("gnnstream.worker", b"w1"), *stamp]  # every message: after a tombstone's own version header
    expected = [(k, v, [*(h or ()), *common]) for k, v, h in encode_columns(batch, "sage:2", fmt)]
    got = sent(broker.bootstrap, topic, all_headers=True)
    assert sorted(got, key=repr) == sorted(expected, key=repr)
    assert sum(v is None for _, v, _ in got) == int(sum(c.deleted.sum() for c in batch)) > 0
    last = {k: (v, h) for k, v, h in got}  # a node's messages arrive in the order of the sets
    for key, value, headers in encode_columns([later], "sage:2", fmt):
        assert last[key] == (value, [*(headers or ()), *common]), key


@pytest.mark.parametrize("client", KAFKA_CLIENTS)
def test_a_dead_child_fails_its_batch_and_is_replaced(broker: Any, unique_name: Any, client: str) -> None:
    topic = unique_name("emb")
    ensure_topics(broker.bootstrap, {topic: 1})
    delivery = DeliveryProcess(client, broker.bootstrap, topic, "m:1", "json")
    try:
        assert delivery.deliver([columns(10)]) == 10
        first = delivery.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        assert _exited(first)
        with pytest.raises(DeliveryError, match=r"the delivery process exited \(code -9\)"):
            delivery.deliver([columns(5, start=10)])
        assert delivery.deliver([columns(5, start=10)]) == 5  # the same batch again, through a new child
        assert delivery.pid not in (None, first)

        bad = columns(4, start=20)
        bad.rows[1, 2] = np.nan
        with pytest.raises(ValueError, match=r"non-finite values for nodes \['node-21'\]"):
            delivery.deliver([columns(3, start=30), bad])  # refused whole: nothing of it goes out
        assert delivery.deliver([columns(1, start=40)]) == 1  # and the child goes on
        last = delivery.pid
    finally:
        delivery.close(5.0)
    assert last is not None and _exited(last)
    keys = [k.decode() for k, _, _ in sent(broker.bootstrap, topic)]
    assert sorted(keys) == sorted(f"node-{i}" for i in [*range(15), 40])


def test_the_child_ignores_signals_and_leaves_with_its_parent(broker: Any, unique_name: Any) -> None:
    topic = unique_name("emb")
    ensure_topics(broker.bootstrap, {topic: 1})
    script = ("import sys; from stream.delivery import DeliveryProcess; "
              f"d = DeliveryProcess('confluent', {broker.bootstrap!r}, {topic!r}, 'm:1'); "
              "d.deliver([]); print(d.pid, flush=True); sys.stdin.readline()")  # answered: it serves
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        os.kill(child, signal.SIGTERM)  # the worker decides when it stops
        os.kill(child, signal.SIGINT)
        assert not _exited(child, polls=10)
        parent.kill()  # no close message: the socket's end is all the child learns
        parent.wait()
        assert _exited(child)
    finally:
        if parent.poll() is None:
            parent.kill()
