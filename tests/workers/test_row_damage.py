"""Row files holding NaN or garbage are repaired by the next ``apply`` (issue 19).

Embedding rows live in frames of the row files (``final-rows-<dim>.f32``,
``layer<l>-rows-<dim>.f32``); each page record keeps a sum of its rows, and
an engine checks every live frame when it starts. A good state is built once
with the real ``gnnstream apply``; each test copies it, overwrites rows of one
live page (NaN, or seeded random bytes) in the final or the intermediate
layer's row file, or only a superseded slot beside intact live rows, and
runs ``apply`` on an empty event file. The damaged frame must be found and
every record of its page written again, so that no frame fails its check any
more, ``verify`` passes and the exported embeddings equal the independent
PyG reference, with no NaN among them.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from gnnstream.graph_state.store import GraphStore
from gnnstream.model import init_model_dir
from tests.workers.reference import (assert_embeddings_close, call_gnnstream, fast_tempdir, fold_jsonl,
                                     reference_embeddings)
from gnnstream.graph_state.codecs import PAGE_ROWS
from gnnstream.graph_state.page_log import PageLog

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

NODES = 1_500
EDGES = 8_000
SEED = 23
DAMAGE_NOTE = "did not match their page records"


def _write_events(path: Path) -> None:
    """A deterministic stream: every node with 8 features, random edges, then new features for some nodes
    (so that pages are superseded in part and live pages hold superseded slots)."""
    rng = random.Random(SEED)
    ts = 0
    lines = []
    for i in range(NODES):
        ts += 1
        lines.append({"op": "node_upsert", "id": f"n{i}", "ts": ts, "features": [round(rng.uniform(-1, 1), 4)
                                                                                   for _ in range(8)]})
    for _ in range(EDGES):
        ts += 1
        a, b = rng.randrange(NODES), rng.randrange(NODES)
        lines.append({"op": "edge_upsert", "src": f"n{a}", "dst": f"n{b}", "ts": ts, "weight": 1.0})
    for i in rng.sample(range(NODES), NODES // 10):
        ts += 1
        lines.append({"op": "node_upsert", "id": f"n{i}", "ts": ts, "features": [round(rng.uniform(-1, 1), 4)
                                                                                   for _ in range(8)]})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    with fast_tempdir() as d:
        yield Path(d)


@pytest.fixture(scope="module")
def good(work: Path) -> Path:
    events = work / "events.jsonl"
    _write_events(events)
    (work / "empty.jsonl").write_text("")
    init_model_dir(work / "model", arch="sage", in_dim=8, hidden=16, out_dim=8, layers=2, fanouts=[10, 5], seed=0)
    done = call_gnnstream("apply", "--state", work / "good", "--model", work / "model", events, "--batch", 500)
    assert done.returncode == 0, done.stderr[-3000:]
    return work / "good"


@pytest.fixture(scope="module")
def reference(work: Path, good: Path) -> dict[str, np.ndarray]:
    fold = fold_jsonl(work / "events.jsonl")
    return reference_embeddings(fold.nodes, fold.edges, fold.features, work / "model")


def _logs(store: GraphStore) -> dict[str, PageLog]:
    return {"final": PageLog(store),
            "layer1": PageLog(store, family="layerpages", prefix=bytes((1,)), rows_name="layer1-rows")}


def _damage(state: Path, layer: str, kind: str) -> int:
    """Overwrite rows of one live page of ``layer``: for ``nan`` and ``garbage`` (seeded random bytes) three
    of its live rows, in the page with the most live records; for ``superseded``, random bytes in one
    superseded slot of a page that still has live records (its live rows stay intact). Returns the number of
    live records of that page."""
    with GraphStore(state) as store:
        log = _logs(store)[layer]
        log._load()
        framed = [seq for seq in log._live if seq in log._frame_of]
        if kind == "superseded":
            framed = [seq for seq in framed if log._live[seq] < log._size[seq]]
        assert framed, f"the good state should have a live page of {layer} fit for {kind} damage"
        seq = max(framed, key=lambda s: (log._live[s], s))
        width, frame = log._frame_of[seq]
        path = log._file(width).path
        live = np.sort(log.slot[(log.page == seq) & log.has_row]).tolist()
        dead = sorted(set(range(log._size[seq])) - set(live))
        log.clear()
    slots = dead[len(dead) // 2:][:1] if kind == "superseded" else sorted({live[0], live[len(live) // 2], live[-1]})
    rows = np.memmap(path, dtype="<f4", mode="r+")
    rng = np.random.default_rng(SEED)
    for slot in slots:
        at = (frame * PAGE_ROWS + slot) * width
        if kind == "nan":
            rows[at:at + width] = np.nan
        else:
            rows[at:at + width] = rng.integers(0, 1 << 32, width, dtype=np.uint64).astype(np.uint32).view("<f4")
    rows.flush()
    del rows
    return len(live)


def _damaged_pages(state: Path) -> dict[str, int]:
    with GraphStore(state) as store:
        return {name: len(log.damaged()) for name, log in _logs(store).items()}


@pytest.mark.parametrize("layer, kind", [("final", "nan"), ("final", "garbage"), ("layer1", "nan"),
                                         ("layer1", "garbage"), ("final", "superseded")])
def test_damaged_rows_are_recomputed_by_the_next_apply(good: Path, work: Path, reference: dict, layer: str,
                                                       kind: str) -> None:
    with fast_tempdir() as d:
        tmp = Path(d)
        state = tmp / "state"
        shutil.copytree(good, state)
        live = _damage(state, layer, kind)
        assert _damaged_pages(state)[layer] == live  # the check finds every record of the damaged page

        done = call_gnnstream("apply", "--state", state, work / "empty.jsonl")
        assert done.returncode == 0, done.stderr[-3000:]
        assert DAMAGE_NOTE in done.stderr, done.stderr[-3000:]
        assert json.loads(done.stdout)["pending"] == 0
        assert _damaged_pages(state) == {"final": 0, "layer1": 0}, "the damaged frame is still in use"

        verified = call_gnnstream("verify", "--state", state)
        assert verified.returncode == 0, verified.stdout + verified.stderr[-3000:]
        summary = json.loads(verified.stdout)
        assert summary["ok"] is True and summary["pending_dirty"] == 0, summary

        export = tmp / "emb.jsonl"
        exported = call_gnnstream("embeddings", "--state", state, "--out", export)
        assert exported.returncode == 0, exported.stderr[-3000:]
        records = [json.loads(line) for line in export.read_text().splitlines()]
        got = {r["id"]: np.asarray(r["embedding"], dtype=np.float64) for r in records}
        assert len(records) == len(got) == len(reference)
        assert all(np.isfinite(v).all() for v in got.values()), "an exported embedding holds NaN or inf"
        assert_embeddings_close(got, reference, what=f"{layer} rows with {kind}, after apply")

        again = call_gnnstream("apply", "--state", state, work / "empty.jsonl")
        assert again.returncode == 0 and DAMAGE_NOTE not in again.stderr, again.stderr[-3000:]
