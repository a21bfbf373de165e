"""Offline jobs over a state directory: load, apply, backfill, export, verify.

Each function opens what it needs, reports progress with a bar on stderr and
returns a JSON-ready summary; :mod:`gnnstream.workers.cli` maps them to commands.

Opening a state and binding its model: :mod:`gnnstream.workers.state`.

Bad lines of an event file are treated as the stream treats bad records:
skipped and counted, with line number, reason and detail written to a report
file (and, when asked, with the line itself to a dead-letter JSONL) before
the batch that moves past them is committed; a rerun after a crash neither
stops at them nor loses or repeats one.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import itertools
import json
import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TextIO

import numpy as np
from tqdm import tqdm

from gnnstream.graph_state.bulk import BulkLoad
from gnnstream.graph_state.store import GraphStore
from gnnstream.model import load_model_dir
from gnnstream.stream.events import Event, InvalidEvent, NodeUpsert, check_features, decode_event_json
from gnnstream.workers.atomic import atomic_output
from gnnstream.workers.engine import check_device
from gnnstream.workers.engine.typed import GRAPH_SCHEMA_META, TypedLayout, bind_schema, graph_edges
from gnnstream.workers.heap import freeze_warm_heap
from gnnstream.workers.state import (BINDING_META, ReadOnlyStore, bind_model_dir, held_identity, holds_state,
                                     open_engine, open_store, other_model_error)
from gnnstream.graph_state.page_log import PageLog

__all__ = [
    "progress_bar",
    "load_events",
    "apply_events",
    "backfill",
    "export_embeddings",
    "verify",
    "default_report_path",
    "EventsFileChanged",
    "event_lines",
]

logger = logging.getLogger(__name__)



def progress_bar(total: int | None, desc: str, unit: str = "ev") -> tqdm:
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                disable=os.environ.get("GNNSTREAM_NO_PROGRESS") == "1", mininterval=0.5)


# ---------------------------------------------------------------------- event files
def _events_file(path: str | os.PathLike[str], report: str | None, dead_letters: str | None) -> None:
    """Refuse, before anything (a state included) is created, a missing or gzipped events file, and a report or
    dead-letter file in a directory that does not exist."""
    if not os.path.isfile(path):
        raise FileNotFoundError(errno.ENOENT, "events file not found (expected JSON lines, one event each)",
                                os.fspath(path))
    _not_gzipped(path, "gunzip it first (a SNAP CSV: gnnstream events from-snap)")
    for out, option in ((report, "--report"), (dead_letters, "--dead-letters")):
        if out and not Path(out).resolve().parent.is_dir():
            raise ValueError(f"{option} {out!r}: no directory {str(Path(out).resolve().parent)!r} to write it in")


def _not_gzipped(path: str | os.PathLike[str], hint: str) -> None:
    with open(path, "rb") as fh:
        if fh.read(2) == b"\x1f\x8b":
            raise ValueError(f"{os.fspath(path)!r} is gzipped, not JSON lines: {hint}")


def event_lines(path: str | os.PathLike[str], gzipped_hint: str) -> Iterator[bytes]:
    """The lines of a JSON-lines events file, as every command reads one: a gzipped file is refused
    (``ValueError`` naming ``gzipped_hint``, what to do instead), and a UTF-8 byte order mark some editors write
    before the first line is read past."""
    _not_gzipped(path, gzipped_hint)
    with open(path, "rb") as fh:
        for line_no, line in enumerate(fh, 1):
            yield line[3:] if line_no == 1 and line.startswith(b"\xef\xbb\xbf") else line


def _count_lines(path: str | os.PathLike[str]) -> int:
    with open(path, "rb") as fh:
        return sum(1 for _ in fh)


def _batches(lines: Iterable[tuple[int, list[Any]]], size: int) -> Iterator[list[tuple[int, Any]]]:
    """The events of ``(line number, events)`` groups as ``(line number, event)`` pairs, in batches of at least
    ``size`` events that end with a whole line (a typed event is several of the store's)."""
    batch: list[tuple[int, Any]] = []
    for line_no, events in lines:
        batch += [(line_no, ev) for ev in events]
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def _file_offsets(path: str | os.PathLike[str], line_end: int) -> dict[tuple[str, int], int]:
    return {(f"file:{Path(path).resolve()}", 0): line_end}


def default_report_path(state: str | os.PathLike[str], events: str | os.PathLike[str]) -> str:
    """Where ``graph load`` and ``apply`` list the invalid lines of ``events`` unless told otherwise."""
    name = Path(events).name
    return os.path.join(os.fspath(state), f"invalid-{name[:-len('.jsonl')] if name.endswith('.jsonl') else name}.jsonl")


def _write_atomic(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` (a temporary file in the same directory, then a rename)."""
    with atomic_output(path, "wb") as fh:
        fh.write(data)


class _InvalidLines:
    """The skipped lines of one event file, kept in a report file and optionally a dead-letter file.

    Each is a JSON line ``{"file", "line", "reason", "detail"}`` (dead letters
    add the line itself: ``value``, or ``value_base64`` when it is not UTF-8).
    Opening drops this file's records past ``keep_through`` (they belong to
    batches no run committed, and are found again); :meth:`flush` is called
    before each commit, so a committed line's record is never lost and never
    written twice. Records of other event files are left alone.
    """

    def __init__(self, events: str | os.PathLike[str], report: str | None, dead_letters: str | None,
                 keep_through: int):
        self.source = str(Path(events).resolve())
        self.targets = [(path, with_value) for path, with_value in ((report, False), (dead_letters, True)) if path]
        self.pending: dict[str, list[bytes]] = {path: [] for path, _ in self.targets}
        self.reasons: Counter[str] = Counter()
        for path, _ in self.targets:
            self._prune(path, keep_through)

    def _prune(self, path: str, keep_through: int) -> None:
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            return
        lines = data.split(b"\n")
        complete, tail = lines[:-1], lines[-1]  # an unterminated last line was cut by a crash mid-write
        kept: list[bytes] = []
        for line in complete:
            try:
                rec = json.loads(line)
            except ValueError:
                kept.append(line)
                continue
            if isinstance(rec, dict) and rec.get("file") == self.source and isinstance(rec.get("line"), int) \
                    and rec["line"] > keep_through:
                continue
            kept.append(line)
        if len(kept) != len(complete) or tail:
            _write_atomic(path, b"".join(line + b"\n" for line in kept))

    def add(self, line_no: int, line: bytes, exc: InvalidEvent) -> None:
        self.reasons[exc.reason] += 1
        rec: dict[str, Any] = {"file": self.source, "line": line_no, "reason": exc.reason, "detail": exc.detail}
        for path, with_value in self.targets:
            out = dict(rec)
            if with_value:
                raw = line.rstrip(b"\r\n") if line.endswith(b"\n") else line
                try:
                    out["value"] = raw.decode("utf-8")
                except UnicodeDecodeError:
                    out["value_base64"] = base64.b64encode(raw).decode("ascii")
            self.pending[path].append(json.dumps(out).encode() + b"\n")

    def flush(self) -> None:
        """Write (and sync) what was added; call before committing the batch that moves past those lines."""
        for path, records in self.pending.items():
            if records:
                with open(path, "ab") as fh:
                    fh.writelines(records)
                    fh.flush()
                    os.fsync(fh.fileno())
                records.clear()

    @property
    def count(self) -> int:
        return sum(self.reasons.values())

    def summary(self, report: str | None, dead_letters: str | None) -> dict[str, Any]:
        return {"invalid": self.count, "invalid_reasons": dict(sorted(self.reasons.items())),
                "report": report if report and os.path.exists(report) else None,
                "dead_letters": dead_letters if dead_letters and os.path.exists(dead_letters) else None}


def _line_hash(line: bytes) -> str:
    return hashlib.blake2b(line.rstrip(b"\r\n"), digest_size=8).hexdigest()


def _numbered_events(path: str | os.PathLike[str], done: int, invalid: _InvalidLines,
                     read: Callable[[bytes], list[Event]],
                     position: dict[str, Any] | None = None) -> Iterator[tuple[int, list[Event]]]:
    """``(line number, events)`` of the valid lines after line ``done``; the others go to ``invalid``.

    ``read(line)`` gives a line's events (one, or the untyped events that hold
    a typed one) or raises :class:`InvalidEvent`. ``position``, when given,
    holds the number and bytes of the last line read (``line``, ``text``); if
    it comes with the ``hash`` (:func:`_line_hash`) of line ``done`` as applied
    before, a file whose line ``done`` differs, or that has fewer lines, raises
    :class:`EventsFileChanged` before any event after it is yielded.
    """
    expect = position.get("hash") if position is not None and done else None
    line_no = 0
    for line_no, line in enumerate(event_lines(path, "gunzip it first"), 1):
        if position is not None:
            position["line"], position["text"] = line_no, line
            if line_no == done and expect is not None and _line_hash(line) != expect:
                raise EventsFileChanged(path, done)
        if line_no <= done or not line.strip():
            continue
        try:
            events = read(line)
        except InvalidEvent as exc:
            logger.info("%s:%d: skipped invalid event (%s)", path, line_no, exc)
            invalid.add(line_no, line, exc)
            continue
        yield line_no, events
    if expect is not None and line_no < done:
        raise EventsFileChanged(path, done)


def _feature_checked(dim: int | None, source: str) -> Callable[[bytes], list[Event]]:
    """A line's untyped event, whose features must number ``dim`` (``source`` says whose width that is); without
    ``dim`` the first ``node_upsert`` read sets it, as the store would."""
    width = [dim]

    def read(line: bytes) -> list[Event]:
        ev = decode_event_json(line)
        if isinstance(ev, NodeUpsert):
            if width[0] is None:
                width[0] = len(ev.features)
            check_features(ev, width[0], source)
        return [ev]

    return read


class EventsFileChanged(ValueError):
    """An events file resumed by ``apply`` is not the file whose first lines the state applied."""

    def __init__(self, path: str | os.PathLike[str], line: int):
        super().__init__(
            f"events file {os.fspath(path)!r} is not the one applied before: its line {line}, where the last run "
            f"stopped, is missing or differs; apply resumes a file only after the lines it applied (a file that "
            f"grew), so put new events in a file of another name, or apply into a new --state")
        self.path, self.line = os.fspath(path), line


# ---------------------------------------------------------------------- commands
def load_events(state: str, path: str, *, seed: int | None = None, model_dir: str | None = None,
                batch: int = 1000, report: str | None = None, dead_letters: str | None = None,
                edge_ttl: int | None = None, workers: int | None = None) -> dict[str, Any]:
    """``graph load``: apply a JSONL event file to the graph store (no embeddings).

    ``edge_ttl`` is the edge window of a new state (``--edge-ttl``; an existing
    state must hold the same one); the bulk part applies it at its final stream time.
    ``workers`` write its table files (``--workers``; default one per core).

    A new state takes its seed from ``model_dir`` when given, else ``seed``,
    else 0; with a model, features must have its ``in_dim``, and the state
    records it as its model (the default of ``--model`` for ``apply``,
    ``run``, ``verify``...; a state holding another model's embeddings is
    refused, as by ``apply``). Invalid lines are
    skipped and listed in ``report`` (default :func:`default_report_path`) and
    ``dead_letters``; the run reads the whole file each time.

    Into a state that holds no graph yet, the events up to the first
    ``node_delete`` are written as table files and ingested
    (:class:`gnnstream.graph_state.bulk.BulkLoad`, with the sampled-by index of the
    model's fanouts); the rest, and every load into a state that holds a
    graph, goes through :meth:`GraphStore.apply` in batches.
    """
    _events_file(path, report, dead_letters)
    if seed is None and model_dir is None and not holds_state(os.fspath(state)):
        seed = 0
    config = load_model_dir(model_dir).config if model_dir is not None else None
    in_dim = config.in_dim if config is not None else None
    report = report or default_report_path(state, path)
    t0 = time.perf_counter()
    applied = 0
    bulk_events = 0
    with open_store(state, create=True, model_dir=model_dir, seed=seed, edge_ttl=edge_ttl) as store, \
            progress_bar(_count_lines(path), "load") as bar:
        if config is not None:
            other = other_model_error(store, model_dir, config, held_identity(store))
            if other is not None:
                raise other
            typed = TypedLayout(config.graph_schema, store) if config.schema is not None else None
            bind_schema(store, config.schema, config.model_id)
            store.set_feature_dim(typed.width if typed is not None else config.in_dim)
            bind_model_dir(store, model_dir)  # the default of --model for the commands that follow
        elif store.meta(GRAPH_SCHEMA_META) is not None:
            raise ValueError(f"state {state!r} holds a typed graph: load its events with --model, the typed model "
                             f"that reads them")
        invalid = _InvalidLines(path, report, dead_letters, keep_through=0)
        if config is not None and typed is not None:
            read = typed.read
        else:
            source = "the model expects" if in_dim is not None else "the state's nodes have"
            read = _feature_checked(store.feature_dim, source)
        events = _numbered_events(path, 0, invalid, read)
        last = 0
        if BulkLoad.takes(store):  # an empty state: table files, up to the first node_delete
            load = BulkLoad(store, fanouts=config.fanouts if config is not None else (), workers=workers)
            rest: list[tuple[int, list[Event]]] = []
            seen = last
            lines = 0  # lines loaded
            for line_no, group in events:
                if any(ev.op == "node_delete" for ev in group):
                    rest.append((line_no, group))
                    break
                for ev in group:
                    load.add(ev)
                lines += 1
                seen = line_no
                if line_no - last >= 65_536:
                    bar.update(line_no - last)
                    last = line_no
            bar.update(seen - last)
            last = seen
            invalid.flush()  # the lines skipped are listed before the tables go in
            bar.set_postfix_str("writing tables")
            load.finish()
            bulk_events = applied = lines
            events = itertools.chain(rest, events)
        for chunk in _batches(events, batch):
            invalid.flush()
            store.apply([ev for _, ev in chunk])
            applied += len({line for line, _ in chunk})
            bar.update(chunk[-1][0] - last)
            last = chunk[-1][0]
        invalid.flush()
        nodes = store.num_nodes()
        seed_used = store.seed
        window = {"edge_ttl": store.edge_ttl, "stream_time": store.stream_time}
    return {"events": applied, "bulk_events": bulk_events, **invalid.summary(report, dead_letters), "nodes": nodes,
            "seed": seed_used, **window, "seconds": round(time.perf_counter() - t0, 3)}


def backfill(state: str, model_dir: str, *, publish: bool = False, device: str = "cpu") -> dict[str, Any]:
    """``backfill``: recompute every embedding from scratch and store it; the one way to switch a state to
    another model. ``device`` is where the layers run (``cuda``: a GPU, when torch sees one)."""
    check_device(device)  # before the state is opened: a wrong device changes nothing
    with open_store(state, create=False, model_dir=model_dir) as store:  # an empty new state has nothing to embed
        engine = open_engine(store, model_dir, switch_model=True)
        with progress_bar(engine.num_layers, "backfill", unit="layer") as bar:
            stats = engine.backfill(progress=lambda done: bar.update(1), publish=publish, device=device)
        bind_model_dir(store, model_dir)
        return {"nodes": stats.recomputed[0] if stats.recomputed else 0, "layers": engine.num_layers,
                "model": engine.model_tag, "device": device, "seconds": round(stats.seconds, 3)}


def apply_events(state: str, model_dir: str | None, path: str, *, batch: int = 1000,
                 seed: int | None = None, hub_bound: int = 50_000, report: str | None = None,
                 dead_letters: str | None = None, edge_ttl: int | None = None) -> dict[str, Any]:
    """``apply``: apply events and recompute incrementally; resumable after a crash.

    The file position reached is stored with each batch, so rerunning the same
    command after a crash continues where the last whole batch ended. Invalid
    lines (a ``node_upsert`` whose feature count is not the model's ``in_dim``
    included) are skipped and listed in ``report`` (default
    :func:`default_report_path`) and ``dead_letters``. The summary's
    ``seconds_by_phase`` splits ``seconds``: ``start`` (opening the state and
    the engine, finishing earlier work), ``read`` (reading and decoding the
    file), ``apply`` (:meth:`GraphStore.apply`), ``recompute``, the final
    ``drain`` and closing the state.
    """
    _events_file(path, report, dead_letters)
    t0 = time.perf_counter()
    phases = dict.fromkeys(("start", "read", "apply", "recompute", "drain", "close"), 0.0)
    report = report or default_report_path(state, path)
    # without a model the state must exist and name its own
    with open_store(state, create=model_dir is not None, model_dir=model_dir, seed=seed, edge_ttl=edge_ttl) as store:
        engine = open_engine(store, model_dir, hub_bound=hub_bound)
        if engine.needs_backfill():
            engine.backfill()
        engine.drain()  # finish what a crash may have left dirty
        freeze_warm_heap()
        (tp, _), = _file_offsets(path, 0).items()
        done = store.offsets().get(tp, 0)
        # the hash of the line the last run stopped after: a different file at the same path is refused
        fingerprint = tp[0]
        stored = store.meta(fingerprint)
        position: dict[str, Any] = {"hash": stored["hash"]} if stored and stored.get("line") == done else {}
        invalid = _InvalidLines(path, report, dead_letters, keep_through=done)
        total = _count_lines(path)
        applied = published = expired = late = 0
        recomputed = [0] * engine.num_layers
        with progress_bar(total, "apply") as bar:
            bar.update(done)
            events = _numbered_events(path, done, invalid, engine.read_event, position)
            clock = time.perf_counter()
            phases["start"] = clock - t0
            for chunk in _batches(events, batch):
                end = chunk[-1][0]
                invalid.flush()
                clock = _lap(phases, "read", clock)
                result = store.apply([ev for _, ev in chunk], {tp: end},
                                     meta={fingerprint: {"line": end, "hash": _line_hash(position["text"])}})
                clock = _lap(phases, "apply", clock)
                stats = engine.recompute(event_ts=result.max_ts)
                clock = _lap(phases, "recompute", clock)
                applied += len({line for line, _ in chunk})  # lines (a typed event is several of the store's)
                expired += graph_edges(engine.typed, result.expired_edges, result.expired_loops)
                late += graph_edges(engine.typed, result.late_events, result.late_loops)
                published += stats.published
                for i, n in enumerate(stats.recomputed):
                    recomputed[i] += n
                bar.update(end - done)
                done = end
        invalid.flush()
        if done < position.get("line", done):  # invalid or blank lines after the last event
            store.apply([], {tp: position["line"]}, meta={fingerprint: {"line": position["line"],
                                                                         "hash": _line_hash(position["text"])}})
        clock = time.perf_counter()
        stats = engine.drain()
        published += stats.published
        clock = _lap(phases, "drain", clock)
        summary = {"events": applied, **invalid.summary(report, dead_letters), "published": published,
                   "recomputed_per_layer": recomputed, "pending": engine.pending(),
                   "stream_time": store.stream_time, "edges_expired": expired, "late_events": late}
    _lap(phases, "close", clock)
    return {**summary, "seconds": round(time.perf_counter() - t0, 3),
            "seconds_by_phase": {name: round(sec, 3) for name, sec in phases.items()}}


def _lap(phases: dict[str, float], phase: str, since: float) -> float:
    """Add the time from ``since`` to now to ``phases[phase]``; return now."""
    now = time.perf_counter()
    phases[phase] += now - since
    return now


def export_embeddings(state: str, out: TextIO) -> int:
    """``embeddings``: one JSON line per node with its final embedding (the state is opened read-only)."""
    with open_store(state, create=False, read_only=True) as store:
        raw_model = store.column("meta").get(BINDING_META)
        model_tag = json.loads(raw_model)["model"] if raw_model else ""
        kept = _kept_test(store)
        count = 0
        for iid, meta, vec in PageLog(store).items():
            if vec is None or not kept(iid):
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


def _kept_test(store: GraphStore) -> Callable[[int], bool]:
    """Whether the state holds a node's final row current: a worker of a group keeps only its output
    partitions' (``Engine.kept_partitions``); other states every node's."""
    from gnnstream.stream.partitioning import partition_for
    from gnnstream.workers.engine import kept_partitions
    recorded = kept_partitions(store)
    if recorded is None:
        return lambda iid: True
    count, kept = recorded
    return lambda iid: count > 0 and partition_for(store.name(iid).encode(), count) in kept


def _finite_or_none(x: float) -> float | None:
    return x if np.isfinite(x) else None  # JSON has no NaN or Infinity


VERIFY_EXIT = {"ok": 0, "mismatch": 1, "pending": 3}
"""Exit status of ``gnnstream verify`` by summary ``status`` (2 is an error: missing state, other model...)."""


def verify(state: str, model_dir: str | None = None, atol: float = 1e-4) -> dict[str, Any]:
    """``verify``: recompute from scratch in memory and compare with what is stored (read-only).

    A worker of a group holds current final rows only for its output
    partitions: the other nodes are left out and counted in ``not_kept``.

    ``status`` is ``ok``; ``mismatch`` (a stored row differs, is missing, is
    not finite or fails its check, and no work is pending to explain it); or
    ``pending`` (dirty marks wait, every stored row is finite and intact: the
    differences may be that work; finish it, then verify again).
    """
    with open_store(state, create=False, read_only=True) as store:
        engine = open_engine(store, model_dir)
        targets, fresh = engine.from_scratch()
        kept = _kept_test(store)
        mine = np.fromiter(map(kept, targets.tolist()), dtype=bool, count=len(targets))
        not_kept = int((~mine).sum())
        targets, fresh = targets[mine], fresh[mine]
        stored, present = engine.tables.get(engine.num_layers, targets)
        finite = np.isfinite(stored).all(axis=1) if len(targets) else np.zeros(0, dtype=bool)
        with np.errstate(invalid="ignore", over="ignore"):
            err = (np.abs(stored.astype(np.float64) - fresh).max(axis=1) if len(targets)
                   else np.zeros(0))
        err = np.where(present, np.where(finite, err, np.inf), 0.0)
        wrong = present & (err > atol)  # a non-finite row is inf off
        missing = int((~present).sum())
        non_finite = int((present & ~finite).sum())
        bad = int(wrong.sum()) + missing
        if wrong.any():
            worst = int(targets[int(err.argmax())])
        elif missing:
            worst = int(targets[int(np.flatnonzero(~present)[0])])
        else:
            worst = None
        measured = present & finite
        stray = sum(1 for iid, meta, _ in engine.meta.items()
                    if not store.exists_iid(iid) and meta.mode != "deleted" and kept(iid))
        pending = engine.pending()
        damaged = store.damaged_marks if isinstance(store, ReadOnlyStore) else 0
        if bad == 0 and stray == 0 and pending == 0 and damaged == 0:
            status = "ok"
        elif pending and non_finite == 0 and damaged == 0:
            status = "pending"
        else:
            status = "mismatch"
        return {
            "ok": status == "ok",
            "status": status,
            "nodes": int(len(targets)),
            "not_kept": not_kept,
            "mismatched": bad,
            "missing": missing,
            "non_finite": non_finite,
            "damaged_rows": damaged,
            "stale_deleted": stray,
            "pending_dirty": pending,
            "max_abs_error": _finite_or_none(float(err[measured].max()) if measured.any() else 0.0),
            "worst_node": store.name(worst) if worst is not None else None,
            "atol": atol,
            "model": engine.model_tag,
        }
