"""Errors raised by the graph store."""

from __future__ import annotations

__all__ = ["GraphStateError", "StoreLockedError", "StoreConfigError", "OffsetRegressionError"]


class GraphStateError(Exception):
    """Base class of graph-store errors."""


class StoreLockedError(GraphStateError):
    """The RocksDB directory is held by another process."""


class StoreConfigError(GraphStateError, ValueError):
    """The store was opened with settings that contradict what it holds."""


class OffsetRegressionError(GraphStateError, ValueError):
    """A batch tried to move a stored consumer offset backwards."""


# ---------------------------------------------------------------------- a state's identity (gnnstream.workers.state.open_store)
class StateNotFoundError(GraphStateError):
    """A command that only reads a state was given a path that holds none (missing, or not a state directory)."""


class StateNotADirectoryError(GraphStateError):
    """The ``--state`` path is a plain file (or something else that is not a directory)."""


class StateSeedMismatch(StoreConfigError):
    """The sampling seed a state was created with is not the model's (or not the ``--seed`` given)."""


class StateModelMismatch(GraphStateError):
    """The state holds the embeddings of another model; only ``gnnstream backfill --model`` switches it."""


class StateNoEmbeddings(GraphStateError):
    """The state has no model (or no embeddings) yet where a command needs them."""


class StateReadOnlyError(GraphStateError):
    """A read-only command (verify, embeddings, graph show) would have written to the state."""


class StateLayoutError(GraphStateError):
    """The state was written with another layout than this version reads; it must be rebuilt."""


__all__ += ["StateNotFoundError", "StateNotADirectoryError", "StateSeedMismatch", "StateModelMismatch",
            "StateNoEmbeddings", "StateReadOnlyError", "StateLayoutError"]


# ---------------------------------------------------------------------- damaged state (graph_state.db)
class StateCorrupted(GraphStateError):
    """RocksDB found a state directory's files damaged (a checksum mismatch, a truncated MANIFEST): a read
    cannot be trusted to be complete. The message is one line naming the damaged file and what to do."""


__all__ += ["StateCorrupted"]


# ---------------------------------------------------------------------- snapshots (graph_state.snapshot)
class SnapshotTargetError(GraphStateError):
    """``gnnstream snapshot --out`` names a path a snapshot cannot be written to: it exists and is not an empty
    directory, or it lies inside the state being copied."""


__all__ += ["SnapshotTargetError"]
