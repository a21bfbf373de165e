"""A damaged state is an error, never a short read (issue 19).

A good state is built once with the real ``gnnstream apply`` (a synthetic
stream of 3,000 nodes and 20,000 edges, so that every family that matters has
a table file of tens to hundreds of KB). Each test copies it and damages one
file the way a bad disk or a careless copy would: 4 KB of seeded random bytes
in the middle of the table file of one column family, or a MANIFEST cut
short. Every command that reads the damaged file must then exit non-zero
with one line that names the file and says what to do; none may exit 0 with
a short result, and a cut MANIFEST must not cost the state its table files.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from gnnstream.graph_state.exceptions import GraphStateError, StateCorrupted
from gnnstream.graph_state.db import MANIFEST_RECORD
from gnnstream.graph_state.store import GraphStore
from gnnstream.model import init_model_dir
from tests.workers.reference import call_gnnstream, fast_tempdir

NODES = 3_000
EDGES = 20_000
SEED = 19
REMEDY = ("restore a snapshot of the state directory", "`gnnstream graph load`", "`gnnstream backfill`")


def _write_events(path: Path) -> None:
    """A deterministic stream: every node with 8 features, then random edges between them."""
    rng = random.Random(SEED)
    ts = 0
    with open(path, "w") as fh:
        for i in range(NODES):
            ts += 1
            feats = [round(rng.uniform(-1, 1), 4) for _ in range(8)]
            fh.write(json.dumps({"op": "node_upsert", "id": f"n{i}", "ts": ts, "features": feats}) + "\n")
        for _ in range(EDGES):
            ts += 1
            a, b = rng.randrange(NODES), rng.randrange(NODES)
            fh.write(json.dumps({"op": "edge_upsert", "src": f"n{a}", "dst": f"n{b}", "ts": ts, "weight": 1.0}) + "\n")


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    with fast_tempdir() as d:
        yield Path(d)


@pytest.fixture(scope="module")
def good(work: Path) -> Path:
    """A closed, verified state (``work/good``), its model (``work/model``) and an empty event file."""
    events = work / "events.jsonl"
    _write_events(events)
    (work / "empty.jsonl").write_text("")
    init_model_dir(work / "model", arch="sage", in_dim=8, hidden=16, out_dim=8, layers=2, fanouts=[10, 5], seed=0)
    done = call_gnnstream("apply", "--state", work / "good", "--model", work / "model", events)
    assert done.returncode == 0, done.stderr[-3000:]
    return work / "good"


def _tables(state: Path, family: str) -> list[tuple[str, int]]:
    """``(file name, bytes)`` of the live table files of one column family."""
    with GraphStore(state) as store:
        listing = store.column(family).property_value("rocksdb.sstables")
    return [(f"{int(number):06d}.sst", int(size)) for number, size in re.findall(r"^\s*(\d+):(\d+)\[", listing, re.M)]


def _damaged_copy(good: Path, tmp: Path) -> Path:
    state = tmp / "state"
    shutil.copytree(good, state)
    return state


def _scramble(path: Path) -> None:
    """4 KB of seeded random bytes in the middle of the file (data blocks come first in a table file)."""
    size = path.stat().st_size
    assert size > 16_384, f"{path} holds {size} bytes: too small to hit a data block in its middle"
    with open(path, "r+b") as fh:
        fh.seek(size // 2 - 2048)
        fh.write(random.Random(SEED).randbytes(4096))


def _assert_one_line_error(done: subprocess.CompletedProcess, damaged: str, what: str) -> None:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0, f"{what} exited 0 on a damaged state: stdout {done.stdout[-1500:]!r}"
    assert len(lines) == 1 and lines[0].startswith("gnnstream: error: "), f"{what}: {done.stderr[-3000:]}"
    assert damaged in lines[0], f"{what} does not name {damaged}: {lines[0]}"
    assert all(part in lines[0] for part in REMEDY), f"{what} does not say what to do: {lines[0]}"
    assert done.stdout.strip() == "", f"{what} printed a result: {done.stdout[-1500:]}"


def test_the_good_state_verifies(good: Path) -> None:
    done = call_gnnstream("verify", "--state", good)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert json.loads(done.stdout)["ok"] is True
    assert json.loads((good / MANIFEST_RECORD).read_text())["manifest"] == (good / "CURRENT").read_text().strip()


# The commands that read each family: nbrs (neighbour lists) for samples, embpages for the stored embeddings,
# nodes for the node list, sampled for the sampled-by index every engine loads.
READERS = {
    "nbrs": [("backfill", "--model", "{model}"), ("verify",)],
    "embpages": [("embeddings", "--out", "{out}"), ("verify",), ("apply", "{empty}"), ("backfill", "--model", "{model}")],
    "nodes": [("verify",), ("backfill", "--model", "{model}")],
    "sampled": [("apply", "{empty}"), ("verify",)],
}


@pytest.mark.parametrize("family", list(READERS))
def test_a_damaged_table_file_fails_every_command_that_reads_it(good: Path, work: Path, family: str) -> None:
    with fast_tempdir() as d:
        tmp = Path(d)
        state = _damaged_copy(good, tmp)
        name, _ = max(_tables(state, family), key=lambda t: t[1])
        _scramble(state / name)
        for command, *rest in READERS[family]:
            args = [a.format(model=work / "model", out=tmp / "emb.jsonl", empty=work / "empty.jsonl") for a in rest]
            done = call_gnnstream(command, "--state", state, *args)
            _assert_one_line_error(done, name, f"{command} with {family}'s {name} damaged")


def test_scans_of_a_damaged_family_raise_instead_of_ending_early(good: Path) -> None:
    with fast_tempdir() as d:
        state = _damaged_copy(good, Path(d))
        name, _ = max(_tables(state, "nbrs"), key=lambda t: t[1])
        _scramble(state / name)
        with GraphStore(state) as store:
            family = store.column("nbrs")
            for scan in (family.items, family.keys, family.values, lambda: family.items(from_key=b"\x00" * 8),
                         lambda: family.keys(backwards=True), lambda: iter(family)):
                with pytest.raises(StateCorrupted, match=re.escape(name)):
                    sum(1 for _ in scan())
            with pytest.raises(StateCorrupted, match=re.escape(name)):
                for node in store.nodes():
                    store.neighbors(node)


def test_checked_scans_read_what_rocksdict_reads(good: Path) -> None:
    with fast_tempdir() as d:
        state = _damaged_copy(good, Path(d))
        with GraphStore(state) as store:
            for name in ("nbrs", "embpages", "layerpages", "offsets", "meta"):
                family, view = store.column(name), store.column(name).view
                every = list(view.items())
                assert every, name
                middle = every[len(every) // 2][0]
                assert list(family.items()) == every
                assert list(family.keys()) == [k for k, _ in every]
                assert list(family.values()) == [v for _, v in every]
                assert list(family) == [k for k, _ in every]
                assert list(family.items(from_key=middle)) == list(view.items(from_key=middle))
                assert list(family.keys(backwards=True)) == list(view.keys(backwards=True))
                assert list(family.items(backwards=True, from_key=middle)) == list(
                    view.items(backwards=True, from_key=middle))
                assert family.get(middle) == view.get(middle) and middle in family and family[middle] == view[middle]


def _cut_manifest(state: Path, keep: str) -> tuple[str, int]:
    name = (state / "CURRENT").read_text().strip()
    manifest = state / name
    size = {"100 bytes": 100, "half": manifest.stat().st_size // 2}[keep]
    os.truncate(manifest, size)
    return name, size


@pytest.mark.parametrize("keep, record", [("100 bytes", True), ("half", True), ("100 bytes", False)])
def test_a_cut_manifest_is_refused_and_costs_no_table_file(good: Path, work: Path, keep: str, record: bool) -> None:
    """RocksDB opens a MANIFEST cut in the middle as if the state were older and deletes the table files the
    lost part named; with the record of the last close the cut is refused first. Without the record (an older
    state), a cut that leaves RocksDB nothing to read is still its one-line error."""
    with fast_tempdir() as d:
        tmp = Path(d)
        state = _damaged_copy(good, tmp)
        if not record:
            (state / MANIFEST_RECORD).unlink()
        name, size = _cut_manifest(state, keep)
        tables = sorted(p.name for p in state.glob("*.sst"))
        assert tables
        for command, *args in [("apply", work / "empty.jsonl"), ("verify",), ("embeddings", "--out", tmp / "e.jsonl")]:
            done = call_gnnstream(command, "--state", state, *args)
            _assert_one_line_error(done, name, f"{command} with {name} cut to {keep}")
        assert sorted(p.name for p in state.glob("*.sst")) == tables, "table files were deleted"
        assert (state / name).stat().st_size == size


def test_opening_a_cut_manifest_raises_state_corrupted(good: Path) -> None:
    with fast_tempdir() as d:
        state = _damaged_copy(good, Path(d))
        name, _ = _cut_manifest(state, "half")
        with pytest.raises(StateCorrupted, match=re.escape(name)) as caught:
            GraphStore(state, lock_timeout=1)
        assert isinstance(caught.value, GraphStateError) and "\n" not in str(caught.value)
        (state / "CURRENT").unlink()  # table files without the file that names their MANIFEST
        with pytest.raises(StateCorrupted, match="CURRENT"):
            GraphStore(state, lock_timeout=1)
        assert list(state.glob("*.sst"))
