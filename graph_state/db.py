"""RocksDB access for the state: opening a state (or following one), column-family options, checked scans,
and the one-line error for a damaged state."""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

from rocksdict import AccessType, BlockBasedOptions, Cache, DBCompressionType, Options, Rdict, SstFileWriter, WriteBatch

from gnnstream.graph_state import keys
from gnnstream.graph_state.exceptions import StateCorrupted, StateLayoutError, StoreLockedError

__all__ = ["Family", "Columns", "write_table", "open_db", "open_follower", "family_options", "check_iterator", "state_corrupted",
           "is_corruption", "check_manifest", "record_manifest", "layout_error",
           "other_families", "REMEDY", "MANIFEST_RECORD"]

logger = logging.getLogger(__name__)

_FLOAT_FAMILIES = ("feats", "embpages")
_BLOCK_CACHE_BYTES = 256 << 20
_WAL_BYTES = 16 << 20  # the writer's write-ahead logs, at most (then it flushes the families they hold)

REMEDY = ("restore a snapshot of the state directory, or rebuild it with `gnnstream graph load` and "
          "`gnnstream backfill`")
"""What to do about a damaged state, as every :class:`StateCorrupted` message says."""
MANIFEST_RECORD = "gnnstream-manifest.json"
"""The file in a state directory recording the name and size of the MANIFEST a clean close left."""
_DAMAGED_FILE = re.compile(r"[^\s:'\"()]*(?:\d+\.(?:sst|log|blob)|MANIFEST-\d+|CURRENT)")


def layout_error(path: str, layout: Any) -> StateLayoutError:
    """The one-line error for a state written with another layout than :data:`gnnstream.graph_state.keys.LAYOUT`."""
    which = "an earlier layout" if layout is None else f"layout {layout}"
    return StateLayoutError(
        f"state {path!r} was written with {which} of gnnstream and this version reads layout {keys.LAYOUT} only; "
        f"rebuild it in a new directory: `gnnstream graph load --state NEW FILE` with the graph's events, then "
        f"`gnnstream backfill --state NEW --model DIR` (or replay the events topic into a new --state)")


def state_corrupted(path: str, error: BaseException | str) -> StateCorrupted:
    """The one-line error for the damaged state ``path``, naming the file RocksDB's ``error`` names."""
    detail = " ".join(str(error).split())
    found = _DAMAGED_FILE.search(detail)
    where = f": {found.group(0)} is damaged" if found else " is damaged"
    return StateCorrupted(f"state {path!r}{where} (RocksDB: {detail}); {REMEDY}")


def is_corruption(error: BaseException) -> bool:
    """Whether a rocksdict error (a plain ``Exception``) is RocksDB's report of damaged files."""
    return str(error).startswith("Corruption")


def check_iterator(it: Any, path: str) -> None:
    """Raise :class:`StateCorrupted` if the RocksDB iterator ``it`` stopped on an error (call it once
    ``it.valid()`` is False: an iterator that meets a damaged block just becomes invalid)."""
    try:
        it.status()
    except Exception as exc:  # rocksdict raises plain Exception
        raise state_corrupted(path, exc) from exc


def _positioned(view: Rdict, from_key: bytes | None, backwards: bool, read_opt: Any) -> Any:
    it = view.iter() if read_opt is None else view.iter(read_opt)
    if from_key is None:
        it.seek_to_last() if backwards else it.seek_to_first()
    elif backwards:
        it.seek_for_prev(from_key)
    else:
        it.seek(from_key)
    return it


def _scan_items(it: Any, backwards: bool, path: str) -> Iterator[tuple[bytes, bytes]]:
    valid, key, value, step = it.valid, it.key, it.value, it.prev if backwards else it.next
    while valid():
        yield key(), value()
        step()
    check_iterator(it, path)


def _scan_keys(it: Any, backwards: bool, path: str) -> Iterator[bytes]:
    valid, key, step = it.valid, it.key, it.prev if backwards else it.next
    while valid():
        yield key()
        step()
    check_iterator(it, path)


def _scan_values(it: Any, backwards: bool, path: str) -> Iterator[bytes]:
    valid, value, step = it.valid, it.value, it.prev if backwards else it.next
    while valid():
        yield value()
        step()
    check_iterator(it, path)


class Family:
    """One column family of a :class:`GraphStore`, as :meth:`GraphStore.column` hands it out.

    Scans (:meth:`items`, :meth:`keys`, :meth:`values`, with rocksdict's
    arguments) check the iterator's status when it runs out, so a damaged
    block raises :class:`StateCorrupted` instead of ending the scan early.
    Point reads and writes (``get``, ``put``, ``delete``, ``delete_range``)
    are the rocksdict view's own methods, with no call in between (a point
    read of a damaged block raises by itself); ``iter()`` is the view's raw
    iterator, which its user checks with :func:`check_iterator`. Anything
    else goes to the view.
    """

    def __init__(self, view: Rdict, path: str):
        self.view = view
        self.path = path
        self.get, self.put, self.delete, self.delete_range = view.get, view.put, view.delete, view.delete_range

    def __getattr__(self, name: str) -> Any:
        if name == "view":  # not set yet (or any more): no recursion
            raise AttributeError(name)
        return getattr(self.view, name)

    def __getitem__(self, key: bytes) -> Any:
        return self.view[key]

    def __setitem__(self, key: bytes, value: bytes) -> None:
        self.view[key] = value

    def __delitem__(self, key: bytes) -> None:
        del self.view[key]

    def __contains__(self, key: bytes) -> bool:
        return key in self.view

    def items(self, backwards: bool = False, from_key: bytes | None = None,
              read_opt: Any = None) -> Iterator[tuple[bytes, bytes]]:
        """``(key, value)`` in key order (reversed with ``backwards``), from ``from_key`` when given."""
        return _scan_items(_positioned(self.view, from_key, backwards, read_opt), backwards, self.path)

    def keys(self, backwards: bool = False, from_key: bytes | None = None, read_opt: Any = None) -> Iterator[bytes]:
        """The keys, as :meth:`items`."""
        return _scan_keys(_positioned(self.view, from_key, backwards, read_opt), backwards, self.path)

    def values(self, backwards: bool = False, from_key: bytes | None = None,
               read_opt: Any = None) -> Iterator[bytes]:
        """The values, as :meth:`items`."""
        return _scan_values(_positioned(self.view, from_key, backwards, read_opt), backwards, self.path)

    def __iter__(self) -> Iterator[bytes]:
        return self.keys()


@dataclass(frozen=True, slots=True)
class Columns:
    """An open state's column families as the parts of a :class:`GraphStore` read and write them.

    Attributes:
        path: the state directory (named in errors).
        views: the rocksdict view of each family, for point reads and raw iterators.
        families: the checked view of each family (:class:`Family`), for scans.
        handles: the handle of each family, for WriteBatches.
        write: writes a WriteBatch with the store's write options.
    """

    path: str
    views: dict[str, Rdict]
    families: dict[str, Family]
    handles: dict[str, Any]
    write: Callable[[WriteBatch], None]


def write_table(family: str, path: str, chunks: Iterable[tuple[Sequence[bytes], Iterable[bytes]]]) -> int:
    """Write records of ``family``, given as ``(keys, values)`` chunks with keys in strictly increasing order
    throughout, into a table file at ``path`` for ingestion; returns how many (no file is left for none)."""
    writer = None
    count = 0
    for keys_, values in chunks:
        if not len(keys_):
            continue
        if writer is None:
            writer = SstFileWriter(options=family_options(Cache(1 << 20), family))
            writer.open(path)
        collections.deque(map(writer.__setitem__, keys_, values), maxlen=0)
        count += len(keys_)
    if writer is not None:
        writer.finish()
    return count


def check_manifest(path: str) -> None:
    """Refuse a state whose MANIFEST is shorter than its last clean close left it (:data:`MANIFEST_RECORD`),
    or whose table files are there without the CURRENT file naming their MANIFEST, before RocksDB opens it
    (and deletes the table files it no longer knows)."""
    try:
        with open(os.path.join(path, "CURRENT")) as fh:
            current = fh.read().strip()
    except FileNotFoundError:
        try:
            entries = list(os.scandir(path))
        except OSError:
            return  # a new state (or not a directory: RocksDB says so)
        # RocksDB writes CURRENT before any table file or write-ahead log record: without it, it would start
        # an empty state here and delete these
        if any(e.name.endswith(".sst") or (e.name.endswith(".log") and e.stat().st_size) for e in entries):
            raise StateCorrupted(f"state {path!r}: {os.path.join(path, 'CURRENT')} is missing, beside the "
                                 f"state's table files; {REMEDY}") from None
        return
    except OSError:
        return  # RocksDB reports what it cannot read
    try:
        with open(os.path.join(path, MANIFEST_RECORD)) as fh:
            record = json.load(fh)
        name, size = record["manifest"], int(record["bytes"])
        now = os.path.getsize(os.path.join(path, name))
    except (OSError, ValueError, KeyError, TypeError):
        return  # no record (an older state, or a crash before the last close), or another MANIFEST by now
    if name == current and now < size:
        raise StateCorrupted(f"state {path!r}: {os.path.join(path, name)} is damaged (cut to {now} bytes; the "
                             f"state's last close left {size}); {REMEDY}")


def record_manifest(path: str) -> None:
    """Write :data:`MANIFEST_RECORD` for the MANIFEST a close left (only when it changed, so a session that
    wrote nothing leaves the directory as it was)."""
    target = os.path.join(path, MANIFEST_RECORD)
    try:
        with open(os.path.join(path, "CURRENT")) as fh:
            current = fh.read().strip()
        record = {"manifest": current, "bytes": os.path.getsize(os.path.join(path, current))}
        try:
            with open(target) as fh:
                if json.load(fh) == record:
                    return
        except (OSError, ValueError):
            pass
        tmp = target + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(record, fh)
        os.replace(tmp, target)
    except OSError as exc:
        logger.warning("state %s: could not record the size of its MANIFEST (%s); a MANIFEST cut short "
                       "later will not be noticed at open", path, exc)


def open_db(path: str, lock_timeout: float) -> Rdict:
    """Open (or create) the database, waiting up to ``lock_timeout`` for another process's lock.

    Raises:
        StateCorrupted: RocksDB finds the MANIFEST (or a table file it names) damaged or missing, or
            the MANIFEST is shorter than the last close left it.
        StoreLockedError: the lock was not released in time.
    """
    check_manifest(path)
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.create_missing_column_families(True)
    # a follower replays the writer's log into memtables that live until the writer flushes the log's data,
    # and each write it replays costs more the fuller they are: flush every family once the logs pass this
    opts.set_max_total_wal_size(_WAL_BYTES)
    opts.set_paranoid_checks(True)  # RocksDB's default, relied on: damage found at open or in the background fails
    cache = Cache(_BLOCK_CACHE_BYTES)
    cfs = {name: family_options(cache, name) for name in keys.COLUMN_FAMILIES}
    deadline = time.monotonic() + lock_timeout
    while True:
        try:
            return Rdict(path, options=opts, column_families=cfs)
        except Exception as exc:  # rocksdict raises plain Exception
            message = str(exc)
            if is_corruption(exc) or ("No such file" in message and "MANIFEST-" in message):
                raise state_corrupted(path, exc) from exc
            if other_families(exc):
                raise layout_error(path, None) from exc
            if "lock" not in message.lower():
                raise
            if time.monotonic() >= deadline:
                raise StoreLockedError(
                    f"graph store {path!r} is locked by another process; stop the other "
                    f"gnnstream process using it (one process per store)"
                ) from exc
            time.sleep(0.1)


def open_follower(path: str, own_dir: str) -> Rdict:
    """Open ``path`` as a RocksDB secondary instance keeping its own files in ``own_dir``.

    Raises:
        StateCorrupted: as :meth:`_open`.
        FileNotFoundError: there is no state at ``path``.
    """
    if not os.path.isfile(os.path.join(path, "CURRENT")):
        raise FileNotFoundError(f"no graph store at {path!r} (start the worker on it first)")
    check_manifest(path)
    os.makedirs(own_dir, exist_ok=True)
    opts = Options(raw_mode=True)
    opts.set_max_open_files(-1)  # a secondary must keep table files open: the writer deletes compacted ones
    opts.set_max_file_opening_threads(1)  # else every catch-up starts threads to open files: 10-15 ms each
    cache = Cache(_BLOCK_CACHE_BYTES)
    cfs = {name: family_options(cache, name, follower=True) for name in keys.COLUMN_FAMILIES}
    try:
        return Rdict(path, options=opts, column_families=cfs, access_type=AccessType.secondary(own_dir))
    except Exception as exc:  # rocksdict raises plain Exception
        if is_corruption(exc):
            raise state_corrupted(path, exc) from exc
        if other_families(exc):
            raise layout_error(path, None) from exc
        raise


def other_families(error: BaseException) -> bool:
    """Whether RocksDB refused to open a state because it holds column families this layout does not have: a
    state of another layout."""
    return "Column families not opened" in str(error)


def family_options(cache: Cache, name: str, follower: bool = False) -> Options:
    """Bloom filters (most edge and id lookups are for keys that do not exist) and a shared block cache.

    Float rows (features, embeddings) do not compress: those families are
    stored uncompressed, which saves flush and compaction CPU. The writer's
    memtables have a whole-key bloom filter too; a ``follower``'s do not: it
    fills its memtables by replaying the writer's log while readers wait,
    and a filter costs every replayed write a few random bit sets in a
    filter of 5 % of the write buffer.
    """
    table = BlockBasedOptions()
    table.set_bloom_filter(10, False)
    table.set_block_cache(cache)
    opts = Options(raw_mode=True)
    opts.set_block_based_table_factory(table)
    if not follower:
        opts.set_memtable_prefix_bloom_ratio(0.05)
        opts.set_memtable_whole_key_filtering(True)
    if name in _FLOAT_FAMILIES:
        opts.set_compression_type(DBCompressionType.none())
    return opts
