"""Offline jobs over a state directory: load, apply, backfill, export, verify.

Each function opens what it needs, reports progress with a bar on stderr and
returns a JSON-ready summary; :mod:`workers.cli` maps them to commands.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, TextIO

import numpy as np
from tqdm import tqdm

from graph_state.store import GraphStore
from model import LoadedModel, load_model_dir
from stream.events import Event, InvalidEvent, decode_event_json
from workers.engine import Engine
from workers.heap import freeze_warm_heap
from workers.tables import MetaTable

__all__ = [
    "read_jsonl_events",
    "load_events",
    "apply_events",
    "backfill",
    "export_embeddings",
    "verify",
    "open_engine",
]

logger = logging.getLogger(__name__)

_MODEL_DIR = b"model_dir"


def _bar(total: int | None, desc: str, unit: str = "ev") -> tqdm:
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                disable=os.environ.get("GNNSTREAM_NO_PROGRESS") == "1", mininterval=0.5)


def read_jsonl_events(path: str | os.PathLike[str], bad: list[tuple[int, str]] | None = None) -> Iterator[Event]:
    """Events of a JSONL file, skipping (and recording in ``bad``) invalid lines."""
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield decode_event_json(line)
            except InvalidEvent as exc:
                logger.warning("%s:%d: skipped invalid event (%s)", path, lineno, exc)
                if bad is not None:
                    bad.append((lineno, exc.reason))


def _count_lines(path: str | os.PathLike[str]) -> int:
    with open(path, "rb") as fh:
        return sum(1 for _ in fh)


def _batches(events: Iterable[Event], size: int) -> Iterator[list[Event]]:
    batch: list[Event] = []
    for ev in events:
        batch.append(ev)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def _file_offsets(path: str | os.PathLike[str], line_end: int) -> dict[tuple[str, int], int]:
    return {(f"file:{Path(path).resolve()}", 0): line_end}


def load_events(state: str, path: str, *, seed: int | None = None, batch: int = 1000) -> dict[str, Any]:
    """``graph load``: apply a JSONL event file to the graph store (no embeddings)."""
    bad: list[tuple[int, str]] = []
    t0 = time.perf_counter()
    applied = 0
    with GraphStore(state, seed=seed) as store, _bar(_count_lines(path), "load") as bar:
        for chunk in _batches(read_jsonl_events(path, bad), batch):
            store.apply(chunk)
            applied += len(chunk)
            bar.update(len(chunk))
        nodes = store.num_nodes()
    return {"events": applied, "invalid": len(bad), "nodes": nodes, "seconds": round(time.perf_counter() - t0, 3)}


def open_engine(store: GraphStore, model_dir: str | None, **engine_args: Any) -> Engine:
    """An engine for ``store`` with the model in ``model_dir`` (default: the bound one)."""
    if model_dir is None:
        raw = store.column("meta").get(_MODEL_DIR)
        if raw is None:
            raise SystemExit(f"state {store.path!r} has no model yet; pass --model DIR")
        model_dir = raw.decode()
    model: LoadedModel = load_model_dir(model_dir)
    engine = Engine(store, model, **engine_args)
    store.column("meta").put(_MODEL_DIR, str(Path(model_dir).resolve()).encode())
    return engine


def backfill(state: str, model_dir: str, *, publish: bool = False) -> dict[str, Any]:
    """``backfill``: recompute every embedding from scratch and store it."""
    with GraphStore(state) as store:
        engine = open_engine(store, model_dir)
        with _bar(engine.num_layers, "backfill", unit="layer") as bar:
            stats = engine.backfill(progress=lambda done: bar.update(1), publish=publish)
        return {"nodes": stats.recomputed[0] if stats.recomputed else 0, "layers": engine.num_layers,
                "model": engine.model_tag, "seconds": round(stats.seconds, 3)}


def apply_events(state: str, model_dir: str | None, path: str, *, batch: int = 1000,
                 seed: int | None = None, hub_bound: int = 50_000) -> dict[str, Any]:
    """``apply``: apply events and recompute incrementally; resumable after a crash.

    The file position reached is stored with each batch, so rerunning the same
    command after a crash continues where the last whole batch ended.
    """
    bad: list[tuple[int, str]] = []
    t0 = time.perf_counter()
    with GraphStore(state, seed=seed) as store:
        engine = open_engine(store, model_dir, hub_bound=hub_bound)
        if engine.needs_backfill():
            engine.backfill()
        engine.drain()  # finish what a crash may have left dirty
        freeze_warm_heap()
        (tp, done), = _file_offsets(path, 0).items()
        done = store.offsets().get(tp, 0)
        total = _count_lines(path)
        applied = published = 0
        recomputed = [0] * engine.num_layers
        with _bar(total, "apply") as bar:
            bar.update(done)
            line_no = 0

            def numbered() -> Iterator[tuple[int, Event]]:
                nonlocal line_no
                with open(path, "rb") as fh:
                    for line_no, line in enumerate(fh, 1):
                        if line_no <= done or not line.strip():
                            continue
                        try:
                            yield line_no, decode_event_json(line)
                        except InvalidEvent as exc:
                            bad.append((line_no, exc.reason))

            for chunk in _batches(numbered(), batch):
                end = chunk[-1][0]
                result = store.apply([ev for _, ev in chunk], {tp: end})
                stats = engine.recompute(event_ts=result.max_ts)
                applied += len(chunk)
                published += stats.published
                for i, n in enumerate(stats.recomputed):
                    recomputed[i] += n
                bar.update(end - done)
                done = end
        if done < total:
            store.apply([], {tp: total})
        stats = engine.drain()
        published += stats.published
        return {"events": applied, "invalid": len(bad), "published": published,
                "recomputed_per_layer": recomputed, "pending": engine.pending(),
                "seconds": round(time.perf_counter() - t0, 3)}


def export_embeddings(state: str, out: TextIO) -> int:
    """``embeddings``: one JSON line per node with its final embedding."""
    with GraphStore(state) as store:
        raw_model = store.column("meta").get(b"model")
        model_tag = json.loads(raw_model)["model"] if raw_model else ""
        count = 0
        for iid, meta, vec in MetaTable(store).items():
            if vec is None:
                continue
            out.write(json.dumps({
                "id": store.name(iid),
                "embedding": [float(x) for x in vec],
                "version": meta.version,
                "model": model_tag,
                "mode": meta.mode,
                "event_ts": meta.event_ts,
            }) + "\n")
            count += 1
        return count


def verify(state: str, model_dir: str | None = None, atol: float = 1e-4) -> dict[str, Any]:
    """``verify``: recompute from scratch in memory and compare with what is stored."""
    with GraphStore(state) as store:
        engine = open_engine(store, model_dir)
        targets, fresh = engine.from_scratch()
        stored, present = engine.tables.get(engine.num_layers, targets)
        missing = int((~present).sum())
        err = np.abs(stored - fresh).max(axis=1) if len(targets) else np.zeros(0)
        bad = int((err > atol).sum()) + missing
        worst = int(targets[int(err.argmax())]) if len(targets) else None
        stray = sum(1 for iid, meta, _ in engine.meta.items() if not store.exists_iid(iid) and meta.mode != "deleted")
        return {
            "ok": bad == 0 and stray == 0 and engine.pending() == 0,
            "nodes": int(len(targets)),
            "mismatched": bad,
            "missing": missing,
            "stale_deleted": stray,
            "pending_dirty": engine.pending(),
            "max_abs_error": float(err.max()) if len(err) else 0.0,
            "worst_node": store.name(worst) if worst is not None and bad else None,
            "atol": atol,
            "model": engine.model_tag,
        }
