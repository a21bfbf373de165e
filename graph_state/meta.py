"""What a state records about itself: its identity (layout, sampling seed, feature length), the other JSON
records of the ``meta`` family, and the consumed offsets (``offsets``)."""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Mapping

from gnnstream.graph_state import keys
from gnnstream.graph_state.batch import Batch
from gnnstream.graph_state.db import Columns, Family, layout_error
from gnnstream.graph_state.exceptions import OffsetRegressionError, StoreConfigError

__all__ = ["StateMeta", "stored_offsets", "check_offsets"]

logger = logging.getLogger(__name__)


class StateMeta:
    """The JSON records of the ``meta`` family (names: :mod:`gnnstream.graph_state.keys`, ``META_*``).

    Args:
        columns: the open state.
        following: the store follows another process's writes (it writes nothing).
        put: how a record is written: ``put(name, value, batch or None)``, the store's
            :meth:`GraphStore._meta_put` (which a read-only store refuses).
    """

    def __init__(self, columns: Columns, following: bool, put: Callable[[str, Any, Batch | None], None]):
        self._columns = columns
        self._following = following
        self._put = put

    def get(self, name: str) -> Any:
        """The record ``name`` (``None`` if there is none)."""
        raw = self._columns.views["meta"].get(name.encode())
        return None if raw is None else json.loads(raw)

    def write(self, name: str, value: Any, batch: Batch | None = None) -> None:
        """Store the record ``name``: in ``batch``, or at once without one."""
        data = json.dumps(value).encode()
        if batch is None:
            self._columns.views["meta"].put(name.encode(), data)
        else:
            batch.put("meta", name.encode(), data)

    def fanouts(self) -> tuple[int, ...]:
        """The stored fanouts (none when unset)."""
        stored = self.get(keys.META_FANOUTS)
        return tuple(stored) if stored else ()

    def next_iid(self) -> int:
        """The next interned id to hand out, as stored."""
        return self.get(keys.META_NEXT_IID) or 0

    def check_layout(self) -> None:
        """Refuse a state written with another layout (:data:`gnnstream.graph_state.keys.LAYOUT`), or one a bulk load
        left unfinished; record the layout in a new one."""
        path = self._columns.path
        stored = self.get(keys.META_LAYOUT)
        if stored == keys.LAYOUT:
            if self.get(keys.META_BULK_LOAD):
                raise StoreConfigError(f"state {path!r}: a bulk load (`gnnstream graph load`) was cut short; "
                                       f"delete the directory and run the load again")
            return
        if stored is None and next(self._columns.families["meta"].keys(), None) is None:  # a new state
            if not self._following:
                self._put(keys.META_LAYOUT, keys.LAYOUT, None)
            return
        raise layout_error(path, stored)

    def init_int(self, name: str, value: int | None, default: int | None) -> int | None:
        """The stored non-negative integer ``name``, which ``value`` must match when given; a new state records
        ``value`` (or ``default``).

        Raises:
            StoreConfigError: ``value`` differs from the stored one.
        """
        stored = self.get(name)
        if stored is not None:
            if value is not None and value != stored:
                raise StoreConfigError(
                    f"store {self._columns.path!r} was created with {name}={stored}, not {value}; "
                    f"use a new --state directory or pass {name}={stored}"
                )
            return stored
        chosen = default if value is None else value
        if chosen is not None and not self._following:
            if isinstance(chosen, bool) or not isinstance(chosen, int) or chosen < 0:
                raise ValueError(f"Expected a non-negative integer {name} (got {chosen!r})")
            self._put(name, chosen, None)
        return chosen


def stored_offsets(family: Family) -> dict[tuple[str, int], int]:
    """The next offset of every consumed ``(topic, partition)``, from the ``offsets`` family."""
    return {keys.decode_offset_key(k): keys.U64.unpack(v)[0] for k, v in family.items()}


def check_offsets(current: Mapping[tuple[str, int], int], offsets: Mapping[tuple[str, int], int]) -> None:
    """Check the offsets a batch consumed against the stored ones.

    Raises:
        ValueError: an offset that is not a non-negative integer.
        OffsetRegressionError: an offset moving backwards.
    """
    for tp, off in offsets.items():
        if isinstance(off, bool) or not isinstance(off, int) or off < 0:
            raise ValueError(f"Expected a non-negative integer offset for {tp} (got {off!r})")
        if off < current.get(tp, 0):
            raise OffsetRegressionError(f"offset of {tp[0]}[{tp[1]}] would move back from {current[tp]} to {off}")
