"""``gnnstream snapshot``: a copy of a state directory that a new worker can start from, also while a
process holds the state open and writes it.

A writer (in this process for a closed state, else a child process: run this
module with ``python -m tests.graph_state.test_snapshot STATE MODEL``) applies
a deterministic event stream batch by batch, each batch with its offset, and
recomputes the embeddings after each, like ``gnnstream apply`` and the worker.
The child reads commands on stdin (``run N``: apply batches until N events are
stored; ``stop``) and prints ``applied N`` after each committed batch, so the
tests place every snapshot by the child's progress, never by time.

Every copy must hold whole batches: its stored offset ``O`` says how many
events, its graph equals that of a fresh store given exactly the first ``O``
events (byte for byte in the graph's column families, and against the
networkx model of ``_model.py``), and once an engine has opened it and done the
work it holds (the writer's dirty marks, and the rows whose frames changed
while the row files were copied), ``verify`` finds every stored final embedding
equal to a from-scratch computation to 1e-4. Copies whose row files are newer
or older than their RocksDB part are built on purpose (a snapshot whose row
files are copied while the child commits more batches, copies that swap
the row files of two snapshots, and copies whose row files are shorter than
their pages need, or missing), and must end exact too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
from rocksdict import Options, Rdict

from gnnstream.graph_state import snapshot as snapshot_module
from gnnstream.graph_state.exceptions import SnapshotTargetError, StateNotADirectoryError, StateNotFoundError
from gnnstream.graph_state.snapshot import snapshot
from gnnstream.graph_state.store import GraphStore
from gnnstream.model import init_model_dir, load_model_dir
from tests.graph_state._events import DIM, random_batches
from tests.graph_state._model import GraphModel, assert_store_matches, raw_contents
from gnnstream.workers.engine import Engine
from gnnstream.workers.offline.jobs import verify
from gnnstream.graph_state.page_log import PageLog

REPO = Path(__file__).resolve().parents[2]
N_NODES = 400  # several pages of 128 records per layer, so frames are released and reused
BATCH = 40
STREAM_SEED = 4242
MAX_BATCHES = 80  # the stream a writer draws from: 3,200 events at most
PARTITION = ("events", 0)
NAMES = {"hub", *(f"v{i}" for i in range(N_NODES))}
GRAPH_FAMILIES = ("ids", "names", "nodes", "feats", "edges", "nbrs", "sampled", "offsets")
ATOL = 1e-4


def _stream() -> list[list]:
    return random_batches(STREAM_SEED, MAX_BATCHES, BATCH, n_nodes=N_NODES)


# ---------------------------------------------------------------------- the writer
def _open_writer(state: str, model_dir: str) -> tuple[GraphStore, Engine]:
    model = load_model_dir(model_dir)
    store = GraphStore(state, seed=model.config.seed)
    try:
        engine = Engine(store, model)
        if engine.needs_backfill():
            engine.backfill()
    except BaseException:
        store.close()
        raise
    return store, engine


def _apply_until(store: GraphStore, engine: Engine, stream: list[list], events: int,
                 report=lambda applied: None) -> int:
    """Apply the stream's batches (one WriteBatch each, with the offset) and recompute after each, until
    ``events`` are stored; returns the number stored."""
    done = store.offsets().get(PARTITION, 0)
    assert done % BATCH == 0, f"stored offset {done} is not a batch boundary"
    while done < events:
        result = store.apply(stream[done // BATCH], {PARTITION: done + BATCH})
        engine.recompute(event_ts=result.max_ts)
        done += BATCH
        report(done)
    return done


def _child_main(state: str, model_dir: str) -> None:
    stream = _stream()
    store, engine = _open_writer(state, model_dir)
    print(f"open {store.offsets().get(PARTITION, 0)}", flush=True)
    for line in sys.stdin:
        command = line.split()
        if command == ["stop"]:
            break
        assert command[0] == "run", command
        _apply_until(store, engine, stream, int(command[1]), lambda n: print(f"applied {n}", flush=True))
    store.close()
    print("closed", flush=True)


class _Child:
    """A child process holding ``state`` open, writing when told to (see the module docstring)."""

    def __init__(self, state: Path, model_dir: str, log: Path):
        self._log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.graph_state.test_snapshot", str(state), model_dir],
                                     cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True)
        self.log = log
        word, number = self._line().split()
        assert word == "open", word
        self.applied = self.target = int(number)

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the child exited (status {self.proc.wait()}): {self.log.read_text()[-3000:]}")
        return line.strip()

    def run_to(self, events: int) -> None:
        """Let the child apply batches until ``events`` are stored (it goes on in the background)."""
        self.target = max(self.target, events)
        self.proc.stdin.write(f"run {self.target}\n")
        self.proc.stdin.flush()

    def wait_for(self, events: int) -> None:
        """Until the child reports ``events`` (or more) committed."""
        assert events <= self.target
        while self.applied < events:
            word, number = self._line().split()
            assert word == "applied", word
            self.applied = int(number)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("stop\n")
            self.proc.stdin.flush()
            while self._line() != "closed":
                pass
        assert self.proc.wait(timeout=120) == 0, self.log.read_text()[-3000:]
        self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


# ---------------------------------------------------------------------- fixtures and checks
def _tempdir() -> tempfile.TemporaryDirectory:
    """A temporary directory on tmpfs when there is one (RocksDB opens and closes much faster there)."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.TemporaryDirectory(dir=root, prefix="gnnstream-snapshot-")


@pytest.fixture
def work() -> Iterator[Path]:
    with _tempdir() as d:
        yield Path(d)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("model") / "sage"
    init_model_dir(str(d), arch="sage", in_dim=DIM, hidden=16, out_dim=8, layers=2, fanouts=[10, 5], seed=0)
    return str(d)


def _logs(store: GraphStore, layers: int) -> list[PageLog]:
    return [PageLog(store)] + [PageLog(store, family="layerpages", prefix=bytes((l,)), rows_name=f"layer{l}-rows")
                                 for l in range(1, layers)]


def _row_files(state: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(state.glob("*-rows-*.f32"))}


def _fresh_graph(path: Path, events: int, fanouts: tuple[int, ...]) -> dict[str, list]:
    """The graph families of a fresh store given exactly the first ``events`` events, batch by batch."""
    stream = _stream()
    try:
        with GraphStore(path, seed=0) as store:
            store.set_fanouts(fanouts)
            for b in range(events // BATCH):
                store.apply(stream[b], {PARTITION: (b + 1) * BATCH})
            raw = raw_contents(store)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return {cf: raw[cf] for cf in GRAPH_FAMILIES}


def _check_copy(copy: Path, model_dir: str, scratch: Path) -> dict[str, int]:
    """Check a snapshot (see the module docstring) and finish the work it holds; returns its stored offset,
    the rows whose frames failed their check, and the dirty marks it held."""
    with GraphStore(copy) as store:
        offsets = store.offsets()
        assert set(offsets) == {PARTITION}
        held = offsets[PARTITION]
        assert held % BATCH == 0 and 0 < held <= MAX_BATCHES * BATCH, held
        # the graph: that of a fresh store given exactly the first `held` events
        raw = raw_contents(store)
        fresh = _fresh_graph(scratch / f"fresh-{copy.name}", held, store.fanouts)
        for cf in GRAPH_FAMILIES:
            assert raw[cf] == fresh[cf], f"column family {cf!r} of {copy.name} differs from a fresh store at {held}"
        model = GraphModel(seed=store.seed).apply_all(ev for batch in _stream()[:held // BATCH] for ev in batch)
        assert_store_matches(store, model, NAMES, store.fanouts)
        # the rows: frames that no longer hold what their page records say (copied while being rewritten)
        damaged = sum(len(log.damaged()) for log in _logs(store, 2))
        pending = store.dirty_count()
        engine = Engine(store, load_model_dir(model_dir))  # marks the damaged rows for recomputing
        assert engine.pending() >= (1 if damaged else 0)
        engine.drain()
        assert engine.pending() == 0
        assert sum(len(log.damaged()) for log in _logs(store, 2)) == 0
    summary = verify(str(copy), model_dir, atol=ATOL)
    assert summary["status"] == "ok", summary
    assert summary["max_abs_error"] <= ATOL and summary["damaged_rows"] == 0 and summary["nodes"] > 0, summary
    return {"offset": held, "damaged": damaged, "pending": pending}


# ---------------------------------------------------------------------- (a) a closed state
def test_snapshot_of_a_closed_state_is_an_exact_copy(work: Path, model_dir: str) -> None:
    state = work / "state"
    store, engine = _open_writer(str(state), model_dir)
    try:
        _apply_until(store, engine, _stream(), 12 * BATCH)
        assert engine.pending() == 0
    finally:
        store.close()
    with GraphStore(state) as store:
        before = raw_contents(store)
        nodes, edges = sorted(store.nodes()), sorted(store.edges())
    rows = _row_files(state)
    assert rows, "the state should have row files"
    listing = sorted(os.listdir(state))

    summary = snapshot(state, work / "copy")

    assert summary["offsets"] == {"events:0": 12 * BATCH}
    assert summary["pending_dirty"] == 0
    assert summary["records"] == sum(len(items) for items in before.values())
    assert set(rows) <= set(summary["files"])
    assert summary["bytes"] == sum(p.stat().st_size for p in (work / "copy").iterdir() if p.is_file())
    assert summary["seconds"] >= 0
    assert json.loads(json.dumps(summary)) == summary
    assert sorted(os.listdir(work)) == ["copy", "state"]  # no temporary directory left beside it
    assert sorted(os.listdir(state)) == listing  # nothing written to the state

    assert _row_files(work / "copy") == rows
    with GraphStore(work / "copy") as copy:
        assert raw_contents(copy) == before  # every record of every column family
        assert copy.offsets() == {PARTITION: 12 * BATCH}
        assert sorted(copy.nodes()) == nodes and sorted(copy.edges()) == edges
        assert sum(len(log.damaged()) for log in _logs(copy, 2)) == 0
    summary = verify(str(work / "copy"), model_dir, atol=ATOL)
    assert summary["status"] == "ok" and summary["max_abs_error"] <= ATOL, summary

    # a new writer resumes from the copy's offsets and keeps it exact
    store, engine = _open_writer(str(work / "copy"), model_dir)
    try:
        assert store.offsets() == {PARTITION: 12 * BATCH}
        _apply_until(store, engine, _stream(), 15 * BATCH)
    finally:
        store.close()
    assert _check_copy(work / "copy", model_dir, work)["offset"] == 15 * BATCH


# ---------------------------------------------------------------------- (b) beside a writing child
@pytest.fixture(scope="module")
def live(model_dir: str) -> Iterator[dict]:
    """Snapshots of a state a child process holds open: ``s1`` while it is idle after exactly 10 batches,
    ``s2`` while it writes (row files copied after it committed three more batches than the RocksDB part
    can hold), ``s4`` and ``s5`` while it writes, ``s3`` of the state it closed. Tests copy them before
    changing them."""
    with _tempdir() as d:
        work = Path(d)
        state = work / "live"
        child = _Child(state, model_dir, work / "child.log")
        try:
            child.run_to(10 * BATCH)
            child.wait_for(10 * BATCH)
            s1 = snapshot(state, work / "s1")
            assert s1["offsets"] == {"events:0": 10 * BATCH}

            copying = snapshot_module._copy_files
            during: dict[str, int] = {}

            def rows_copied_late(source: str, dest: str) -> list[str]:
                during["before"] = child.target  # the child never goes past its target
                child.run_to(child.target + 3 * BATCH)
                child.wait_for(child.target)
                during["after"] = child.applied
                return copying(source, dest)

            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(snapshot_module, "_copy_files", rows_copied_late)
                child.run_to(30 * BATCH)  # the child is writing while the snapshot opens and reads the state
                s2 = snapshot(state, work / "s2")
            # s4, s5: two more, back to back, while the child applies twelve batches more
            child.run_to(child.target + 12 * BATCH)
            others = [snapshot(state, work / name)["offsets"]["events:0"] for name in ("s4", "s5")]
            child.wait_for(child.target)
            final = child.target
        finally:
            child.stop() if child.proc.poll() is None else child.kill()
        s3 = snapshot(state, work / "s3")
        yield {"dir": work, "s2": s2["offsets"]["events:0"], "during": during, "final": final,
               "s3": s3["offsets"]["events:0"], "s4": others[0], "s5": others[1]}


def _copy_of(live: dict, name: str, dest: Path, rows_from: str | None = None) -> Path:
    """A copy of snapshot ``name``; with ``rows_from``, its row files are those of that snapshot instead."""
    shutil.copytree(live["dir"] / name, dest)
    if rows_from is not None:
        for path in dest.glob("*-rows-*.f32"):
            path.unlink()
        for file, data in _row_files(live["dir"] / rows_from).items():
            (dest / file).write_bytes(data)
    return dest


def test_snapshots_beside_a_writing_child_end_exact(live: dict, work: Path, model_dir: str) -> None:
    held, during, final = live["s2"], live["during"], live["final"]
    assert 10 * BATCH <= held <= during["before"] < during["after"] <= final  # rows copied >= 3 batches later
    assert live["s3"] == final >= 45 * BATCH
    assert during["after"] <= live["s4"] <= live["s5"] <= final

    results = {name: _check_copy(_copy_of(live, name, work / name), model_dir, work)
               for name in ("s1", "s2", "s3", "s4", "s5")}
    assert results["s4"]["offset"] == live["s4"] and results["s5"]["offset"] == live["s5"]
    assert results["s1"] == {"offset": 10 * BATCH, "damaged": 0, "pending": 0}  # the child was idle: rows agree
    assert results["s2"]["offset"] == held
    assert results["s3"] == {"offset": final, "damaged": 0, "pending": 0}

    # a worker started on s2 resumes from s2's stored offset
    resumed = _Child(work / "s2", model_dir, work / "resumed.log")
    try:
        assert resumed.applied == held
        resumed.run_to(held + 4 * BATCH)
        resumed.wait_for(held + 4 * BATCH)
    finally:
        resumed.stop() if resumed.proc.poll() is None else resumed.kill()
    assert _check_copy(work / "s2", model_dir, work)["offset"] == held + 4 * BATCH


def test_row_files_newer_or_older_than_the_database_end_exact(live: dict, work: Path, model_dir: str) -> None:
    """Row files at least 35 batches newer (s1's RocksDB part, s3's rows), and as much older (s3's RocksDB part,
    s1's rows, each file as long as s3's: frames the older file did not reach yet read as zeros, as in a file
    grown with fallocate)."""
    newer = _copy_of(live, "s1", work / "newer", rows_from="s3")
    older = _copy_of(live, "s3", work / "older", rows_from="s1")
    for path in older.glob("*-rows-*.f32"):
        with open(path, "r+b") as fh:
            fh.truncate((live["dir"] / "s3" / path.name).stat().st_size)
    assert _check_copy(newer, model_dir, work)["offset"] == 10 * BATCH
    assert _check_copy(older, model_dir, work)["offset"] == live["final"]
    # both had rows that failed their check (asserted apart so that a failure names the case)
    assert _damaged_before(live, "s1", "s3", work / "newer-count") > 0
    assert _damaged_before(live, "s3", "s1", work / "older-count", pad=True) > 0


def _damaged_before(live: dict, name: str, rows_from: str, dest: Path, pad: bool = False) -> int:
    copy = _copy_of(live, name, dest, rows_from=rows_from)
    if pad:
        for path in copy.glob("*-rows-*.f32"):
            with open(path, "r+b") as fh:
                fh.truncate((live["dir"] / name / path.name).stat().st_size)
    with GraphStore(copy) as store:
        return sum(len(log.damaged()) for log in _logs(store, 2))


@pytest.mark.parametrize("rows", ["shorter", "missing"])
def test_row_files_shorter_than_the_database_needs(live: dict, work: Path, model_dir: str, rows: str) -> None:
    """s3's RocksDB part with s1's row files as they were (shorter), or with none: the engine finds the pages
    it cannot read damaged and rewrites them. ``snapshot`` never makes such a copy while the writer runs (row
    files only grow, and are copied after the RocksDB part is read); a copy made the other way round (row
    files first) or a backfill of another model dropping a row file while a snapshot runs could."""
    copy = _copy_of(live, "s3", work / rows, rows_from="s1")
    if rows == "missing":
        for path in copy.glob("*-rows-*.f32"):
            path.unlink()
    _check_copy(copy, model_dir, work)


# ---------------------------------------------------------------------- (c) refusals
@pytest.fixture
def closed_state(work: Path) -> Path:
    """A small graph-only state (no engine), closed."""
    state = work / "state"
    with GraphStore(state, seed=0) as store:
        store.set_fanouts((10, 5))
        store.apply(_stream()[0], {PARTITION: BATCH})
    return state


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_refuses_a_target_that_is_not_new_or_empty(work: Path, closed_state: Path) -> None:
    busy = work / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    (work / "file").write_text("a file")
    before = _listing(work)
    with pytest.raises(SnapshotTargetError, match="exists and is not empty"):
        snapshot(closed_state, busy)
    with pytest.raises(SnapshotTargetError, match="exists and is not a directory"):
        snapshot(closed_state, work / "file")
    with pytest.raises(SnapshotTargetError, match="inside the state"):
        snapshot(closed_state, closed_state / "copy")
    assert _listing(work) == before  # nothing written: no copy, no temporary directory, state untouched
    assert (busy / "keep.txt").read_text() == "mine"

    empty = work / "empty"
    empty.mkdir()
    assert snapshot(closed_state, empty)["offsets"] == {"events:0": BATCH}  # an empty directory is taken
    with GraphStore(empty) as store:
        assert store.offsets() == {PARTITION: BATCH}


def test_refuses_what_is_not_a_state(work: Path) -> None:
    (work / "empty").mkdir()
    (work / "file").write_text("x")
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    plain = Rdict(str(work / "plain"), options=options)  # RocksDB, but not a graph store
    plain[b"k"] = b"v"
    plain.close()
    before = _listing(work)
    with pytest.raises(StateNotFoundError, match="does not exist"):
        snapshot(work / "missing", work / "out")
    with pytest.raises(StateNotFoundError, match="no RocksDB CURRENT file"):
        snapshot(work / "empty", work / "out")
    with pytest.raises(StateNotADirectoryError, match="is a file"):
        snapshot(work / "file", work / "out")
    with pytest.raises(StateNotFoundError, match="not a gnnstream state"):
        snapshot(work / "plain", work / "out")
    assert _listing(work) == before


def test_a_failed_snapshot_leaves_nothing(work: Path, closed_state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(source: str, dest: str) -> list[str]:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snapshot_module, "_copy_files", fail)
    before = _listing(work)
    with pytest.raises(OSError, match="No space left"):
        snapshot(closed_state, work / "out")
    assert _listing(work) == before


# ---------------------------------------------------------------------- the command
def test_command(work: Path, closed_state: Path) -> None:
    from tests.workers.reference import call_gnnstream  # not at the top: the child process needs no PyG
    done = call_gnnstream("snapshot", "--state", closed_state, "--out", work / "copy")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["offsets"] == {"events:0": BATCH} and summary["out"] == str(work / "copy")

    again = call_gnnstream("snapshot", "--state", closed_state, "--out", work / "copy")
    assert again.returncode == 2 and again.stdout == ""
    assert again.stderr.startswith("gnnstream: error: snapshot target") and again.stderr.count("\n") == 1
    missing = call_gnnstream("snapshot", "--state", work / "missing", "--out", work / "other")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "does not exist" in missing.stderr

    text = " ".join(call_gnnstream("snapshot", "--help").stdout.split())
    assert "beside a running worker" in text and "resumes from the copy's stored offsets" in text


if __name__ == "__main__":
    _child_main(sys.argv[1], sys.argv[2])
