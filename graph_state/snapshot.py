"""Snapshots: a copy of a state directory that a new worker can start from, taken beside the worker that writes
it (``gnnstream snapshot``; how it stays consistent: ``docs/storage.md``)."""

from __future__ import annotations

import gc
import os
import re
import shutil
import tempfile
import time
from typing import Any, Sequence

from rocksdict import Cache, IngestExternalFileOptions, Options, ReadOptions, Rdict, SstFileWriter

from gnnstream.graph_state import keys
from gnnstream.graph_state.exceptions import SnapshotTargetError, StateNotADirectoryError, StateNotFoundError
from gnnstream.graph_state.db import MANIFEST_RECORD, family_options, record_manifest
from gnnstream.graph_state.store import GraphStore

__all__ = ["snapshot", "read_meta"]

# files of RocksDB itself (the copy gets its own), and of rocksdict and the store about them
_ROCKSDB_FILE = re.compile(r"(?:\d+\.(?:sst|log|blob)|CURRENT|IDENTITY|LOCK|LOG(?:\.old\.\d+)?|MANIFEST-\d+|"
                           r"OPTIONS-\d+)")
_DATABASE_FILES = {"rocksdict-config.json", MANIFEST_RECORD}
_TEMPORARY = (".tmp", ".dbtmp")  # files written elsewhere and renamed into place once whole
_SST_BYTES = 64 << 20  # each family's records go into SST files of about this size
_CHECK_SIZE_EVERY = 4096  # records between two looks at the size of the SST file being written
_READAHEAD_BYTES = 2 << 20
_OPEN_ATTEMPTS = 20  # a secondary may find a table file the writer deleted since it read the MANIFEST: try again


def snapshot(state: str | os.PathLike[str], out: str | os.PathLike[str]) -> dict[str, Any]:
    """Copy the state directory ``state`` to the new directory ``out``, beside a worker that may be writing it.

    Returns:
        A JSON-ready summary: ``offsets`` (the next offset of every partition the copy holds, as
        ``"topic:partition"``: a worker started on the copy resumes there), ``pending_dirty`` (dirty marks the
        copy holds), ``records`` (RocksDB records copied), ``files`` (the other files copied, row files among
        them), ``bytes`` (size of the copy) and ``seconds``.

    Raises:
        StateNotFoundError: ``state`` does not exist or is not a gnnstream state.
        StateNotADirectoryError: ``state`` is a file.
        SnapshotTargetError: ``out`` exists and is not an empty directory, or lies inside ``state``.
    """
    t0 = time.perf_counter()
    state, target = os.fspath(state), os.path.abspath(os.fspath(out))
    _check_state(state)
    _check_target(state, target)
    parent, name = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{name}.snapshot-", dir=parent)
    scratch = tempfile.mkdtemp(prefix=f".{name}.reader-", dir=parent)  # the secondary's files, SST files to ingest
    try:
        store = _follow(state, os.path.join(scratch, "secondary"))
        try:
            offsets = {f"{topic}:{partition}": offset for (topic, partition), offset in sorted(store.offsets().items())}
            pending = store.dirty_count()
            records = _copy_database(store, staging, scratch)
            # after the secondary's point: the rows are as new as that point or newer, never older
            files = _copy_files(state, staging)
        finally:
            store.close()
        record_manifest(staging)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)  # what mkdir would have created
        _sync_directory(staging)
        try:
            os.rename(staging, target)  # replaces an empty directory, never anything else
        except OSError as exc:
            problem = _target_problem(target)
            if problem is None:
                raise
            raise SnapshotTargetError(f"snapshot target {target!r} {problem} (it was not when the snapshot "
                                      f"started); nothing was written there") from exc
        _sync_directory(parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "state": state,
        "out": os.fspath(out),
        "offsets": offsets,
        "pending_dirty": pending,
        "records": records,
        "files": files,
        "bytes": _size(target),
        "seconds": round(time.perf_counter() - t0, 3),
    }


def read_meta(state: str | os.PathLike[str], names: Sequence[bytes]) -> dict[str, Any]:
    """What a state records, read beside a worker that may be writing it: ``seed``, ``feature_dim`` and the
    raw ``meta`` values of ``names`` (``None`` where absent).

    Raises:
        StateNotFoundError, StateNotADirectoryError: as :func:`snapshot`.
    """
    state = os.fspath(state)
    _check_state(state)
    scratch = tempfile.mkdtemp(prefix=".gnnstream-reader-")
    try:
        store = _follow(state, os.path.join(scratch, "secondary"))
        try:
            meta = store.column("meta")
            return {"seed": store.seed, "feature_dim": store.feature_dim,
                    **{name.decode(): meta.get(name) for name in names}}
        finally:
            store.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# ---------------------------------------------------------------------- checks
def _check_state(state: str) -> None:
    if os.path.lexists(state) and not os.path.isdir(state):
        raise StateNotADirectoryError(f"state path {state!r} is a file, not a state directory; pass the directory "
                                      f"the worker runs on (its --state)")
    if not os.path.isdir(state):
        raise StateNotFoundError(f"state directory {state!r} does not exist; pass the directory the worker runs on "
                                 f"(its --state)")
    if not os.path.isfile(os.path.join(state, "CURRENT")):
        raise StateNotFoundError(f"directory {state!r} holds no graph state (no RocksDB CURRENT file); pass the "
                                 f"directory the worker runs on (its --state)")


def _not_a_state(state: str, why: str) -> StateNotFoundError:
    return StateNotFoundError(f"directory {state!r} is not a gnnstream state ({why}); pass the directory the "
                              f"worker runs on (its --state)")


def _target_problem(target: str) -> str | None:
    """Why a snapshot cannot be renamed to ``target`` (None: it can)."""
    if not os.path.lexists(target):
        return None
    if os.path.islink(target) or not os.path.isdir(target):
        return "exists and is not a directory"
    if os.listdir(target):
        return "exists and is not empty"
    return None


def _check_target(state: str, target: str) -> None:
    problem = _target_problem(target)
    if problem:
        raise SnapshotTargetError(f"snapshot target {target!r} {problem}; name a new directory (or an empty one)")
    real_state, real_target = os.path.realpath(state), os.path.realpath(target)
    if os.path.commonpath([real_state, real_target]) == real_state:
        raise SnapshotTargetError(f"snapshot target {target!r} lies inside the state {state!r}; name a directory "
                                  f"outside it")


# ---------------------------------------------------------------------- the RocksDB part
def _follow(state: str, own_dir: str) -> GraphStore:
    """The state as a RocksDB secondary instance (no lock, nothing written to ``state``)."""
    for attempt in range(_OPEN_ATTEMPTS):
        try:
            store = GraphStore(state, follow=own_dir)
            break
        except Exception as exc:  # rocksdict raises plain Exception
            message = str(exc)
            if type(exc) is not Exception:
                raise
            if "Column family not found" in message:
                if "meta" not in _families(state):
                    raise _not_a_state(state, "RocksDB without the column families of a graph store") from exc
                raise
            if "No such file" not in message or attempt == _OPEN_ATTEMPTS - 1:
                raise
            shutil.rmtree(own_dir, ignore_errors=True)  # the writer removed a file meanwhile: read again
    try:
        if store.column("meta").get(keys.META_SEED.encode()) is None:
            raise _not_a_state(state, "no sampling seed recorded")
    except BaseException:
        store.close()
        raise
    return store


def _families(state: str) -> list[str]:
    try:
        return Rdict.list_cf(state, Options(raw_mode=True))
    except Exception:  # rocksdict raises plain Exception
        return []


def _copy_database(store: GraphStore, dest: str, scratch: str) -> int:
    """Every record of every column family of ``store`` into a new database at ``dest``; returns the count."""
    cache = Cache(8 << 20)
    options = {name: family_options(cache, name) for name in keys.COLUMN_FAMILIES}
    db_opts = Options(raw_mode=True)
    db_opts.create_if_missing(True)
    db_opts.create_missing_column_families(True)
    db_opts.set_paranoid_checks(True)
    db = Rdict(dest, options=db_opts, column_families=options)
    views = []
    read = ReadOptions()
    read.set_readahead_size(_READAHEAD_BYTES)
    total = 0
    try:
        for name in keys.COLUMN_FAMILIES:
            files: list[str] = []
            writer: SstFileWriter | None = None
            count = 0
            for key, value in store.column(name).items(read_opt=read):  # a checked scan: damage raises
                if writer is None:
                    files.append(os.path.join(scratch, f"{name}-{len(files)}.sst"))
                    writer = SstFileWriter(options=options[name])
                    writer.open(files[-1])
                writer[key] = value
                count += 1
                if count % _CHECK_SIZE_EVERY == 0 and writer.file_size() >= _SST_BYTES:
                    writer.finish()
                    writer = None
            if writer is not None:
                writer.finish()
            if files:
                ingest = IngestExternalFileOptions()
                ingest.set_move_files(True)
                views.append(db.get_column_family(name))
                views[-1].ingest_external_file(files, ingest)
            total += count
    finally:
        for view in views:
            view.close()
        db.close()
        del views, db
        gc.collect()  # column-family views keep the native database (and its lock) alive until dropped
    return total


# ---------------------------------------------------------------------- the other files
def _copy_files(state: str, dest: str) -> list[str]:
    """Copy the state's own files (row files, reports) beside the new database; returns their names."""
    copied = []
    for entry in sorted(os.scandir(state), key=lambda e: e.name):
        name = entry.name
        if (not entry.is_file(follow_symlinks=False) or _ROCKSDB_FILE.fullmatch(name) or name in _DATABASE_FILES
                or name.endswith(_TEMPORARY)):
            continue
        target = os.path.join(dest, name)
        try:
            shutil.copyfile(entry.path, target)
            shutil.copymode(entry.path, target)
        except FileNotFoundError:  # removed meanwhile (a backfill drops row files no page uses)
            try:
                os.unlink(target)
            except FileNotFoundError:
                pass
            continue
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        copied.append(name)
    return copied


def _sync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _size(path: str) -> int:
    return sum(entry.stat(follow_symlinks=False).st_size for entry in os.scandir(path)
               if entry.is_file(follow_symlinks=False))
