"""Crash atomicity: SIGKILL a writer at random moments; the store is always at a batch boundary.

A child process (``_crash_child``) applies 200 deterministic batches of 50
events, each with its offset, resuming from the stored offset like a worker
does. The parent kills it with SIGKILL at random points of its progress (right
after the child reported a randomly chosen batch as applied, so the kill lands
somewhere in the batches after it), reopens the store and checks that

* the stored offset ``o`` is a batch boundary, not older than the last batch
  the child reported as applied and at most one batch newer;
* every column family is byte-identical to a store that applied exactly the
  batches before ``o`` in one uninterrupted run;
* nodes, edges, neighbour lists, samples, features and the sampled-by index
  equal the networkx model after those batches.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gnnstream.graph_state.store import GraphStore
from tests.graph_state import _crash_child as child
from tests.graph_state._model import GraphModel, assert_store_matches, raw_contents

REPO = Path(__file__).resolve().parents[2]
END = child.N_BATCHES * child.BATCH_SIZE
MIN_KILLS = 22
NAMES = {"hub", *(f"v{i}" for i in range(60))}


def _digest(store: GraphStore) -> str:
    h = hashlib.sha256()
    for cf, items in raw_contents(store).items():
        h.update(cf.encode())
        for k, v in items:
            h.update(len(k).to_bytes(4, "big") + k + len(v).to_bytes(4, "big") + v)
    return h.hexdigest()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Digest of an uninterrupted in-process store at every batch boundary."""
    stream = child.batches()
    digests = {}
    with GraphStore(tmp_path_factory.mktemp("reference"), seed=child.STORE_SEED) as store:
        store.set_fanouts(child.FANOUTS)
        digests[0] = _digest(store)
        for b, batch in enumerate(stream):
            store.apply(batch, {child.PARTITION: (b + 1) * child.BATCH_SIZE})
            digests[(b + 1) * child.BATCH_SIZE] = _digest(store)
    return digests


def _spawn(path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "tests.graph_state._crash_child", str(path)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_started(proc: subprocess.Popen) -> int:
    line = proc.stdout.readline()
    if not line.startswith("started "):
        proc.kill()
        raise AssertionError(f"child did not start: {line!r} {proc.stderr.read()}")
    return int(line.split()[1])


def _acked(lines: list[str], start: int) -> int:
    acked = start
    for line in lines:
        if line.startswith("applied "):
            acked = int(line.split()[1])
    return acked


def _check(path: Path, acked: int, reference: dict, stream: list) -> int:
    """Reopen the store after a kill and compare it with the reference and the model; return its offset."""
    with GraphStore(path, lock_timeout=5) as store:
        offsets = store.offsets()
        o = offsets.get(child.PARTITION, 0)
        assert set(offsets) <= {child.PARTITION}
        assert o % child.BATCH_SIZE == 0, f"offset {o} is not a batch boundary"
        assert acked <= o <= acked + child.BATCH_SIZE, f"offset {o}, child reported {acked} as applied"
        assert store.seed == child.STORE_SEED and store.fanouts == child.FANOUTS
        assert _digest(store) == reference[o], f"store after kill at offset {o} differs from a clean run"
        model = GraphModel(child.STORE_SEED)
        for batch in stream[:o // child.BATCH_SIZE]:
            model.apply_all(batch)
        assert_store_matches(store, model, NAMES, (1, 3, 10, 40))
    return o


@pytest.mark.slow
@pytest.mark.xdist_group("crash-loops")  # restarts a writer over and over: not beside another loop
def test_sigkill_at_random_moments_leaves_a_batch_boundary(tmp_path, reference):
    rng = random.Random(20240611)
    stream = child.batches()

    # one uninterrupted run finishes cleanly
    path = tmp_path / "clean"
    proc = _spawn(path)
    _wait_started(proc)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and out.rstrip().endswith("finished"), err
    assert _check(path, END, reference, stream) == END

    kills = mid = finished = 0
    offsets_seen = set()
    path, n_dirs = None, 0
    attempts = 0
    while kills < MIN_KILLS and attempts < 3 * MIN_KILLS:
        attempts += 1
        if path is None or rng.random() < 0.5:
            n_dirs += 1
            path = tmp_path / f"db{n_dirs}"
        proc = _spawn(path)
        start = _wait_started(proc)
        # kill by progress, not by time: once the child reported this offset applied, wherever it then is
        target = rng.randrange(start, END, child.BATCH_SIZE)
        acked = start
        while acked < target:
            line = proc.stdout.readline()
            if not line:  # the child ended early: communicate() below tells how
                break
            if line.startswith("applied "):
                acked = int(line.split()[1])
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        # the rest through the same text streams: lines readline() buffered are in them, not in the pipe
        out, err = proc.stdout.read(), proc.stderr.read()
        proc.wait(timeout=60)
        # the child may finish between poll() and kill(): then it exited cleanly
        alive = proc.returncode == -signal.SIGKILL
        if alive:
            kills += 1
        else:
            assert proc.returncode == 0, err
            finished += 1
        o = _check(path, _acked(out.splitlines(), acked) if alive else END, reference, stream)
        assert o >= start
        offsets_seen.add(o)
        if start < o < END:
            mid += 1
        if o == END:
            path = None  # nothing left to resume
    print(f"crash test: {kills} kills ({mid} strictly mid-stream, {len(offsets_seen)} distinct offsets), "
          f"{finished} runs finished first, {n_dirs} stores")
    assert kills >= MIN_KILLS, f"only {kills} kills landed while the child ran ({finished} runs finished first)"
    assert mid >= MIN_KILLS // 2, f"only {mid} kills left the store strictly mid-stream"
    assert len(offsets_seen) >= MIN_KILLS // 2, f"kills clustered on too few offsets: {sorted(offsets_seen)}"


class _Killed(BaseException):
    """Stands for the process dying at this point."""


class _DiesOnWrite:
    """Wraps the RocksDB handle; the first WriteBatch write "kills the process" before it lands."""

    def __init__(self, db):
        self._real = db

    def write(self, *args, **kwargs):
        raise _Killed

    def __getattr__(self, name):
        return getattr(self._real, name)


def test_set_fanouts_interrupted_leaves_a_consistent_index(tmp_path):
    """A crash inside ``set_fanouts`` must not leave a sampled-by index that contradicts the stored fanouts.

    Fails today: ``set_fanouts`` first deletes the whole sampled-by index with a
    direct ``delete_range`` and only then writes the rebuilt index and the new
    fanouts in later WriteBatches. Dying in between leaves ``fanouts`` at the
    old value with an empty (or partial) index, and nothing ever rebuilds it:
    ``set_fanouts(old)`` is a no-op because the fanouts look unchanged.
    """
    path = tmp_path / "db"
    stream = child.batches()[:40]
    store = GraphStore(path, seed=child.STORE_SEED)
    store.set_fanouts(child.FANOUTS)
    for b, batch in enumerate(stream):
        store.apply(batch, {child.PARTITION: (b + 1) * child.BATCH_SIZE})
    real = store._db
    store._db = _DiesOnWrite(real)
    with pytest.raises(_Killed):
        store.set_fanouts((*child.FANOUTS, 25))
    store._db = real
    store.close()

    model = GraphModel(child.STORE_SEED)
    for batch in stream:
        model.apply_all(batch)
    with GraphStore(path, lock_timeout=5) as store:
        store.set_fanouts(child.FANOUTS)  # the operator restarts with the old configuration
        assert store.fanouts == child.FANOUTS
        assert_store_matches(store, model, NAMES, child.FANOUTS)
