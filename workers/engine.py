"""Exact incremental recompute: only the embeddings an event can change.

The graph store leaves durable dirty marks with every applied batch:

* ``(0, v)`` with ``DIRTY_INPUT``: ``h^0_v`` changed (features set, node created
  or deleted); ``DIRTY_DEGREE``: ``v``'s neighbour count changed.
* ``(k, v)`` with ``DIRTY_SAMPLE``: ``S_k(v)`` changed; ``DIRTY_COUNT``: ``|S_k(v)|``
  changed (GCN normalises by the sample sizes of a node's neighbours).

:meth:`Engine.recompute` turns them into a wavefront. Layer ``l`` (fanout
``k = k_l``) recomputes

    D_l = {v : S_k(v) changed}  ∪  C_{l-1}  ∪  sampled_by_k(C_{l-1})
          [∪ sampled_by_k({u : |S_k(u)| changed}) for GCN]

where ``C_{l-1}`` are the nodes whose ``h^{l-1}`` really changed; a node whose
new embedding equals the old one stops propagating. Dependents come from the
store's reverse sampled-by index, never from scanning neighbours. A node whose
change would reach more than ``hub_bound`` dependents has that propagation
deferred under a durable mark and coalesced; :meth:`Engine.drain` (or the next
recompute once ``max_deferred_age`` passes) catches it up, so the result
converges to the contract. New embeddings, their metadata, outbox entries and
the removal of the consumed marks go into one WriteBatch.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from graph_state import keys
from graph_state.store import DIRTY_COUNT, DIRTY_DEGREE, DIRTY_INPUT, DIRTY_SAMPLE, GraphStore
from workers.tables import EmbeddingMeta, EmbeddingTables, encode_outbox

__all__ = ["Engine", "RecomputeStats", "EngineError"]

logger = logging.getLogger(__name__)

DELETED = "deleted"  # mode of a withdrawn embedding (its meta keeps the version floor)
DEFERRED_TAG = 0x8000  # dirty key tag 0x8000 + l: dependents of v at layer l are pending
_ATOL = 1e-6
_OUTBOX_SEQ = b"outbox_seq"


class EngineError(RuntimeError):
    """The state directory and the model do not fit together."""


@dataclass
class RecomputeStats:
    """What one recompute did (per layer lists are indexed from layer 1)."""

    recomputed: list[int] = field(default_factory=list)
    changed: list[int] = field(default_factory=list)
    published: int = 0
    deleted: int = 0
    deferred: int = 0
    sampled_neighbours: int = 0
    fanout_capped: int = 0
    seconds: float = 0.0


class Engine:
    """Keeps the stored embeddings of a graph store equal to the model's output.

    Args:
        store: the graph store; its fanouts are set to the model's.
        model: a :class:`model.LoadedModel`.
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
        self.fanouts: list[int] = list(cfg.fanouts)
        self.num_layers = len(self.fanouts)
        self.model_tag = f"{cfg.name}:{cfg.version}"
        # what the stored embeddings were computed with: a different model, even under the same tag, needs a backfill
        self.binding = json.dumps({"model": self.model_tag, "arch": cfg.arch, "weights_sha256": cfg.weights_sha256,
                                   "fanouts": list(cfg.fanouts), "cold_start": cfg.cold_start}, sort_keys=True)
        self.gnn = model.model
        self.policy = model.cold_start
        self.plain = self.policy.name == "plain"
        self.chunk_nodes = chunk_nodes
        self.hub_bound = hub_bound
        self.max_deferred_age = max_deferred_age
        if store.seed != cfg.seed:
            raise EngineError(
                f"model {self.model_tag} samples with seed {cfg.seed} but store {store.path!r} "
                f"was created with seed {store.seed}; create the store with --seed {cfg.seed}"
            )
        if store.feature_dim is not None and store.feature_dim != cfg.in_dim:
            raise EngineError(
                f"model {self.model_tag} expects {cfg.in_dim} input features but store "
                f"{store.path!r} holds {store.feature_dim}-dim features"
            )
        store.set_feature_dim(cfg.in_dim)
        store.set_fanouts(self.fanouts)
        dims = [cfg.in_dim]
        for layer in range(self.num_layers):
            dims.append(self._out_dim(layer, dims[-1]))
        self.tables = EmbeddingTables(store, dims)
        self._uses_counts = [bool(getattr(c, "uses_neighbour_counts", False)) for c in self.gnn.convs]
        self._deferred_since: float | None = None
        self._capped = 0
        self._metas: dict[int, EmbeddingMeta | None] = {}  # write-through cache of embmeta
        raw = store.column("meta").get(_OUTBOX_SEQ)
        self._seq = 0 if raw is None else keys.decode_iid(raw)

    def _out_dim(self, layer: int, in_dim: int) -> int:
        empty = torch.zeros(0, dtype=torch.int64)
        with torch.no_grad():
            out = self.gnn.layer(layer, torch.zeros(1, in_dim), torch.zeros(0, in_dim), empty,
                                       torch.zeros(1, dtype=torch.int64), empty)
        return int(out.shape[1])

    def _outbox(self, puts: list, record: bytes) -> None:
        """Queue an outbox record; the caller also puts the next sequence number (meta ``outbox_seq``)."""
        puts.append(("outbox", keys.U64.pack(self._seq), record))
        self._seq += 1

    # ------------------------------------------------------------------ binding
    def needs_backfill(self) -> bool:
        return self.store.column("meta").get(b"model") != self.binding.encode()

    # ------------------------------------------------------------------ one layer
    def _effective_samples(self, targets: np.ndarray, k: int) -> list[list[int]]:
        store = self.store
        if self.plain:
            return [store.sample_iids(v, k) for v in targets.tolist()]
        uses = self.policy.uses_neighbours
        return [store.sample_iids(v, k) if uses(store.degree_iid(v)) else [] for v in targets.tolist()]

    def _effective_count(self, u: int, k: int) -> int:
        deg = self.store.degree_iid(u)
        if not self.plain and not self.policy.uses_neighbours(deg):
            return 0
        return min(deg, k)

    def compute_layer(self, layer: int, targets: np.ndarray, inputs: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, int]:
        """``h^{layer+1}`` of ``targets`` (0-based layer index) from ``h^layer`` rows given by ``inputs``.

        Returns:
            The new rows and the number of sampled neighbours read.
        """
        k = self.fanouts[layer]
        out = np.empty((len(targets), self.tables.dims[layer + 1]), dtype=np.float32)
        sampled = 0
        for start in range(0, len(targets), self.chunk_nodes):
            chunk = targets[start:start + self.chunk_nodes]
            samples = self._effective_samples(chunk, k)
            counts = np.fromiter((len(s) for s in samples), dtype=np.int64, count=len(samples))
            flat = np.fromiter(chain.from_iterable(samples), dtype=np.int64, count=int(counts.sum()))
            sampled += len(flat)
            full = np.flatnonzero(counts == k)
            if len(full):
                degree = self.store.degree_iid
                self._capped += sum(1 for v in chunk[full].tolist() if degree(v) > k)
            uniq, inverse = np.unique(np.concatenate([chunk, flat]), return_inverse=True)
            rows = torch.from_numpy(inputs(uniq))
            inv = torch.from_numpy(inverse)
            x_self = rows[inv[: len(chunk)]]
            x_nbr = rows[inv[len(chunk):]]
            index = torch.from_numpy(np.repeat(np.arange(len(chunk), dtype=np.int64), counts))
            self_count = torch.from_numpy(counts)
            if self._uses_counts[layer]:
                nbr_count = torch.tensor([self._effective_count(u, k) for u in flat.tolist()], dtype=torch.int64)
            else:
                nbr_count = torch.zeros(len(flat), dtype=torch.int64)
            with torch.no_grad():
                h = self.gnn.layer(layer, x_self, x_nbr, index, self_count, nbr_count)
            out[start:start + len(chunk)] = h.numpy()
        return out, sampled

    # ------------------------------------------------------------------ backfill
    def backfill(self, progress: Callable[[int], None] | None = None, publish: bool = False) -> RecomputeStats:
        """Recompute every node's embedding at every layer from scratch and store them."""
        t0 = time.perf_counter()
        stats = RecomputeStats()
        targets = np.fromiter(self.store.node_iids(), dtype=np.int64)
        self.tables.clear()
        self._metas.clear()
        prev = self._full_inputs(targets)
        self.tables.set(0, targets, prev(targets))
        for layer in range(self.num_layers):
            h, sampled = self.compute_layer(layer, targets, prev)
            stats.sampled_neighbours += sampled
            stats.recomputed.append(len(targets))
            stats.changed.append(len(targets))
            self._write_layer_rows(layer + 1, targets, h)
            self.tables.set(layer + 1, targets, h)
            prev = self._dense_lookup(targets, h)
            if progress:
                progress(layer + 1)
        self._write_final(targets, h, publish=publish, stats=stats, event_ts=None, force=True)
        self.store.column("meta").put(b"model", self.binding.encode())
        self.store.write((), clear=("dirty",))
        stats.seconds = time.perf_counter() - t0
        return stats

    def _full_inputs(self, targets: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
        feats, _ = self.store.feature_rows(targets.tolist(), self.tables.dims[0])
        return self._dense_lookup(targets, feats)

    @staticmethod
    def _dense_lookup(targets: np.ndarray, rows: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
        pos = np.full(int(targets.max()) + 1 if len(targets) else 0, -1, dtype=np.int64)
        pos[targets] = np.arange(len(targets))
        zero_row = np.zeros((1, rows.shape[1]), dtype=np.float32)
        padded = np.concatenate([rows, zero_row])

        def lookup(iids: np.ndarray) -> np.ndarray:
            idx = np.where(iids < len(pos), pos[np.minimum(iids, max(len(pos) - 1, 0))], -1)
            return padded[np.where(idx >= 0, idx, len(rows))]

        return lookup

    def _write_layer_rows(self, layer: int, iids: np.ndarray, rows: np.ndarray) -> None:
        batch = []
        for i, iid in enumerate(iids.tolist()):
            batch.append(("emb", keys.layer_key(layer, iid), rows[i].tobytes()))
            if len(batch) >= 50_000:
                self.store.write(batch)
                batch = []
        self.store.write(batch)

    def from_scratch(self) -> tuple[np.ndarray, np.ndarray]:
        """Every node's final embedding computed in memory (nothing is written)."""
        targets = np.fromiter(self.store.node_iids(), dtype=np.int64)
        prev = self._full_inputs(targets)
        h = np.zeros((len(targets), self.tables.dims[0]), dtype=np.float32)
        for layer in range(self.num_layers):
            h, _ = self.compute_layer(layer, targets, prev)
            prev = self._dense_lookup(targets, h)
        return targets, h

    # ------------------------------------------------------------------ outputs
    def _get_metas(self, iids: list[int]) -> list[EmbeddingMeta | None]:
        """Stored metadata of ``iids`` (None where absent), through the in-memory cache."""
        cache = self._metas
        missing = [i for i in iids if i not in cache]
        if missing:
            if len(cache) > 4_000_000:
                cache.clear()
            for iid, raw in zip(missing, self.store.column("embmeta").get([keys.encode_iid(i) for i in missing])):
                cache[iid] = None if raw is None else EmbeddingMeta.decode(raw)
        return [cache[i] for i in iids]

    def _mode(self, iid: int) -> str:
        degree, has_features, _ = self.store.node_info_iid(iid)
        return self.policy.mode(has_features, degree)

    def _write_final(self, iids: np.ndarray, rows: np.ndarray, *, publish: bool, stats: RecomputeStats,
                     event_ts: float | None, force: bool, puts: list | None = None) -> list:
        """Metadata (versions, modes) and outbox entries of final-layer rows."""
        puts = [] if puts is None else puts
        now = time.time()
        chunk = 50_000
        for start in range(0, len(iids), chunk):
            ids = iids[start:start + chunk].tolist()
            metas = self._get_metas(ids)
            versions, times, modes = [], [], []
            for iid, old in zip(ids, metas):
                degree, has_features, last_ts = self.store.node_info_iid(iid)
                meta = EmbeddingMeta((old.version if old else 0) + 1, max(last_ts, event_ts or 0.0),
                                     self.policy.mode(has_features, degree))
                self._metas[iid] = meta
                puts.append(("embmeta", keys.encode_iid(iid), meta.encode()))
                versions.append(meta.version)
                times.append(meta.event_ts)
                modes.append(meta.mode)
            if publish and ids:
                names = [self.store.name(i) for i in ids]
                self._outbox(puts, encode_outbox(names, versions, times, now, modes, rows[start:start + chunk]))
                stats.published += len(ids)
            if force:
                puts.append(("meta", _OUTBOX_SEQ, keys.U64.pack(self._seq)))
                self.store.write(puts)
                puts = []
        return puts

    # ------------------------------------------------------------------ incremental
    def _read_marks(self) -> dict[int, dict[int, int]]:
        marks: dict[int, dict[int, int]] = {}
        for key, value in self.store.column("dirty").items():
            tag, iid = keys.decode_dirty_key(key)
            marks.setdefault(tag, {})[iid] = value[0]
        return marks

    def pending(self) -> int:
        """Number of dirty marks waiting (0 when everything is up to date)."""
        return sum(1 for _ in self.store.column("dirty").keys())

    def _dependents(self, k: int, sources: Iterable[int], deferred: set[int], allow_defer: bool) -> set[int]:
        out: set[int] = set()
        for u in sources:
            deps = self.store.sampled_by(k, u, limit=self.hub_bound + 1 if allow_defer else None)
            if allow_defer and len(deps) > self.hub_bound:
                deferred.add(u)
                continue
            out.update(deps)
        return out

    def recompute(self, event_ts: float | None = None, publish: bool = True, drain: bool = False) -> RecomputeStats:
        """Process every dirty mark; return what was recomputed.

        Args:
            event_ts: the latest event time of the batches being caught up.
            publish: write outbox entries for changed final embeddings.
            drain: also catch up deferred hub propagation now.
        """
        t0 = time.perf_counter()
        stats = RecomputeStats()
        marks = self._read_marks()
        if not marks:
            return stats
        store = self.store
        inputs = marks.get(0, {})
        deferred_now = {l: set(marks.get(DEFERRED_TAG + l, {})) for l in range(self.num_layers)}
        has_deferred = any(deferred_now.values())
        if has_deferred and self._deferred_since is None:
            self._deferred_since = time.monotonic()
        if has_deferred and (drain or time.monotonic() - self._deferred_since >= self.max_deferred_age):
            take_deferred, self._deferred_since = True, None
        else:
            take_deferred = not has_deferred
        deleted = {v for v, f in inputs.items() if f & DIRTY_INPUT and not store.exists_iid(v)}
        degree_changed = {v for v, f in inputs.items() if f & DIRTY_DEGREE}
        changed = {v for v, f in inputs.items() if f & DIRTY_INPUT}
        self.tables.invalidate(0, list(changed))
        puts: list[tuple[str, bytes, bytes | None]] = []
        new_deferred: dict[int, set[int]] = {}
        final_iids = np.zeros(0, dtype=np.int64)
        final_rows = np.zeros((0, self.tables.dims[-1]), dtype=np.float32)
        for layer in range(self.num_layers):
            k = self.fanouts[layer]
            kmarks = marks.get(k, {})
            deferred: set[int] = set()
            dirty = {v for v, f in kmarks.items() if f & DIRTY_SAMPLE}
            dirty |= changed
            dirty |= self._dependents(k, changed, deferred, allow_defer=not drain)
            if self._uses_counts[layer]:
                counted = [v for v, f in kmarks.items() if f & DIRTY_COUNT]
                dirty |= self._dependents(k, counted, deferred, allow_defer=not drain)
            if not self.plain:
                dirty |= degree_changed
                dirty |= self._dependents(k, degree_changed, deferred, allow_defer=not drain)
            if take_deferred:
                dirty |= self._dependents(k, deferred_now[layer], set(), allow_defer=False)
            else:
                deferred |= deferred_now[layer]
            new_deferred[layer] = deferred
            stats.deferred += len(deferred)
            live: list[int] = []
            gone: list[int] = []
            for v in dirty:
                (live if store.exists_iid(v) else gone).append(v)
            targets = np.asarray(sorted(live), dtype=np.int64)
            rows, sampled = self.compute_layer(layer, targets, lambda ids, l=layer: self.tables.get(l, ids)[0])
            stats.sampled_neighbours += sampled
            old, present = self.tables.get(layer + 1, targets)
            diff = ~present | (np.abs(rows - old).max(axis=1, initial=0.0) > _ATOL) if len(targets) else np.zeros(0, dtype=bool)
            moved = targets[diff]
            self.tables.set(layer + 1, moved, rows[diff])
            for iid, row in zip(moved.tolist(), rows[diff]):
                puts.append(("emb", keys.layer_key(layer + 1, iid), row.tobytes()))
            for iid in gone:
                puts.append(("emb", keys.layer_key(layer + 1, iid), None))
            self.tables.set(layer + 1, np.asarray(gone, dtype=np.int64), None)
            stats.recomputed.append(len(targets))
            stats.changed.append(len(moved))
            changed = set(moved.tolist()) | set(gone)
            if layer == self.num_layers - 1:
                final_iids, final_rows = moved, rows[diff]
                # a node whose mode changed is republished even if its vector did not move
                recheck = set(targets[~diff].tolist())
                recheck.update(v for v, f in inputs.items()
                               if f & (DIRTY_INPUT | DIRTY_DEGREE) and v not in deleted and store.exists_iid(v))
                recheck.difference_update(moved.tolist())
                if recheck:
                    ids = np.fromiter(sorted(recheck), dtype=np.int64)
                    metas = self._get_metas(ids.tolist())
                    again = np.asarray([i for i, (iid, meta) in enumerate(zip(ids.tolist(), metas))
                                        if meta is None or meta.mode != self._mode(iid)], dtype=np.int64)
                    if len(again):
                        current, present = self.tables.get(layer + 1, ids[again])
                        final_iids = np.concatenate([final_iids, ids[again][present]])
                        final_rows = np.concatenate([final_rows, current[present]])
                stats.deleted = len(gone)
                self._outputs_for_deleted(gone, puts, publish, stats)
        self._write_final(final_iids, final_rows, publish=publish, stats=stats, event_ts=event_ts, force=False, puts=puts)
        for layer, nodes in new_deferred.items():
            for iid in nodes:
                puts.append(("dirty", keys.dirty_key(DEFERRED_TAG + layer, iid), b"\x01"))
        puts.append(("meta", _OUTBOX_SEQ, keys.U64.pack(self._seq)))
        try:
            # every mark was read above and nothing applies events meanwhile: clear them all at once
            store.write(puts, clear=("dirty",))
        except BaseException:
            self.tables.clear()
            raw = store.column("meta").get(_OUTBOX_SEQ)
            self._seq = 0 if raw is None else keys.decode_iid(raw)
            self._metas.clear()
            raise
        stats.seconds = time.perf_counter() - t0
        stats.fanout_capped, self._capped = self._capped, 0
        return stats

    def _outputs_for_deleted(self, gone: Sequence[int], puts: list, publish: bool, stats: RecomputeStats) -> None:
        if not gone:
            return
        now = time.time()
        names, versions, times = [], [], []
        for iid, old in zip(gone, self._get_metas(list(gone))):
            if old is None or old.mode == DELETED:
                continue
            # the meta stays as a version floor, so a re-created node keeps counting up
            tomb = EmbeddingMeta(old.version + 1, old.event_ts, DELETED)
            self._metas[iid] = tomb
            puts.append(("embmeta", keys.encode_iid(iid), tomb.encode()))
            names.append(self.store.name(iid))
            versions.append(tomb.version)
            times.append(tomb.event_ts)
        if publish and names:
            self._outbox(puts, encode_outbox(names, versions, times, now, [DELETED] * len(names), None))
            stats.published += len(names)

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
