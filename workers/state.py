"""Opening a state directory and binding it to a model: the one place every command and the worker do it.

A state's identity is explicit (:func:`open_store`, then :func:`open_engine`):

* only the commands that write (``graph load``, ``apply``, ``backfill``,
  ``run``) create a state directory. A new state samples with its model's
  seed; ``--seed`` is for ``graph load`` without a model (default 0) and must
  agree with the model when both are given;
* ``verify``, ``embeddings`` and ``graph show`` open the state read-only
  (RocksDB read-only, holding a shared lock on its ``LOCK`` file so that no
  writer runs meanwhile): they never create or change it;
* a state that holds the embeddings of one model changes model only through
  ``gnnstream backfill --model``. Two models are the same when their tag
  (``name:version``), architecture, ``weights.pt`` sha256, fanouts and
  cold-start policy all agree: the engine's binding stored in the state's
  meta ``model`` record (dims are part of the weights, the sampling seed is
  the state's own).
"""

from __future__ import annotations

import errno
import fcntl
import gc
import json
import os
import struct
import time
from pathlib import Path
from typing import Any

from rocksdict import AccessType, Cache, Options, Rdict

from gnnstream.graph_state import keys
from gnnstream.graph_state.db import check_manifest, family_options, layout_error, other_families, state_corrupted
from gnnstream.graph_state.exceptions import (StateModelMismatch, StateNoEmbeddings, StateNotADirectoryError,
                                              StateNotFoundError, StateReadOnlyError, StateSeedMismatch,
                                              StoreConfigError, StoreLockedError)
from gnnstream.graph_state.store import GraphStore
from gnnstream.graph_state.transaction import Transaction
from gnnstream.model import CONFIG_FILE, LoadedModel, ModelConfig, ModelError, load_model_dir
from gnnstream.workers.engine import Engine

__all__ = ["open_store", "open_engine", "model_identity", "held_identity", "other_model_error", "bind_model_dir",
           "holds_state", "ReadOnlyStore", "MODEL_DIR_META", "BINDING_META"]

MODEL_DIR_META = keys.META_MODEL_DIR  # the model directory the state uses (default of --model)
BINDING_META = keys.META_MODEL  # what the stored embeddings were computed with (written by Engine.backfill)
# the binding's fields that say which model it is
_IDENTITY = ("model", "arch", "weights_sha256", "fanouts", "cold_start")
_BLOCK_CACHE_BYTES = 64 << 20


# ---------------------------------------------------------------------- opening a state
def holds_state(path: str) -> bool:
    """Whether ``path`` is a RocksDB directory (it has the ``CURRENT`` file every opened database has)."""
    return os.path.isfile(os.path.join(path, "CURRENT"))


def _model_seed(model_dir: str | os.PathLike[str]) -> int:
    """The sampling seed in a model directory's config (the full load only when the config cannot be read,
    for its error)."""
    try:
        return ModelConfig.from_dict(json.loads((Path(model_dir) / CONFIG_FILE).read_text())).seed
    except (OSError, ValueError, TypeError, ModelError):
        return load_model_dir(model_dir).config.seed  # raises the model package's own error


def open_store(state: str | os.PathLike[str], *, create: bool, model_dir: str | None = None,
               seed: int | None = None, read_only: bool = False, lock_timeout: float = 10.0,
               edge_ttl: int | None = None) -> GraphStore:
    """Open the graph state in ``state``, creating it only when ``create`` is true.

    Args:
        create: a missing directory is created (commands that write: ``graph load``,
            ``apply``, ``backfill``, ``run``); otherwise it is refused.
        model_dir: the model the state is (to be) used with: a new state takes its
            sampling seed, an existing one must have been created with it.
        seed: a sampling seed given on the command line: must agree with the
            model's; without a model it is the seed of a new state.
        edge_ttl: ``--edge-ttl``: the edge window of a new state (None: none); an existing state must have been
            created with it (None: whatever it holds).
        read_only: open RocksDB read-only under a shared lock (``verify``,
            ``embeddings``, ``graph show``): nothing is ever written.
        lock_timeout: seconds to wait while another process holds the state.

    Raises:
        StateNotADirectoryError: ``state`` is a file.
        StateNotFoundError: no state there and ``create`` is false (or neither a
            model nor a seed says what the new state's seed is).
        StateSeedMismatch: the seeds of the state, the model and ``--seed`` disagree.
        StoreLockedError: another process holds the state.
    """
    path = os.fspath(state)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise StateNotADirectoryError(
            f"state path {path!r} is a file, not a state directory; pass the directory that "
            f"`gnnstream graph load` or `gnnstream apply` created, or a new path")
    exists = holds_state(path)
    if not exists and (not create or read_only):
        if os.path.isdir(path):
            raise StateNotFoundError(
                f"state directory {path!r} holds no graph state (no RocksDB CURRENT file); check the path, "
                f"or create a state with `gnnstream graph load` or `gnnstream apply`")
        raise StateNotFoundError(
            f"state directory {path!r} does not exist; check the path, or create it with "
            f"`gnnstream graph load --state {path} EVENTS` or `gnnstream apply --state {path} --model DIR EVENTS`")
    if read_only:
        if create:
            raise ValueError("a read-only store cannot be created")
        return ReadOnlyStore(path, lock_timeout=lock_timeout)
    model_seed = None if model_dir is None else _model_seed(model_dir)
    if model_seed is not None and seed is not None and seed != model_seed:
        raise StateSeedMismatch(
            f"--seed {seed} disagrees with model {str(model_dir)!r}, which samples with seed {model_seed}; "
            f"leave out --seed (a state takes its sampling seed from its model)")
    want = model_seed if model_seed is not None else seed
    if not exists and want is None:
        raise StateNotFoundError(
            f"state directory {path!r} does not exist and nothing gives its sampling seed; pass --model DIR "
            f"(the state takes the model's seed) to create it")
    try:
        return GraphStore(path, seed=want, lock_timeout=lock_timeout, edge_ttl=edge_ttl)
    except StoreConfigError:
        held = _stored_seed(path, lock_timeout) if want is not None else None
        if held is None or held == want:
            raise
        source = f"model {str(model_dir)!r}" if model_seed is not None else "--seed"
        raise StateSeedMismatch(
            f"state {path!r} samples with seed {held}, but {source} has seed {want}; use a model with seed "
            f"{held} or a new --state directory (a state's seed is fixed when it is created)") from None


def _stored_seed(path: str, lock_timeout: float) -> int | None:
    try:
        with ReadOnlyStore(path, lock_timeout=lock_timeout) as store:
            return store.seed
    except Exception:  # only for a better message: the caller raises the original error
        return None


_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", None)


def _shared_lock(path: str, timeout: float) -> int | None:
    """A shared lock on the state's RocksDB ``LOCK`` file: fails while a writer (which holds it exclusively)
    has the state open, and keeps writers out until released. Returns the descriptor holding it.

    An open-file-description lock where the platform has one: it conflicts
    with RocksDB's lock even within this process, and closing it never
    drops a lock RocksDB holds in the same process.
    """
    lock_path = os.path.join(path, "LOCK")
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except FileNotFoundError:
        return None  # never opened for writing: nobody can hold it
    deadline = time.monotonic() + timeout
    while True:
        try:
            if _OFD_SETLK is not None:
                fcntl.fcntl(fd, _OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_RDLCK, os.SEEK_SET, 0, 0, 0))
            else:  # pragma: no cover - platforms without OFD locks
                fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return fd
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() >= deadline:
                os.close(fd)
                if exc.errno in (errno.EAGAIN, errno.EACCES):
                    raise StoreLockedError(
                        f"graph store {path!r} is locked by another process; stop the other gnnstream "
                        f"process using it (one process per store)") from exc
                raise
            time.sleep(0.1)


class ReadOnlyStore(GraphStore):
    """A graph store opened read-only for the commands that only read (``verify``, ``embeddings``,
    ``graph show``).

    RocksDB is opened read-only (its files are left as they are) under a
    shared lock on its ``LOCK`` file. Any write raises
    :class:`StateReadOnlyError`, except the dirty marks an :class:`Engine`
    writes when it opens a state whose row files fail their checks: those are
    dropped and counted in :attr:`damaged_marks` (``verify`` reports the rows
    as mismatches).
    """

    def __init__(self, path: str | os.PathLike[str], *, lock_timeout: float = 10.0):
        self._lock_fd: int | None = None
        self.damaged_marks = 0
        super().__init__(path, lock_timeout=lock_timeout)

    def _open(self, path: str, lock_timeout: float) -> Rdict:  # type: ignore[override]
        self._lock_fd = _shared_lock(path, lock_timeout)
        try:
            check_manifest(path)  # a MANIFEST cut short: refused, as by a writer
            cache = Cache(_BLOCK_CACHE_BYTES)
            families = {name: family_options(cache, name) for name in keys.COLUMN_FAMILIES}
            try:
                return Rdict(path, options=Options(raw_mode=True), column_families=families,
                             access_type=AccessType.read_only())
            except Exception as exc:  # rocksdict raises plain Exception
                message = str(exc)
                if type(exc) is not Exception:
                    raise
                if message.startswith("Corruption") or ("No such file" in message and "MANIFEST-" in message):
                    raise state_corrupted(path, exc) from exc
                if other_families(exc) or "Column family not found" in message:  # a writer would create it
                    raise layout_error(path, None) from exc
                raise
        except BaseException:
            self._unlock()
            raise

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def close(self) -> None:
        """Close the database and release the lock (safe to call twice). Unlike :meth:`GraphStore.close`,
        nothing is written, not even the record of the MANIFEST's size."""
        try:
            if getattr(self, "_db", None) is not None:
                for view in self._cf.values():
                    view.close()
                self._db.close()
                for holder in ("_cf", "_families", "_handles"):  # they keep the native database alive
                    held = getattr(self, holder, None)
                    if isinstance(held, dict):
                        held.clear()
                self._db = None
                gc.collect()
        finally:
            self._unlock()

    def _refuse(self) -> StateReadOnlyError:
        return StateReadOnlyError(f"a read-only command tried to change state {self.path!r}; nothing was "
                                  f"written (please report this)")

    def _meta_put(self, name: str, value: Any, batch: Any = None) -> None:
        # only GraphStore.__init__ gets here, for a record every state has once its creation finished
        raise StateReadOnlyError(f"state {self.path!r} has no {name} recorded (was its creation interrupted?); "
                                 f"run the command that creates it again (`gnnstream graph load` or "
                                 f"`gnnstream apply`)")

    def _fold_sampled(self) -> None:
        """The in-memory sampled-by index is complete; a new snapshot of it is for a writer to store."""

    def commit(self, tx: Transaction) -> int:
        if tx.records or tx.cleared:
            raise self._refuse()
        self.damaged_marks += sum(len(iids) for _, iids, _ in tx.marks)
        return 0


# ---------------------------------------------------------------------- which model a state holds
def model_identity(config: ModelConfig) -> dict[str, Any]:
    """The fields that make two models the same for a state (see the module docstring), JSON-normalised."""
    return json.loads(json.dumps({"model": config.model_id, "arch": config.arch,
                                  "weights_sha256": config.weights_sha256, "fanouts": list(config.fanouts),
                                  "cold_start": config.cold_start}))


def held_identity(store: GraphStore) -> dict[str, Any] | None:
    """The identity of the model whose embeddings the state holds (None: no complete backfill yet)."""
    raw = store.column("meta").get(BINDING_META)
    if raw is None:
        return None
    try:
        held = json.loads(raw)
    except ValueError:
        held = None
    if not isinstance(held, dict):
        raise StateModelMismatch(f"state {store.path!r} has an unreadable model record; rebuild its embeddings "
                                 f"with `gnnstream backfill --state {store.path} --model DIR`")
    return {k: held[k] for k in _IDENTITY if k in held}


def _differences(held: dict[str, Any], want: dict[str, Any]) -> list[str]:
    return [k for k in _IDENTITY if k not in held or held[k] != want[k]]


def _show(identity: dict[str, Any], key: str) -> str:
    value = identity.get(key)
    if key == "weights_sha256" and isinstance(value, str):
        return value[:12]
    if key == "cold_start" and isinstance(value, dict):
        return str(value.get("policy"))
    return json.dumps(value) if not isinstance(value, str) else value


def bind_model_dir(store: GraphStore, model_dir: str | os.PathLike[str]) -> None:
    """Record ``model_dir`` as the state's model directory (the default of ``--model``)."""
    value = str(Path(model_dir).resolve()).encode()
    meta = store.column("meta")
    if meta.get(MODEL_DIR_META) != value:
        meta.put(MODEL_DIR_META, value)


def other_model_error(store: GraphStore, model_dir: str | os.PathLike[str], config: ModelConfig,
                 held: dict[str, Any] | None) -> StateModelMismatch | None:
    """The error for using the model in ``model_dir`` on a state holding the embeddings of ``held``, or None
    when the state holds none or that model's."""
    if held is None:
        return None
    want = model_identity(config)
    differ = _differences(held, want)
    if not differ:
        return None
    fields = ", ".join(f"{k} {_show(held, k)} in the state, {_show(want, k)} in the model" for k in differ)
    return StateModelMismatch(
        f"state {store.path!r} holds the embeddings of model {held.get('model')}, and the model in "
        f"{str(model_dir)!r} ({want['model']}) is another one: {fields} (models are the same when tag, arch, "
        f"weights sha256, fanouts and cold-start policy agree); switching a state to another model is "
        f"explicit: run `gnnstream backfill --state {store.path} --model {model_dir}`")


def open_engine(store: GraphStore, model_dir: str | None, *, switch_model: bool = False,
                **engine_args: Any) -> Engine:
    """An engine for ``store`` with the model in ``model_dir`` (default: the one the state uses).

    Args:
        switch_model: allow a model other than the one whose embeddings the
            state holds (only ``backfill`` passes it: it rewrites them all, and
            records the new model directory when done).

    Raises:
        StateNoEmbeddings: no model given and none recorded; or, read-only, the
            state holds no embeddings to read.
        StateModelMismatch: the state holds embeddings of another model.
    """
    read_only = isinstance(store, ReadOnlyStore)
    meta = store.column("meta")
    if model_dir is None:
        raw = meta.get(MODEL_DIR_META)
        if raw is None:
            raise StateNoEmbeddings(f"state {store.path!r} has no model yet; pass --model DIR")
        model_dir = raw.decode()
    model: LoadedModel = load_model_dir(model_dir)
    held = held_identity(store)
    other = other_model_error(store, model_dir, model.config, held)
    if other is not None and not switch_model:
        raise other
    if read_only and held is None:
        raise StateNoEmbeddings(
            f"state {store.path!r} holds no embeddings yet; compute them with "
            f"`gnnstream backfill --state {store.path} --model {model_dir}`")
    engine = Engine(store, model, **engine_args)
    if not read_only and other is None:
        bind_model_dir(store, model_dir)
    return engine
