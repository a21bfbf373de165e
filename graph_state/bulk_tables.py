"""The table files of a bulk load (:mod:`gnnstream.graph_state.bulk`), written by several processes at once.

Each family's records, in key order, are cut into one range per worker (the
neighbour index between whole neighbour lists). Worker ``w`` writes range
``w`` of every family into table files of its own, so the files of a family
hold disjoint key ranges and go in with one ingest; it also sorts its lists'
part of the sampled-by snapshot into shared memory. :func:`run_parts` runs
the workers: worker 0 is the calling process, the others are forked from it
and read its arrays in place; with one worker nothing is forked.

Records are built from numpy arrays a chunk at a time: node names are kept
as fixed-width arrays by length, so a chunk's keys (and the messages its
neighbour ranks hash) are gathers into one structured array and one
``tolist`` per length, not a Python expression per record.
"""

from __future__ import annotations

import gc
import itertools
import mmap
import multiprocessing
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from gnnstream.graph_state import keys
from gnnstream.graph_state.sampled import PAIR_BITS, SNAPSHOT_PAIRS
from gnnstream.graph_state.sampler import rank_message_prefix, ranks_of

__all__ = ["NodeNames", "Tables", "Samples", "cores", "write_tables", "run_parts", "shared_array", "time_keys"]

_CHUNK = 1 << 16  # records built at a time (a chunk of 128-float feature rows: 32 MiB)
_RANK_SLICE = 1 << 20  # neighbour entries ranked and sorted at a time
_SIGN = np.uint64(1 << 63)
_EDGE_RECORD = np.dtype([("weight", ">f8"), ("ts", ">f8")])
_PAIR_KEY = np.dtype([("src", ">u8"), ("dst", ">u8")])
_EXPIRY_KEY = np.dtype([("t", ">u8"), ("src", ">u8"), ("dst", ">u8")])

Records = Iterator[tuple[Sequence[bytes], Iterable[bytes]]]  # (keys, values) a chunk at a time
Writer = Callable[[str, str, Records], int]


def time_keys(t: np.ndarray) -> np.ndarray:
    """:func:`graph_state.keys.time_key` of many times, as big-endian uint64 (byte order is numeric order)."""
    bits = (np.asarray(t, dtype=np.float64) + 0.0).view(np.uint64)
    return np.where(bits & _SIGN, ~bits, bits | _SIGN)


def _equal_runs(values: np.ndarray) -> list[np.ndarray]:
    """The positions of ``values`` (non-negative), grouped by value (each group ascending)."""
    if not len(values):
        return []
    order = np.argsort(values.astype(np.uint16) if values.max() < 1 << 16 else values, kind="stable")  # radix
    return np.split(order, np.flatnonzero(np.diff(values[order])) + 1)


def _iid_keys(iids: np.ndarray) -> list[bytes]:
    return np.asarray(iids).astype(">u8").view("V8").tolist()


class NodeNames:
    """The nodes' names as UTF-8, by interned id, kept as one array of fixed-width strings per name length."""

    def __init__(self, encoded: Sequence[bytes]):
        n = len(encoded)
        self.length = np.fromiter(map(len, encoded), np.int64, n)
        self.longest = int(self.length.max()) if n else 0
        self._row = np.empty(n, dtype=np.int64)  # the name's place in the array of its length
        self._by_length: dict[int, np.ndarray] = {}
        for group in _equal_runs(self.length):
            width = int(self.length[group[0]])
            self._row[group] = np.arange(len(group))
            self._by_length[width] = np.frombuffer(b"".join(map(encoded.__getitem__, group.tolist())), f"V{width}")

    def join(self, *parts: bytes | np.ndarray) -> list[bytes]:
        """Per entry, its ``parts`` joined: ``bytes`` (the same for every entry), an array of interned ids
        (int64: each one's name) or an array of fixed-width values (their bytes, e.g. ``>u8``)."""
        k = next(len(p) for p in parts if isinstance(p, np.ndarray))
        shape = np.zeros(k, dtype=np.int64)  # the lengths of an entry's names, as one number
        for part in parts:
            if isinstance(part, np.ndarray) and part.dtype == np.int64:
                shape = shape * (self.longest + 1) + self.length[part]
        out = np.empty(k, dtype=object)
        for group in _equal_runs(shape):
            fields = []
            for part in parts:
                if isinstance(part, bytes):
                    fields.append(np.frombuffer(part, dtype=f"V{len(part)}"))
                elif part.dtype == np.int64:
                    ids = part[group]
                    fields.append(self._by_length[int(self.length[ids[0]])][self._row[ids]])
                else:
                    fields.append(part[group])
            rows = np.empty(len(group), dtype=[(f"f{i}", f.dtype) for i, f in enumerate(fields)])
            for i, field in enumerate(fields):
                rows[f"f{i}"] = field
            out[group] = rows.view(f"V{rows.itemsize}").tolist()
        return out.tolist()


@dataclass
class Tables:
    """What a bulk load leaves, as arrays; every family's records are built from them a range at a time.

    Attributes:
        names: the nodes' names.
        seed: the sampling seed (the neighbour index's ranks).
        by_bytes: interned ids in the byte order of their names (the order of ``ids``).
        name_order: each interned id's position in ``by_bytes``.
        node: the node records by interned id (``nodes``).
        born: ``(time key of first(v), iid)`` of every node, sorted (``born``; 16 bytes each).
        with_features: the interned ids that have features; ``feature_rows``: each one's row of ``features``.
        src, dst, weight, ts: the edges, sorted by ``(src, dst)``.
        expiry: with an edge window, the edges' positions in ``(t(e), src, dst)`` order; else None.
        v, u: the neighbour entries, sorted by ``v``; ``lists``: where each ``v``'s list begins.
        samples: the sampled-by snapshot of each fanout, which the workers fill in (:class:`Samples`).
    """

    names: NodeNames
    seed: int
    by_bytes: np.ndarray
    name_order: np.ndarray
    node: np.ndarray
    born: np.ndarray
    with_features: np.ndarray
    feature_rows: np.ndarray
    features: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    weight: np.ndarray
    ts: np.ndarray
    expiry: np.ndarray | None
    v: np.ndarray
    u: np.ndarray
    lists: np.ndarray
    samples: list[Samples]


class Samples:
    """The sampled-by snapshot of fanout ``k``: ``S_k(v)`` is the first ``k`` entries of ``v``'s neighbour list in
    index order. The workers put the pairs ``u << PAIR_BITS | v`` of the lists they write at the lists' place
    in ``pairs`` (shared) and sort their range of it; :meth:`records` merges the ranges."""

    def __init__(self, k: int, lengths: np.ndarray):
        self.k = k
        self.before = np.zeros(len(lengths) + 1, dtype=np.int64)  # by list: the pairs of the lists before it
        np.cumsum(np.minimum(lengths, k), out=self.before[1:])
        self.pairs = shared_array(int(self.before[-1]))

    def put(self, first: int, vs: np.ndarray, us: np.ndarray, position: np.ndarray) -> None:
        """The pairs of whole lists ``(vs, us)`` in index order, list ``first`` the first of them (``position``:
        each entry's place in its list)."""
        keep = position < self.k
        at = int(self.before[first])
        self.pairs[at:at + int(keep.sum())] = (us[keep] << PAIR_BITS) | vs[keep]

    def records(self) -> Records:
        pairs = np.sort(self.pairs, kind="stable").astype("<i8")  # the workers' sorted ranges, merged
        for chunk, start in enumerate(range(0, len(pairs), SNAPSHOT_PAIRS)):
            yield [keys.sampled_snapshot_key(self.k, chunk)], [pairs[start:start + SNAPSHOT_PAIRS].tobytes()]


def shared_array(length: int, dtype: Any = np.int64) -> np.ndarray:
    """A zeroed array in memory that the processes :func:`run_parts` forks write to in place (an anonymous
    shared mapping)."""
    dtype = np.dtype(dtype)
    return np.frombuffer(mmap.mmap(-1, max(length * dtype.itemsize, 1)), dtype=dtype, count=length)


# ---------------------------------------------------------------------- the families' records
def _spans(lo: int, hi: int, step: int = _CHUNK) -> Iterator[tuple[int, int]]:
    return ((a, min(a + step, hi)) for a in range(lo, hi, step))


def _ids(t: Tables, lo: int, hi: int) -> Records:
    for a, b in _spans(lo, hi):
        ids = t.by_bytes[a:b]
        yield t.names.join(ids), _iid_keys(ids)


def _names(t: Tables, lo: int, hi: int) -> Records:
    for a, b in _spans(lo, hi):
        ids = np.arange(a, b)
        yield _iid_keys(ids), t.names.join(ids)


def _nodes(t: Tables, lo: int, hi: int) -> Records:
    for a, b in _spans(lo, hi):
        yield _iid_keys(np.arange(a, b)), t.node[a:b].view(f"V{t.node.itemsize}").tolist()


def _born(t: Tables, lo: int, hi: int) -> Records:
    for a, b in _spans(lo, hi):
        yield t.born[a:b].tolist(), itertools.repeat(b"")


def _feats(t: Tables, lo: int, hi: int) -> Records:
    width = f"V{t.features.shape[1] * t.features.itemsize}"
    for a, b in _spans(lo, hi):
        rows = t.features[t.feature_rows[a:b]]
        yield _iid_keys(t.with_features[a:b]), rows.view(width).ravel().tolist()


def _edges(t: Tables, lo: int, hi: int) -> Records:
    for a, b in _spans(lo, hi):
        pair = np.empty(b - a, dtype=_PAIR_KEY)
        pair["src"], pair["dst"] = t.src[a:b], t.dst[a:b]
        record = np.empty(b - a, dtype=_EDGE_RECORD)
        record["weight"], record["ts"] = t.weight[a:b], t.ts[a:b]
        yield pair.view("V16").tolist(), record.view("V16").tolist()


def _expiry(t: Tables, lo: int, hi: int) -> Records:
    for a, b in _spans(lo, hi):
        at = t.expiry[a:b]
        key = np.empty(b - a, dtype=_EXPIRY_KEY)
        key["t"], key["src"], key["dst"] = time_keys(t.ts[at]), t.src[at], t.dst[at]
        yield key.view("V24").tolist(), itertools.repeat(b"")


def _whole_lists(v: np.ndarray, at: np.ndarray) -> np.ndarray:
    """For each position in ``at`` (ascending), the first position from it where a neighbour list begins (or the
    end)."""
    at = np.asarray(at, dtype=np.int64)
    inner = (at > 0) & (at < len(v))
    out = np.where(at <= 0, 0, len(v))
    out[inner] = np.searchsorted(v, v[at[inner] - 1], side="right")
    return out


def _index_order(vs: np.ndarray, rank: np.ndarray, us: np.ndarray, name_order: np.ndarray) -> np.ndarray:
    """The order of entries ``(vs, us)`` (``vs`` ascending) by ``(v, rank, name of u)``: one sort of the list's
    number and the rank's high bits as one uint64, a sort of all three where two entries share that."""
    lists = np.cumsum(np.append(False, vs[1:] != vs[:-1]), dtype=np.uint64)  # the entry's list, numbered
    bits = max(int(lists[-1]).bit_length(), 1) if len(vs) else 1
    key = (lists << np.uint64(64 - bits)) | (rank.astype(np.uint64) >> np.uint64(bits))
    order = np.argsort(key)
    ordered = key[order]
    if (ordered[1:] == ordered[:-1]).any():
        order = np.lexsort((name_order[us], rank, vs))
    return order


def _nbrs(t: Tables, lo: int, hi: int) -> Records:
    """The ``nbrs`` records of entries ``lo..hi`` (whole neighbour lists), a slice of whole lists at a time, and
    their part of the sampled-by snapshots."""
    prefix = rank_message_prefix(t.seed)
    cuts = _whole_lists(t.v, np.arange(lo, hi, _RANK_SLICE)[1:])
    for a, b in zip([lo, *cuts.tolist()], [*cuts.tolist(), hi]):
        if b <= a:
            continue
        vs, us = t.v[a:b], t.u[a:b]
        rank = np.frombuffer(ranks_of(t.names.join(prefix, vs, b":", us)), dtype=">u8")
        order = _index_order(vs, rank, us, t.name_order)
        us, rank = us[order], rank[order]
        if t.samples:
            starts = np.flatnonzero(np.append(True, vs[1:] != vs[:-1]))
            position = np.arange(b - a) - np.repeat(starts, np.diff(np.append(starts, b - a)))
            first = int(np.searchsorted(t.lists, a))
            for samples in t.samples:
                samples.put(first, vs, us, position)
        yield t.names.join(vs.astype(">u8"), rank, us), _iid_keys(us)
    first, last = np.searchsorted(t.lists, [lo, hi]).tolist()
    for samples in t.samples:
        samples.pairs[samples.before[first]:samples.before[last]].sort()


def _families(t: Tables) -> list[tuple[str, int, Callable[[Tables, int, int], Records]]]:
    """``(family, its records, the function building a range of them)`` of every family the workers write."""
    out = [("ids", len(t.by_bytes), _ids), ("names", len(t.by_bytes), _names), ("nodes", len(t.node), _nodes),
           ("born", len(t.born), _born), ("feats", len(t.with_features), _feats), ("edges", len(t.src), _edges),
           ("nbrs", len(t.v), _nbrs)]
    if t.expiry is not None:
        out.append(("expiry", len(t.expiry), _expiry))
    return out


# ---------------------------------------------------------------------- the workers
def cores() -> int:
    """The cores this process may run on: the default number of workers."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks on this platform
        return os.cpu_count() or 1


def write_tables(t: Tables, scratch: str, workers: int, write: Writer) -> dict[str, list[str]]:
    """Write every family but ``sampled`` into table files under ``scratch`` with ``workers`` processes
    (``write(family, path, records)`` writes one file, none for no records); returns each family's files."""
    plan = []
    for family, count, records in _families(t):
        cuts = np.arange(workers + 1) * count // workers
        if family == "nbrs":
            cuts = _whole_lists(t.v, cuts)
        plan.append((family, cuts.tolist(), records))

    def part(w: int) -> None:
        for family, cuts, records in plan:
            write(family, os.path.join(scratch, f"{family}-{w:04d}.sst"), records(t, cuts[w], cuts[w + 1]))

    run_parts(part, workers)
    return {family: [path for w in range(workers)
                     if os.path.exists(path := os.path.join(scratch, f"{family}-{w:04d}.sst"))]
            for family, _, _ in plan}


def run_parts(part: Callable[[int], None], workers: int) -> None:
    """``part(w)`` for every ``w < workers`` at the same time: ``part(0)`` in this process, each other in a
    process forked from it; the first error of any is raised here.

    A forked process has this process's memory but none of its other threads:
    a part uses its arrays (writes go to :func:`shared_array`) and files of its
    own, never the open database.
    """
    context = multiprocessing.get_context("fork")
    children: list[tuple[Any, Any]] = []
    try:
        for w in range(1, workers):
            reader, writer = context.Pipe(duplex=False)
            child = context.Process(target=_worker, args=(part, w, writer), name=f"gnnstream-bulk-{w}", daemon=True)
            child.start()
            writer.close()
            children.append((child, reader))
        part(0)
        for w, (child, reader) in enumerate(children, 1):
            try:
                error = reader.recv()
            except EOFError:
                child.join()
                error = RuntimeError(f"bulk load worker {w} ended with exit code {child.exitcode} before its part "
                                     f"was done")
            if error is not None:
                raise error
    finally:
        for child, reader in children:
            if child.is_alive():
                child.kill()
            child.join()
            reader.close()


def _worker(part: Callable[[int], None], w: int, writer: Any) -> None:
    """Run ``part(w)`` in a forked process; send None when done, or the error."""
    gc.disable()  # no collection here: garbage inherited from the parent may hold its database handles
    try:
        part(w)
    except BaseException as exc:  # noqa: BLE001 - every error goes to the parent, which raises it
        exc.add_note(f"(in bulk load worker {w})")
        try:
            writer.send(exc)
        except Exception:  # an error that does not pickle goes as its text
            writer.send(RuntimeError(f"bulk load worker {w}: {type(exc).__name__}: {exc}"))
        return
    writer.send(None)
