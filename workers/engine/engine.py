"""The incremental engine: exact recompute, layer by layer, of only the embeddings an event can change.

:meth:`Engine.recompute` walks the store's dirty marks as a wavefront (docs/design.md, "What a change
recomputes"); :meth:`Engine.backfill` computes every node from scratch and :meth:`Engine.from_scratch` does
so in memory for ``verify``; :meth:`Engine.own` and :meth:`Engine.take_over` shard the final layer in a group.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np
import torch

from gnnstream.graph_state import keys
from gnnstream.graph_state.idsets import setdiff_ids, unique_ids
from gnnstream.graph_state.marks import DIRTY_COUNT, DIRTY_DEGREE, DIRTY_INPUT, DIRTY_SAMPLE
from gnnstream.graph_state.store import GraphStore
from gnnstream.graph_state.transaction import Transaction
from gnnstream.stream.delivery import UpdateColumns
from gnnstream.stream.events import MAX_EVENT_BYTES, check_features, decode_event_json
from gnnstream.graph_state.outbox import Outbox
from gnnstream.graph_state.page_log import PageLog, layer_logs_from
from gnnstream.graph_state.row_cache import EmbeddingTables
from gnnstream.workers.engine.device import check_device, threads_for
from gnnstream.workers.engine.layers import LayerRunner
from gnnstream.workers.engine.outputs import DELETED, FinalOutputs
from gnnstream.workers.engine.rows import CachedRows, DenseRows, Rows
from gnnstream.workers.engine.shards import OutputShards
from gnnstream.workers.engine.stages import STAGE_NAMES, StageClock
from gnnstream.workers.engine.stats import EngineError, RecomputeStats
from gnnstream.workers.engine.typed import TypedLayout, bind_schema

__all__ = ["Engine", "RecomputeStats", "EngineError", "DEFERRED_TAG", "DELETED"]

logger = logging.getLogger(__name__)

DEFERRED_TAG = 0x8000  # dirty key tag 0x8000 + l: dependents of v at layer l are pending
_ATOL = 1e-6
_HEAD_COLUMNS = 8  # entries of a recomputed row compared first (one 32-byte read per held row)
_FINAL_CHUNK = 50_000  # final rows a backfill writes per WriteBatch


class Engine:
    """Keeps the stored embeddings of a graph store equal to the model's output.

    Args:
        store: the graph store; its fanouts are set to the model's.
        model: a :class:`gnnstream.model.LoadedModel`.
        chunk_nodes: targets per vectorised layer call (bounds memory).
        hub_bound: dependents above which a node's propagation is deferred.
        max_deferred_age: seconds a deferred propagation may wait.
    """

    def __init__(
        self,
        store: GraphStore,
        model: Any,
        *,
        chunk_nodes: int = 32_768,
        hub_bound: int = 50_000,
        max_deferred_age: float = 5.0,
    ):
        self.store = store
        self.model = model
        cfg = model.config
        schema = cfg.graph_schema
        self.typed = TypedLayout(schema, store) if schema is not None else None
        self.fanouts: list[int] = list(cfg.fanouts)
        self.num_layers = len(self.fanouts)
        self.model_tag = f"{cfg.name}:{cfg.version}"
        # what the stored embeddings were computed with: a different model, even under the same tag, needs a backfill
        self.binding = json.dumps({"model": self.model_tag, "arch": cfg.arch, "weights_sha256": cfg.weights_sha256,
                                   "fanouts": list(cfg.fanouts), "cold_start": cfg.cold_start}, sort_keys=True)
        self.gnn = model.model
        self.policy = model.cold_start
        self.plain = self.policy.name == "plain"
        self.staged = bool(self.policy.by_age)
        self.chunk_nodes = chunk_nodes
        self.hub_bound = hub_bound
        self.max_deferred_age = max_deferred_age
        if store.seed != cfg.seed:
            raise EngineError(
                f"model {self.model_tag} samples with seed {cfg.seed} but store {store.path!r} "
                f"was created with seed {store.seed}; create the store with --seed {cfg.seed}"
            )
        in_dim = self.typed.width if self.typed is not None else cfg.in_dim
        if self.typed is not None and not self.plain:
            raise EngineError(f"model {self.model_tag} is typed with the {self.policy.name!r} cold-start policy; "
                              f"typed graphs are served with the plain policy")
        bind_schema(store, cfg.schema, self.model_tag)
        if store.feature_dim is not None and store.feature_dim != in_dim:
            raise EngineError(
                f"model {self.model_tag} expects {in_dim} input features but store "
                f"{store.path!r} holds {store.feature_dim}-dim features"
            )
        store.set_feature_dim(in_dim)
        store.set_fanouts(self.fanouts)
        for k in set(self.fanouts):  # build the in-memory sampled-by index now, not in the first batch
            store.sampled_by_many(k, np.zeros(0, dtype=np.int64), None)
        store.warm_ids()
        dims = [in_dim]
        for layer in range(self.num_layers):
            dims.append(self._out_dim(layer, dims[-1]))
        self.meta = PageLog(store, frame_ids=True)  # versions, modes and final rows: the page log, cached
        # h^l of the layers in between: one page log each, rows alone
        self.logs = {l: PageLog(store, family="layerpages", prefix=bytes((l,)), rows_name=f"layer{l}-rows",
                                frame_ids=True)
                     for l in range(1, self.num_layers)}
        self.logs[self.num_layers] = self.meta
        self.tables = EmbeddingTables(store, dims, self.logs)
        for l, log in self.logs.items():
            log.row_cache = lambda iids, l=l: self.tables.cached(l, iids)
        self.layers = LayerRunner(store, self.gnn, self.policy, self.fanouts, self.tables.dims, chunk_nodes,
                                  self.typed)
        self._deferred_since: float | None = None
        self.shards = OutputShards(store)  # whose final rows are kept and published (see own)
        self.outbox = Outbox(store)  # the nodes to publish, written with their rows
        self.stages = StageClock(store, self.policy)  # when the staged policy's timers fired last
        self.outputs = FinalOutputs(store, self.meta, self.tables, self.shards, self.outbox, self.policy,
                                    self.layers)
        if self.staged:
            self._watch_expanded()
        # by layer, nodes whose stored rows failed their check: the next recompute writes them whatever it finds
        self._damaged: dict[int, np.ndarray] = {}
        if not self.needs_backfill():  # a backfill rewrites every row anyway
            self._mark_damaged_rows()

    def _mark_damaged_rows(self) -> None:
        """Dirty marks for the nodes whose stored rows fail their check (:meth:`PageLog.damaged`), so the
        next recompute computes them again (and propagates what really changed).

        That recompute writes their rows even where the value it computes
        matches the one read back: a damaged row may be NaN (which compares
        as no move) or garbage within the tolerance, and the damaged frame
        may hold the node's row intact beside other records' garbage (a
        superseded slot, say). Only rewriting every record of the page
        moves them all to a sound frame and retires the damaged one.
        """
        tags, nodes = [], []
        for layer, log in self.logs.items():
            bad = log.damaged()
            tags.append(np.full(len(bad), self.fanouts[layer - 1], dtype=np.int64))
            nodes.append(bad)
            if len(bad):
                self._damaged[layer] = bad
        count = sum(len(n) for n in nodes)
        if count:
            tx = Transaction()
            tx.add_marks(np.concatenate(tags), np.concatenate(nodes), np.full(count, DIRTY_SAMPLE, dtype=np.uint8))
            self.store.commit(tx)
            logger.warning("store %s: %d stored rows did not match their page records; the next apply or run "
                           "recomputes them", self.store.path, count)

    # ------------------------------------------------------------------ stages (the staged cold-start policy)
    def _watch_expanded(self) -> None:
        """Work out the samples of the nodes that may be expanded now, so that what they read is known (in
        memory only) from the start."""
        young = self.stages.young()
        if len(young):
            for k in set(self.fanouts):
                self.layers.samples(young, k)

    def read_event(self, data: Any, max_bytes: int = MAX_EVENT_BYTES) -> list[Any]:
        """One encoded event (a Kafka value or a JSONL line) as the events the store applies: itself, or a
        typed graph's event as the untyped events that hold it (:mod:`gnnstream.workers.engine.typed`).

        Raises:
            InvalidEvent: as :func:`decode_event_json`, :func:`check_features` and (typed) :func:`check_schema`.
        """
        if self.typed is not None:
            return self.typed.read(data, max_bytes)
        ev = decode_event_json(data, max_bytes=max_bytes)
        check_features(ev, self.model.config.in_dim)
        return [ev]

    def _out_dim(self, layer: int, in_dim: int) -> int:
        if self.typed is not None:
            return self.gnn.widths[layer + 1][self.typed.schema.type_names[0]]
        empty = torch.zeros(0, dtype=torch.int64)
        with torch.no_grad():
            out = self.gnn.layer(layer, torch.zeros(1, in_dim), torch.zeros(0, in_dim), empty,
                                       torch.zeros(1, dtype=torch.int64), empty)
        return int(out.shape[1])

    # ------------------------------------------------------------------ ownership (a group's output partitions)
    def own(self, keep: "set[int] | None", publish: "set[int] | None" = None, count: int = 0,
            epoch: int | None = None) -> None:
        """Shard the final layer by the ``count`` partitions of the output topic (a node being in the partition
        its id maps to, :mod:`gnnstream.stream.partitioning`).

        Args:
            keep: the partitions whose nodes' final rows are computed and
                stored (None: every node, no sharding).
            publish: those of ``keep`` whose nodes' changes are also published
                (None: all of ``keep``).
            epoch: this worker's epoch as the owner of the partitions it was
                assigned (versions published are at least ``epoch << 32``);
                None keeps the one it had.

        A partition added to ``keep`` needs :meth:`take_over`: its nodes'
        final rows were not kept current before.
        """
        self.shards.own(keep, publish, count, epoch)

    def kept_partitions(self) -> "tuple[int, set[int]] | None":
        """:func:`kept_partitions` of this engine's store."""
        return self.shards.stored()

    def highest_epoch(self) -> int:
        """The highest epoch at which this state has owned partitions (see :meth:`own`; 0: never)."""
        return self.shards.highest_epoch()

    def partitions_of(self, iids: np.ndarray) -> np.ndarray:
        """The output partition of each node (among the ``count`` set by :meth:`own`)."""
        return self.shards.partitions_of(iids)

    def take_over(self, partitions: "set[int]", computed: "set[int]" = frozenset()) -> RecomputeStats:
        """Publish the final embedding of every node in newly owned output ``partitions``.

        The final rows of ``partitions`` not in ``computed`` (those not kept
        current meanwhile) are computed first. Call :meth:`own` with the
        partitions and their new epochs first: every version published then
        exceeds those of earlier owners. Whatever an earlier owner published
        last, its consumers end up with this worker's values; the deleted
        nodes of those partitions are withdrawn again (an earlier owner may
        have died before it withdrew them).
        """
        with self._forgetting_on_failure():
            return self._take_over(set(partitions), set(computed))

    def _take_over(self, partitions: "set[int]", computed: "set[int]") -> RecomputeStats:
        t0 = time.perf_counter()
        stats = RecomputeStats()
        if self.shards.every or not partitions:
            return stats
        every = self._nodes(np.fromiter((keys.decode_iid(k) for k in self.store.column("names").keys()),
                                        dtype=np.int64))
        every = every[self.shards.within(self.shards.mask(partitions), every)]
        alive = self.store.node_arrays(every)[0] >= 0
        targets, gone = every[alive], every[~alive]
        current = self.shards.within(self.shards.mask(computed), targets)  # rows kept current meanwhile
        layer = self.num_layers - 1
        step = min(self.chunk_nodes, 50_000)
        for start in range(0, len(targets), step):
            chunk = targets[start:start + step]
            rows, present = self.tables.get(self.num_layers, chunk)
            fresh = ~present | ~current[start:start + step]
            if fresh.any():
                rows = np.array(rows, dtype=np.float32)
                rows[fresh], sampled = self.compute_layer(layer, chunk[fresh], CachedRows(self.tables, layer))
                stats.sampled_neighbours += sampled
                self.tables.set(self.num_layers, chunk[fresh], rows[fresh])
            stats.recomputed.append(int(fresh.sum()))
            tx = self._write_final(chunk, rows, publish=True, stats=stats, event_ts=None, force=False)
            tx.add(self.meta.compact())
            self._commit(tx)
        stats.recomputed = [sum(stats.recomputed)]
        tx = Transaction()
        self.tables.set(self.num_layers, gone, None)
        self.outputs.withdraw(gone, tx, True, stats, again=True)
        stored = self.shards.stored()
        self.shards.record_kept(tx, (stored[1] if stored and stored[0] == self.shards.count else set()) | partitions)
        tx.add(self.meta.compact())
        self._commit(tx)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _nodes(self, iids: np.ndarray) -> np.ndarray:
        """The nodes among ``iids`` whose embeddings are kept: all of them, but a typed graph's slots."""
        return iids if self.typed is None else self.typed.nodes(iids)

    # ------------------------------------------------------------------ binding
    def needs_backfill(self) -> bool:
        return self.store.column("meta").get(keys.META_MODEL) != self.binding.encode()

    # ------------------------------------------------------------------ one layer
    @property
    def device(self) -> torch.device:
        """Where the layers run: the CPU, but during :meth:`backfill` on another device."""
        return self.layers.device

    def compute_layer(self, layer: int, targets: np.ndarray, inputs: Rows) -> tuple[np.ndarray, int]:
        """:meth:`LayerRunner.compute`: ``h^{layer+1}`` of ``targets`` from the ``h^layer`` rows of ``inputs``."""
        return self.layers.compute(layer, targets, inputs)

    # ------------------------------------------------------------------ backfill
    def backfill(self, progress: Callable[[int], None] | None = None, publish: bool = False,
                 device: str | torch.device = "cpu") -> RecomputeStats:
        """Recompute every node's embedding at every layer from scratch and store them.

        Args:
            device: where the layers run (``"cuda"``: the model's weights and each chunk's rows go to the GPU,
                the rows come back for storing); the same layers as on the CPU, equal up to float rounding.

        Raises:
            ValueError: ``device`` names a device torch does not have here.
        """
        device = check_device(device)
        with self._forgetting_on_failure(), self.layers.running_on(device):
            return self._backfill(progress, publish)

    def _backfill(self, progress: Callable[[int], None] | None, publish: bool) -> RecomputeStats:
        t0 = time.perf_counter()
        stats = RecomputeStats()
        targets = self._nodes(np.fromiter(self.store.node_iids(), dtype=np.int64))
        self.tables.clear()
        for log in self.logs.values():
            log.clear()
        feats, _ = self.store.feature_rows(targets.tolist(), self.tables.dims[0])
        self.tables.set(0, targets, feats)
        prev = self._backfill_inputs(0, targets, feats)
        del feats
        for layer in range(self.num_layers):
            if self.layers.projects[layer]:  # all projections first: the table a layer reads stays as it is meanwhile
                project = self.layers.projector(layer)
                for start in range(0, len(targets), self.chunk_nodes):
                    prev.projected(targets[start:start + self.chunk_nodes], project)
            h, sampled = self.compute_layer(layer, targets, prev)
            stats.sampled_neighbours += sampled
            stats.recomputed.append(len(targets))
            stats.changed.append(len(targets))
            if layer < self.num_layers - 1:  # final rows are written with their metadata
                self._write_layer_rows(layer + 1, targets, h)
                self.tables.set(layer + 1, targets, h)
                prev = self._backfill_inputs(layer + 1, targets, h)
            else:
                owned = self.shards.kept(targets)
                self.tables.set(layer + 1, targets[owned], h[owned])
            if progress:
                progress(layer + 1)
        self._write_final(targets[owned], h[owned], publish=publish, stats=stats, event_ts=None, force=True)
        if self.typed is not None:  # a typed node's own list is never sampled (its slots' are), but batches merge
            self.store.load_prefixes(targets)  # into its prefix row: read with the rest, as an untyped backfill's are
        # rows of nodes that are gone (deleted before the marks that would withdraw them were processed)
        tx = Transaction()
        for layer, log in self.logs.items():
            stale = setdiff_ids(log.held_iids(), targets)
            self.tables.set(layer, stale, None)
            if layer == self.num_layers:
                self.outputs.withdraw(stale[self.shards.kept(stale)], tx, publish, stats)
            else:
                tx.add(log.put_rows(stale, None))
        for log in self.logs.values():
            tx.add(log.compact())
        self._commit(tx)
        tx = Transaction()
        tx.set_meta(keys.META_MODEL, self.binding.encode())
        self.stages.reach(tx)
        self.shards.record_kept(tx, None if self.shards.every else self.shards.kept_set())
        tx.clear_marks()
        self.store.commit(tx)
        self._damaged = {}  # every row was written
        self._drop_unused_rows()
        stats.seconds = time.perf_counter() - t0
        return stats

    def _drop_unused_rows(self) -> None:
        """After a backfill: the logs of layers this model does not have, and row files no page points into."""
        tx = Transaction()
        tx.add(layer_logs_from(self.store, self.num_layers))  # deleted: logs of layers this model does not have
        if len(tx):
            self.store.commit(tx)
        used = set().union(*(log.files_in_use() for log in self.logs.values()))
        for path in glob.glob(os.path.join(self.store.path, "*-rows-*.f32")):
            if path not in used:
                os.unlink(path)

    @contextmanager
    def _forgetting_on_failure(self) -> Iterator[None]:
        """Whatever fails between changing the tables and writing them leaves nothing of that change in memory:
        the page indexes and frame lists are read again from the store, and frames released by the change
        stay taken."""
        try:
            yield
        except BaseException:
            self._forget()
            raise

    def _forget(self) -> None:
        self.tables.clear()
        for log in self.logs.values():
            log.clear()
        self.outbox.reload()

    def _full_inputs(self, targets: np.ndarray) -> Rows:
        feats, _ = self.store.feature_rows(targets.tolist(), self.tables.dims[0])
        return DenseRows(targets, feats)

    def _backfill_inputs(self, layer: int, targets: np.ndarray, rows: np.ndarray) -> Rows:
        """The ``h^layer`` rows of every node, just set in the tables, as the next layer's inputs: the tables
        themselves (they keep the projections the next batches start from), or a copy of ``rows`` when the
        graph has more nodes than they hold."""
        if len(targets) and int(targets.max()) < self.tables.max_rows:
            return CachedRows(self.tables, layer)
        return DenseRows(targets, rows)

    def _write_layer_rows(self, layer: int, iids: np.ndarray, rows: np.ndarray) -> None:
        step = 50_000
        for start in range(0, len(iids), step):
            tx = Transaction()
            tx.add(self.logs[layer].put_rows(iids[start:start + step], rows[start:start + step]))
            self._commit(tx)

    def from_scratch(self) -> tuple[np.ndarray, np.ndarray]:
        """Every node's final embedding computed in memory (nothing is written)."""
        targets = self._nodes(np.fromiter(self.store.node_iids(), dtype=np.int64))
        prev = self._full_inputs(targets)
        h = np.zeros((len(targets), self.tables.dims[0]), dtype=np.float32)
        for layer in range(self.num_layers):
            h, _ = self.compute_layer(layer, targets, prev)
            prev = DenseRows(targets, h)
        return targets, h

    # ------------------------------------------------------------------ outputs
    def _write_final(self, iids: np.ndarray, rows: np.ndarray, *, publish: bool, stats: RecomputeStats,
                     event_ts: float | None, force: bool, tx: Transaction | None = None) -> Transaction:
        """:meth:`FinalOutputs.write` into ``tx`` (a new one when None), returned; with ``force`` committed
        :data:`_FINAL_CHUNK` rows at a time (the one returned is then empty)."""
        tx = Transaction() if tx is None else tx
        step = _FINAL_CHUNK if force else max(len(iids), 1)
        for start in range(0, len(iids), step):
            self.outputs.write(iids[start:start + step], rows[start:start + step], tx, publish=publish,
                               stats=stats, event_ts=event_ts)
            if force:
                self._commit(tx)
                tx = Transaction()
        return tx

    def outbox_columns(self, iids: np.ndarray, computed_at: float) -> UpdateColumns:
        """:meth:`FinalOutputs.columns`: what to publish for the nodes of an outbox record."""
        return self.outputs.columns(iids, computed_at)

    # ------------------------------------------------------------------ incremental
    def _read_marks(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Dirty marks by tag: ``{tag: (iids, flags)}``."""
        tags, iids, flags = self.store.dirty_mark_arrays()
        return {int(t): (iids[tags == t], flags[tags == t]) for t in unique_ids(tags).tolist()}

    def pending(self) -> int:
        """Number of dirty marks and fired stage timers waiting (0 when everything is up to date)."""
        return self.store.dirty_count() + len(self.stages.fired())

    def _dependents(self, k: int, sources: np.ndarray, deferred: list[np.ndarray], allow_defer: bool) -> np.ndarray:
        deps, over = self.store.sampled_by_many(k, sources, self.hub_bound if allow_defer else None)
        deferred.append(over)
        return deps

    def _moved(self, layer: int, iids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Which of ``rows`` differ from the held ``h^layer`` of ``iids`` by more than the tolerance, or have
        none held."""
        table, pos, present = self.tables.held(layer, iids)
        if not len(iids):
            return present
        held, new, at = torch.from_numpy(table), torch.from_numpy(rows), torch.from_numpy(pos)
        head = min(_HEAD_COLUMNS, new.shape[1])
        with threads_for(len(iids)):
            # most recomputed rows really changed, and show it in their first entries: only the others are read whole
            gap = held.narrow(1, 0, head).index_select(0, at).sub_(new.narrow(1, 0, head)).abs_().amax(dim=1)
            moved = (gap > _ATOL).numpy()
            rest = np.flatnonzero(~moved)
            if len(rest) and head < new.shape[1]:
                idx = torch.from_numpy(rest)
                gap = held.index_select(0, at[idx]).sub_(new.index_select(0, idx)).abs_().amax(dim=1)
                moved[rest] = (gap > _ATOL).numpy()
        return ~present | moved

    def recompute(self, event_ts: float | None = None, publish: bool = True, drain: bool = False) -> RecomputeStats:
        """Process every dirty mark; return what was recomputed.

        Args:
            event_ts: the latest event time of the batches being caught up.
            publish: write outbox entries for changed final embeddings.
            drain: also catch up deferred hub propagation now.
        """
        with self._forgetting_on_failure():
            return self._recompute(event_ts, publish, drain)

    def _recompute(self, event_ts: float | None, publish: bool, drain: bool) -> RecomputeStats:
        t0 = time.perf_counter()
        stats = RecomputeStats()
        marks = self._read_marks()
        fired = self.stages.fired()
        stats.stream_time = self.store.stream_time
        if not marks and not len(fired):
            if self.stages.behind():
                tx = Transaction()
                self.stages.reach(tx)
                self.store.commit(tx)
            return stats
        t = stats.lap("marks", t0)
        store = self.store
        none = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint8))
        input_ids, input_flags = marks.get(0, none)
        deferred_now = {l: marks.get(DEFERRED_TAG + l, none)[0] for l in range(self.num_layers)}
        has_deferred = any(len(d) for d in deferred_now.values())
        if has_deferred and self._deferred_since is None:
            self._deferred_since = time.monotonic()
        if has_deferred and (drain or time.monotonic() - self._deferred_since >= self.max_deferred_age):
            take_deferred, self._deferred_since = True, None
        else:
            take_deferred = not has_deferred
        degree_changed = input_ids[(input_flags & DIRTY_DEGREE) != 0]
        if len(fired):  # a stage change is handled as a change of degree: the node and what reads it
            fired = fired[store.node_arrays(fired)[0] >= 0]
            for stage, count in zip(*np.unique(self.layers.stages(fired), return_counts=True)):
                stats.stage_changes[STAGE_NAMES[int(stage)]] = int(count)
            degree_changed = unique_ids(np.concatenate([degree_changed, fired]))
        changed = input_ids[(input_flags & DIRTY_INPUT) != 0]
        self.tables.invalidate(0, changed)
        tx = Transaction()
        new_deferred: dict[int, np.ndarray] = {}
        final_iids = np.zeros(0, dtype=np.int64)
        final_rows = np.zeros((0, self.tables.dims[-1]), dtype=np.float32)
        for layer in range(self.num_layers):
            k = self.fanouts[layer]
            mark_ids, mark_flags = marks.get(k, none)
            deferred: list[np.ndarray] = []
            allow = not drain
            dirty = [mark_ids[(mark_flags & DIRTY_SAMPLE) != 0], changed, self._dependents(k, changed, deferred, allow)]
            if self.layers.uses_counts[layer]:
                dirty.append(self._dependents(k, mark_ids[(mark_flags & DIRTY_COUNT) != 0], deferred, allow))
            if not self.plain:
                dirty += [degree_changed, self._dependents(k, degree_changed, deferred, allow)]
            if self.staged:  # expanded nodes whose neighbours' samples, or chosen members' rows, changed
                readers = self.layers.readers_of(k, np.concatenate([mark_ids[(mark_flags & DIRTY_SAMPLE) != 0],
                                                                    changed]))
                dirty.append(readers)
                if self.layers.uses_counts[layer]:  # their sample sizes may have changed
                    dirty.append(self._dependents(k, readers, deferred, allow))
            if take_deferred:
                dirty.append(self._dependents(k, deferred_now[layer], [], allow_defer=False))
                carried = np.zeros(0, dtype=np.int64)
            else:
                carried = deferred_now[layer]
                deferred.append(carried)
            new_deferred[layer] = unique_ids(np.concatenate(deferred))
            stats.deferred += len(new_deferred[layer])
            stats.newly_deferred += len(setdiff_ids(new_deferred[layer], carried))
            final_from = t if layer == self.num_layers - 1 else None
            dirty_ids = unique_ids(np.concatenate(dirty))
            if self.typed is not None:  # a slot's sample or input changed: its node's layer is dirty
                owners = self.typed.owners(dirty_ids)
                dirty_ids = unique_ids(owners[owners >= 0])
            if layer == self.num_layers - 1 and not self.shards.every:  # the final layer: kept nodes only
                dirty_ids = dirty_ids[self.shards.kept(dirty_ids)]
            alive = store.node_arrays(dirty_ids)[0] >= 0
            targets, gone = dirty_ids[alive], dirty_ids[~alive]
            t = stats.lap("dirty", t)
            rows, sampled = self.compute_layer(layer, targets, CachedRows(self.tables, layer))
            stats.sampled_neighbours += sampled
            t = stats.lap("compute", t)
            diff = self._moved(layer + 1, targets, rows)
            if self._damaged:
                diff |= self._rewrite(layer + 1, targets)
            moved, moved_rows = (targets, rows) if diff.all() else (targets[diff], rows[diff])
            self.tables.set(layer + 1, moved, moved_rows)
            self.tables.set(layer + 1, gone, None)
            if layer < self.num_layers - 1:  # final rows are written with their metadata
                tx.add(self.logs[layer + 1].put_rows(moved, moved_rows))
                tx.add(self.logs[layer + 1].put_rows(gone[self.logs[layer + 1].held(gone)], None))
            stats.recomputed.append(len(targets))
            stats.changed.append(len(moved))
            changed = np.concatenate([moved, gone])
            t = stats.lap("rows", t)
            if final_from is not None:
                stats.final_seconds = t - final_from
            if layer == self.num_layers - 1:
                final_iids, final_rows = moved, moved_rows
                # a node whose mode changed is republished even if its vector did not move
                touched = self._nodes(np.concatenate([input_ids[(input_flags & (DIRTY_INPUT | DIRTY_DEGREE)) != 0],
                                                      fired]))
                touched = touched[self.shards.kept(touched)]
                recheck = setdiff_ids(np.concatenate([targets[~diff], touched]), moved)
                degree, flags, _ = store.node_arrays(recheck)
                live = degree >= 0
                recheck = recheck[live]
                if len(recheck):
                    _, _, stored_mode = self.meta.get(recheck)
                    now_mode = self.outputs.mode_codes(recheck, degree[live], flags[live])
                    again = recheck[stored_mode != now_mode]
                    if len(again):
                        current, present = self.tables.get(layer + 1, again)
                        final_iids = np.concatenate([final_iids, again[present]])
                        final_rows = np.concatenate([final_rows, current[present]])
                stats.deleted = len(gone)
                self.outputs.withdraw(gone, tx, publish, stats)
        self._write_final(final_iids, final_rows, publish=publish, stats=stats, event_ts=event_ts, force=False, tx=tx)
        for log in self.logs.values():  # after the last encode of this WriteBatch
            tx.add(log.compact())
        waiting = [(np.full(len(nodes), DEFERRED_TAG + layer), nodes) for layer, nodes in new_deferred.items()]
        if sum(len(nodes) for _, nodes in waiting):
            tags, nodes = np.concatenate([t for t, _ in waiting]), np.concatenate([n for _, n in waiting])
            tx.add_marks(tags, nodes, np.ones(len(nodes), dtype=np.uint8))
        self.stages.reach(tx)
        t = stats.lap("outputs", t)
        # every mark was read above and nothing applies events meanwhile: clear them all at once
        tx.clear_marks()
        stats.rows_written = self._commit(tx)
        self._damaged = {}  # their marks were among those: their rows are written
        stats.lap("write", t)
        stats.seconds = time.perf_counter() - t0
        stats.fanout_capped = self.layers.take_capped()
        return stats

    def _rewrite(self, layer: int, targets: np.ndarray) -> np.ndarray:
        """Which ``targets`` have damaged rows at ``layer`` (:meth:`_mark_damaged_rows`): written in any case."""
        bad = self._damaged.get(layer)
        return np.zeros(len(targets), dtype=bool) if bad is None else np.isin(targets, bad)

    def _commit(self, tx: Transaction) -> int:
        """Commit ``tx`` (its callers run under :meth:`_forgetting_on_failure`)."""
        written = self.store.commit(tx)
        for log in self.logs.values():  # frames of the pages this batch deleted may now be reused
            log.committed()
        return written

    def deferred_age(self) -> float:
        """Seconds the oldest deferred hub propagation has waited (0 when none)."""
        return 0.0 if self._deferred_since is None else time.monotonic() - self._deferred_since

    def drain(self, publish: bool = True) -> RecomputeStats:
        """Recompute until nothing is dirty, deferred hub propagation included."""
        total = RecomputeStats()
        while self.pending():
            stats = self.recompute(publish=publish, drain=True)
            total.published += stats.published
            total.recomputed.extend(stats.recomputed)
        return total
