"""The output partitions whose nodes' final rows an engine keeps current, and publishes, in a group.

Every worker of a group keeps the whole graph and the layers in between;
the final layer is sharded by the partitions of the output topic that the
group hands each worker (a node being in the partition its id maps to,
:mod:`gnnstream.stream.partitioning`). A version is
``(epoch << EPOCH_SHIFT) + a count``, so whoever owns a partition next
publishes above every earlier owner (docs/scaling.md).
"""

from __future__ import annotations

import json

import numpy as np

from gnnstream.graph_state import keys
from gnnstream.graph_state.idsets import unique_ids
from gnnstream.graph_state.store import GraphStore
from gnnstream.graph_state.transaction import Transaction
from gnnstream.stream.partitioning import partitions_for

__all__ = ["OutputShards", "kept_partitions", "KEPT_META", "EPOCH_META", "EPOCH_SHIFT"]

KEPT_META = keys.META_KEPT_PARTITIONS  # {"count", "kept"}: the output partitions whose final rows are current
EPOCH_META = keys.META_HIGHEST_EPOCH  # the highest epoch this state has owned partitions at
EPOCH_SHIFT = 32  # a version is (the owner's epoch << 32) + a count within it


def kept_partitions(store: GraphStore) -> "tuple[int, set[int]] | None":
    """``(count, partitions)``: the output partitions (of ``count``) whose final rows ``store`` holds
    current, as last recorded by a worker of a group (None: every node's)."""
    raw = store.column("meta").get(KEPT_META)
    if raw is None:
        return None
    obj = json.loads(raw)
    return int(obj["count"]), set(obj["kept"])


class OutputShards:
    """Which nodes' final rows are kept and published: all of them, or those of some output partitions.

    Args:
        store: the graph store the choice is recorded in.
    """

    def __init__(self, store: GraphStore):
        self.store = store
        self.count = 0  # partitions of the output topic
        self.epoch = 0  # this worker's epoch as the owner of its partitions (0: no group)
        # masks over the output topic's partitions; None = every node
        self._kept: np.ndarray | None = None  # final rows computed and stored
        self._published: np.ndarray | None = None  # changes also published
        self._partition = np.zeros(0, dtype=np.int32)  # by iid: the node's output partition, -1 = not known yet

    @property
    def every(self) -> bool:
        """Whether every node's final row is kept (no group)."""
        return self._kept is None

    def kept_set(self) -> "set[int]":
        """The partitions whose final rows are kept (empty with :attr:`every`)."""
        return set() if self._kept is None else set(np.flatnonzero(self._kept).tolist())

    def own(self, keep: "set[int] | None", publish: "set[int] | None" = None, count: int = 0,
            epoch: int | None = None) -> None:
        """See :meth:`gnnstream.workers.engine.Engine.own`."""
        if keep is None:
            self._kept = self._published = None
            self.epoch = 0
            return
        publish = set(keep) if publish is None else set(publish)
        if any(not 0 <= p < count for p in set(keep) | publish):
            raise ValueError(f"Expected partitions in [0, {count}) (got {sorted(set(keep) | publish)})")
        if count != self.count:
            self._partition = np.zeros(0, dtype=np.int32)
        self.count = count
        if epoch is not None:
            self.epoch = epoch
            if epoch > self.highest_epoch():
                tx = Transaction()
                tx.set_meta(EPOCH_META, keys.U64.pack(epoch))
                self.store.commit(tx)
        self._kept, self._published = self.mask(keep), self.mask(publish)
        # a partition dropped is recorded before anything else happens; one added, by take_over once done
        stored = self.stored()
        if stored is None:  # every node's row was current
            self.record_kept(tx := Transaction(), set(keep))
            self.store.commit(tx)
        elif stored[0] != count or not stored[1] <= set(keep):
            self.record_kept(tx := Transaction(), stored[1] & set(keep) if stored[0] == count else set())
            self.store.commit(tx)

    def stored(self) -> "tuple[int, set[int]] | None":
        """:func:`kept_partitions` of the store."""
        return kept_partitions(self.store)

    def highest_epoch(self) -> int:
        """The highest epoch at which this state has owned partitions (0: never)."""
        raw = self.store.column("meta").get(EPOCH_META)
        return 0 if raw is None else keys.U64.unpack(raw)[0]

    def record_kept(self, tx: Transaction, kept: "set[int] | None") -> None:
        """Record in ``tx`` that the final rows of ``kept`` are current (None: every node's)."""
        if kept is None:
            tx.set_meta(KEPT_META, None)
            return
        tx.set_meta(KEPT_META, json.dumps({"count": self.count, "kept": sorted(kept)}).encode())

    def mask(self, partitions: "set[int]") -> np.ndarray:
        """``partitions`` as a mask over the :attr:`count` output partitions."""
        mask = np.zeros(self.count, dtype=bool)
        mask[list(partitions)] = True
        return mask

    def partitions_of(self, iids: np.ndarray) -> np.ndarray:
        """The output partition of each node (among :attr:`count`)."""
        iids = np.asarray(iids, dtype=np.int64)
        if not len(iids):
            return np.zeros(0, dtype=np.int32)
        have = len(self._partition)
        top = int(iids.max()) + 1
        if top > have:
            grown = np.full(max(top, have + have // 2), -1, dtype=np.int32)
            grown[:have] = self._partition
            self._partition = grown
        part = self._partition
        unknown = unique_ids(iids[part[iids] < 0])
        if len(unknown):
            part[unknown] = partitions_for(map(self.store.name, unknown.tolist()), self.count)
        return part[iids]

    def within(self, mask: "np.ndarray | None", iids: np.ndarray) -> np.ndarray:
        """Which of ``iids`` lie in the partitions of ``mask`` (None: all)."""
        if mask is None:
            return np.ones(len(iids), dtype=bool)
        if not mask.any():
            return np.zeros(len(iids), dtype=bool)
        return mask[self.partitions_of(iids)]

    def kept(self, iids: np.ndarray) -> np.ndarray:
        """Which of ``iids`` have their final rows kept here."""
        return self.within(self._kept, iids)

    def published(self, iids: np.ndarray) -> np.ndarray:
        """Which of ``iids`` have their changes published here."""
        return self.within(self._published, iids)

    @property
    def publishes_all(self) -> bool:
        """Whether every kept node's changes are published."""
        return self._published is None

    def next_versions(self, old: np.ndarray) -> np.ndarray:
        """Versions for new values of nodes whose stored versions are ``old``.

        One past the old version, and at least ``epoch << EPOCH_SHIFT``:
        strictly increasing per node, and above every version an earlier owner
        of the node's partition published, whose epoch was lower. Without a
        group the epoch is 0.
        """
        return np.maximum(old + 1, self.epoch << EPOCH_SHIFT)
