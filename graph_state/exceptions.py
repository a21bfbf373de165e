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
