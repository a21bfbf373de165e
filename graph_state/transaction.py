"""Writes outside :meth:`GraphStore.apply`, gathered and committed in one WriteBatch (:meth:`GraphStore.commit`).

The engine, the publisher and the worker write the state only through a
transaction: caller metadata, consumed offsets, outbox records, dirty marks,
and the page-log records that :mod:`gnnstream.graph_state.page_log` encodes. They never
name a column family or build a key; the store does, when it commits.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

from gnnstream.graph_state import keys

__all__ = ["Transaction"]

Record = tuple[str, bytes, "bytes | None"]


class Transaction:
    """The writes of one atomic commit, in the order they were added (a later write of a key wins)."""

    def __init__(self) -> None:
        self.records: list[Record] = []  # (family, key, value or None to delete)
        self.marks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (tags, iids, flags) blocks
        self.cleared: list[str] = []  # families emptied first, with one range delete each

    def __len__(self) -> int:
        return len(self.records) + len(self.marks) + len(self.cleared)

    def set_meta(self, name: bytes, value: bytes | None) -> None:
        """Store (or, with None, delete) the caller's ``meta`` record ``name``."""
        self.records.append(("meta", name, value))

    def set_offsets(self, offsets: Mapping[tuple[str, int], int]) -> None:
        """Store the next offset of each ``(topic, partition)``."""
        self.records.extend(("offsets", keys.offset_key(topic, partition), keys.U64.pack(offset))
                            for (topic, partition), offset in offsets.items())

    def put_outbox(self, seq: int, record: bytes) -> None:
        """Queue outbox record number ``seq``."""
        self.records.append(("outbox", keys.U64.pack(seq), record))

    def remove_outbox(self, stored_keys: Iterable[bytes]) -> None:
        """Remove the outbox records of these keys (as :meth:`GraphStore.outbox` hands them out)."""
        self.records.extend(("outbox", key, None) for key in stored_keys)

    def clear_outbox(self) -> None:
        self.cleared.append("outbox")

    def add_marks(self, tags: np.ndarray, iids: np.ndarray, flags: np.ndarray) -> None:
        """Mark ``(tag, iid)`` pairs dirty with ``flags`` (OR-combined with marks already stored)."""
        self.marks.append((np.asarray(tags), np.asarray(iids), np.asarray(flags, dtype=np.uint8)))

    def clear_marks(self) -> None:
        """Remove every dirty mark stored before this transaction (its own :meth:`add_marks` stay)."""
        self.cleared.append("dirty")

    def add(self, records: Iterable[Record]) -> None:
        """Records the state layer encoded itself (the page logs of :mod:`gnnstream.graph_state.page_log`)."""
        self.records.extend(records)
