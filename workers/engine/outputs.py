"""The final layer's outputs: each node's version, event time and mode in the page log, the outbox record
of what changed, the withdrawal of deleted nodes, and the columns the publisher reads back."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from gnnstream.graph_state import keys
from gnnstream.graph_state.idsets import unique_ids
from gnnstream.graph_state.outbox import Outbox
from gnnstream.graph_state.page_log import PageLog
from gnnstream.graph_state.row_cache import EmbeddingTables
from gnnstream.graph_state.store import GraphStore
from gnnstream.graph_state.transaction import Transaction
from gnnstream.stream.delivery import UpdateColumns
from gnnstream.workers.engine.layers import LayerRunner
from gnnstream.workers.engine.shards import OutputShards
from gnnstream.workers.engine.stats import RecomputeStats

__all__ = ["FinalOutputs", "DELETED"]

DELETED = "deleted"  # mode of a withdrawn embedding (its meta keeps the version floor)


class FinalOutputs:
    """Writes what goes with a node's final row, and reads it back for publishing.

    Args:
        store: the graph store.
        meta: the final layer's page log (versions, event times, modes and rows).
        tables: the row cache (the final rows, read back for publishing).
        shards: whose changes are published (:class:`OutputShards`).
        outbox: where the changed nodes are recorded (:class:`Outbox`).
        policy: the model's cold-start policy (a node's mode).
        layers: the layers' runner (a staged node's stage).
    """

    def __init__(self, store: GraphStore, meta: PageLog, tables: EmbeddingTables, shards: OutputShards,
                 outbox: Outbox, policy: Any, layers: LayerRunner):
        self.store, self.meta, self.tables = store, meta, tables
        self.shards, self.outbox, self.policy, self.layers = shards, outbox, policy, layers
        self.final_layer = len(tables.dims) - 1
        self.staged = bool(getattr(policy, "by_age", False))
        self.deleted_code = meta.code(DELETED)
        self._mode_of: dict[int, int] = {}  # mode code by degree * 2 + has features (the policy is fixed)

    def mode_codes(self, iids: np.ndarray, degree: np.ndarray, flags: np.ndarray) -> np.ndarray:
        """The policy's mode of nodes with these records, as :class:`PageLog` codes (one policy call per
        distinct input)."""
        has = (flags & keys.FLAG_HAS_FEATURES) != 0
        if self.staged:  # the mode follows the stage, which follows the age
            stage = self.layers.stages(iids).astype(np.int64)
            names = [self.meta.code(self.policy.stage_mode(h, 0, s)) for s in range(3) for h in (False, True)]
            return np.asarray(names, dtype=np.int16)[stage * 2 + has] if len(iids) else np.zeros(0, np.int16)
        combo = np.maximum(degree, 0) * 2 + has
        combos = unique_ids(combo)
        inverse = np.searchsorted(combos, combo)
        known = self._mode_of
        for c in combos.tolist():
            if c not in known:
                known[c] = self.meta.code(self.policy.mode(bool(c & 1), c >> 1))
        return np.fromiter(map(known.__getitem__, combos.tolist()), np.int16, len(combos))[inverse]

    def write(self, iids: np.ndarray, rows: np.ndarray, tx: Transaction, *, publish: bool, stats: RecomputeStats,
              event_ts: float | None) -> None:
        """Add to ``tx`` the final rows of ``iids`` with their next versions, event times and modes, and (with
        ``publish``) an outbox record of those this worker publishes."""
        old_version, _, _ = self.meta.get(iids)
        degree, flags, last_ts = self.store.node_arrays(iids)
        versions = self.shards.next_versions(old_version)
        times = np.maximum(last_ts, event_ts or 0.0)
        self.meta.set(iids, versions, times, self.mode_codes(iids, degree, flags))
        tx.add(self.meta.encode(iids, rows))
        self._record(tx, iids, publish, stats)

    def withdraw(self, gone: np.ndarray, tx: Transaction, publish: bool, stats: RecomputeStats, *,
                 again: bool = False) -> None:
        """Withdraw the final embeddings of deleted nodes that have one (``again``: every one of ``gone``)."""
        if not len(gone):
            return
        version, event_ts, mode = self.meta.get(gone)
        # the meta stays as a version floor, so a re-created node keeps counting up
        withdraw = np.ones(len(gone), dtype=bool) if again else (mode >= 0) & (mode != self.deleted_code)
        ids, versions, times = gone[withdraw], self.shards.next_versions(version[withdraw]), event_ts[withdraw]
        if not len(ids):
            return
        self.meta.set(ids, versions, times, np.full(len(ids), self.deleted_code, dtype=np.int16))
        tx.add(self.meta.encode(ids, None))
        self._record(tx, ids, publish, stats)

    def _record(self, tx: Transaction, iids: np.ndarray, publish: bool, stats: RecomputeStats) -> None:
        sent = iids if self.shards.publishes_all else iids[self.shards.published(iids)]
        if publish and len(sent):
            self.outbox.append(tx, sent, time.time())
            stats.published += len(sent)

    def columns(self, iids: np.ndarray, computed_at: float) -> UpdateColumns:
        """What to publish for the nodes of an outbox record, as columns: their stored state now.

        One metadata lookup and one :meth:`EmbeddingTables.get` for all of
        them. A node without stored metadata (none was ever computed), or
        whose final row is missing, is left out; a withdrawn node comes back
        with mode ``deleted``, ``deleted`` set and a zero row.
        """
        iids = np.asarray(iids, dtype=np.int64)
        version, event_ts, mode = self.meta.get(iids)
        rows, present = self.tables.get(self.final_layer, iids)
        deleted = mode == self.deleted_code
        keep = (mode >= 0) & (deleted | present)
        if not keep.all():
            iids, version, event_ts, mode, rows, deleted = (
                iids[keep], version[keep], event_ts[keep], mode[keep], rows[keep], deleted[keep])
        names = self.meta.names
        return UpdateColumns(list(map(self.store.name, iids.tolist())), version.astype(np.int64),
                             event_ts.astype(np.float64), float(computed_at),
                             [names[c] for c in mode.tolist()], rows, deleted, iids, mode)
