"""Nodes: id strings interned to dense integers (``ids``, ``names``) and node records (``nodes``), each with its
in-memory cache."""

from __future__ import annotations

import logging
from typing import Iterator, Sequence

import numpy as np

from gnnstream.graph_state import keys
from gnnstream.graph_state.batch import Batch
from gnnstream.graph_state.db import Columns
from gnnstream.graph_state.idsets import unique_ids
from gnnstream.graph_state.prefixes import GONE, DenseNodes, Node

__all__ = ["NodeIds", "NodeRecords"]

logger = logging.getLogger(__name__)

_UNREAD = object()  # a node record not read yet (``records`` holds None for an absent node)


class NodeIds:
    """Node id strings and their interned ids, cached both ways.

    Args:
        columns: the open state.
        next_iid: the next id to hand out (as stored).
    """

    def __init__(self, columns: Columns, next_iid: int):
        self._columns = columns
        self.iid_of: dict[str, int] = {}
        self.name_of: dict[int, str] = {}
        self.next_iid = next_iid

    def warm(self, room: int) -> int:
        """Read up to ``room`` ids not held yet from RocksDB; return how many were read."""
        read = 0
        if room <= 0:
            return read
        known, names, decode = self.iid_of, self.name_of, keys.decode_iid
        for key, raw in self._columns.families["ids"].items():
            name = key.decode()
            if name not in known:
                iid = decode(raw)
                known[name] = iid
                names[iid] = name
                read += 1
                if read >= room:
                    break
        return read

    def iid(self, name: str) -> int | None:
        """The interned id of ``name``, or None if it was never seen."""
        iid = self.iid_of.get(name)
        if iid is None:
            raw = self._columns.views["ids"].get(name.encode())
            if raw is None:
                return None
            iid = keys.decode_iid(raw)
            self.iid_of[name] = iid
            self.name_of[iid] = name
        return iid

    def name(self, iid: int) -> str:
        """The id string of interned id ``iid``.

        Raises:
            KeyError: no node was ever interned as ``iid``.
        """
        name = self.name_of.get(iid)
        if name is None:
            raw = self._columns.views["names"].get(keys.encode_iid(iid))
            if raw is None:
                raise KeyError(f"no node with internal id {iid}")
            name = raw.decode()
            self.name_of[iid] = name
            self.iid_of[name] = iid
        return name

    def read(self, names: Sequence[str]) -> None:
        """Read the ids of ``names`` (none held yet) with one multi-get."""
        for name, raw in zip(names, self._columns.views["ids"].get([n.encode() for n in names])):
            if raw is not None:
                iid = keys.decode_iid(raw)
                self.iid_of[name] = iid
                self.name_of[iid] = name

    def intern(self, name: str, batch: Batch) -> int:
        """The id of ``name``, handing out (and writing in ``batch``) a new one for a new name."""
        iid = self.iid_of.get(name)  # the common case, without a call
        if iid is None:
            iid = self.iid(name)
        if iid is None:
            iid = self.next_iid
            self.next_iid += 1
            self.iid_of[name] = iid
            self.name_of[iid] = name
            batch.put("ids", name.encode(), keys.encode_iid(iid))
            batch.put("names", keys.encode_iid(iid), name.encode())
        return iid

    def clear(self) -> None:
        self.iid_of.clear()
        self.name_of.clear()


class NodeRecords:
    """Node records by iid: decoded records (mutated in place during a batch and encoded once at its end) and
    the dense columns the engine reads many nodes at once from (:class:`DenseNodes`)."""

    def __init__(self, columns: Columns):
        self._columns = columns
        self.records: dict[int, Node | None] = {}
        self.dense = DenseNodes()

    def get(self, iid: int) -> Node | None:
        """The record of ``iid`` (None: no such node)."""
        node = self.records.get(iid, _UNREAD)  # one lookup; None is an absent node
        if node is not _UNREAD:
            return node
        node = Node.decode(self._columns.views["nodes"].get(keys.encode_iid(iid)))
        self.records[iid] = node
        return node

    def put(self, iid: int, node: Node | None, batch: Batch) -> None:
        """Set the record of ``iid`` in the open ``batch`` (None deletes the node)."""
        self.records[iid] = node
        batch.nodes.add(iid)

    def read(self, cold: list[int]) -> None:
        """Read the records of ``cold`` (none held yet): from the dense columns where they have them (they hold
        what is stored), else with one multi-get."""
        ids = np.fromiter(cold, np.int64, len(cold))
        dense = self.dense
        mirrored = np.zeros(len(ids), dtype=bool)
        inside = ids < len(dense.known)
        mirrored[inside] = dense.known[ids[inside]]
        hit = ids[mirrored]
        for iid, degree, flags, last_ts, first_ts in zip(hit.tolist(), dense.degree[hit].tolist(),
                                                         dense.flags[hit].tolist(), dense.last_ts[hit].tolist(),
                                                         dense.first_ts[hit].tolist()):
            self.records[iid] = None if degree < 0 else Node(degree, flags, last_ts, first_ts)
        cold = ids[~mirrored].tolist()
        if cold:
            for iid, raw in zip(cold, self._columns.views["nodes"].get([keys.encode_iid(i) for i in cold])):
                self.records[iid] = Node.decode(raw)

    def arrays(self, iids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(degree, flags, last_ts)`` of many nodes as arrays; degree is -1 where a node is absent."""
        iids = np.asarray(iids, dtype=np.int64)
        dense = self.dense
        if len(iids) == 0:
            return dense.degree[:0].copy(), dense.flags[:0].copy(), dense.last_ts[:0].copy()
        dense.grow(int(iids.max()) + 1)
        missing = iids[~dense.known[iids]]
        if len(missing):
            missing = unique_ids(missing).tolist()
            records = self.records
            cold = [iid for iid in missing if iid not in records]
            if cold:
                self.read(cold)
            nodes = [records[iid] for iid in missing]
            dense.set_many(missing, [-1 if node is None else node.degree for node in nodes],
                           [0 if node is None else node.flags for node in nodes],
                           [0.0 if node is None else node.last_ts for node in nodes],
                           [0.0 if node is None else node.first_ts for node in nodes])
        return dense.degree[iids], dense.flags[iids], dense.last_ts[iids]

    def first_ts(self, iids: np.ndarray) -> np.ndarray:
        """``first(v)`` of many nodes (0 where a node is absent)."""
        iids = np.asarray(iids, dtype=np.int64)
        if len(iids):
            self.arrays(iids)  # fills the columns of nodes not held yet
        return self.dense.first_ts[iids]

    def encode(self, batch: Batch) -> None:
        """Write the records the batch touched into its WriteBatch, and keep them as columns for
        :meth:`committed`."""
        put, delete, family = batch.wb.put, batch.wb.delete, batch.handles["nodes"]
        pack_key, pack_node, nodes = keys.U64.pack, keys.NODE_RECORD.pack, self.records
        touched = list(batch.nodes)
        records = [nodes[iid] for iid in touched]
        gone = [i for i, node in enumerate(records) if node is None]
        for i in gone:
            delete(pack_key(touched[i]), family)
            records[i] = GONE
        degree = [node.degree for node in records]
        flags = [node.flags for node in records]
        last_ts = [node.last_ts for node in records]
        first_ts = [node.first_ts for node in records]
        columns = zip(touched, degree, flags, last_ts, first_ts)
        if gone:  # the deleted ones were deleted above
            columns = (column for column, node in zip(columns, records) if node is not GONE)
        for iid, deg, flag, ts, first in columns:
            put(pack_key(iid), pack_node(deg, flag, ts, first), family)
        batch.node_columns = touched, degree, flags, last_ts, first_ts

    def committed(self, batch: Batch) -> None:
        """The batch is written: its records join the dense columns."""
        self.dense.set_many(*batch.node_columns)

    def iids(self) -> Iterator[int]:
        """Interned ids of every existing node, in id order."""
        for key in self._columns.families["nodes"].keys():
            yield keys.decode_iid(key)

    def count(self) -> int:
        """The number of existing nodes (one scan)."""
        return sum(1 for _ in self._columns.families["nodes"].keys())

    def clear(self) -> None:
        self.records.clear()
        self.dense = DenseNodes()
