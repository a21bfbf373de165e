"""One GNN layer over a set of targets: their samples from the store, their input rows from a source, the
layer's arithmetic in torch, on the CPU or (for a backfill) another device."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch

from gnnstream.graph_state.sampler import seeded_rank_bytes
from gnnstream.graph_state.store import GraphStore
from gnnstream.model.coldstart import STAGE_EXPANDED, STAGE_NONE
from gnnstream.workers.engine.device import threads_for
from gnnstream.workers.engine.rows import Project, Rows

__all__ = ["LayerRunner"]


class LayerRunner:
    """Runs the layers of a model over targets of a graph store.

    Args:
        store: the graph store the samples are read from.
        gnn: the model's layers (:class:`gnnstream.model.network.GNN`).
        policy: the model's cold-start policy (which nodes read their neighbours).
        fanouts: the sample size of each layer.
        dims: the width of each layer's rows, inputs first.
        chunk_nodes: targets per vectorised layer call (bounds memory).
    """

    def __init__(self, store: GraphStore, gnn: Any, policy: Any, fanouts: list[int], dims: list[int],
                 chunk_nodes: int, typed: Any = None):
        self.store, self.gnn, self.policy = store, gnn, policy
        self.typed = typed  # a typed graph's TypedLayout (workers/engine/typed.py); None: untyped
        self.plain = policy.name == "plain"
        self.fanouts, self.dims, self.chunk_nodes = fanouts, dims, chunk_nodes
        self.device = torch.device("cpu")  # where the layers run: another only inside running_on
        self._device_table: tuple[np.ndarray, torch.Tensor] | None = None  # the input table copied to the device
        self.uses_counts = [typed is None and bool(getattr(c, "uses_neighbour_counts", False)) for c in gnn.convs]
        # a layer past the first whose inputs (the engine's own h^l) can be kept projected: see compute
        self.projects = [(typed is not None or layer > 0) and gnn.projects(layer) for layer in range(len(fanouts))]
        self.capped = 0  # targets whose sample was capped by the fanout, since take_capped
        self.staged = bool(policy.by_age)
        self._rank = seeded_rank_bytes(store.seed)
        # expanded nodes by fanout: what each one read last (its neighbours, whose samples it merged, and the
        # members it chose), and the reverse, who read a node: the engine dirties those readers when a node's
        # sample or row changes (the sampled-by index only covers plain samples)
        self.reads: dict[int, dict[int, list[int]]] = {}
        self.readers: dict[int, dict[int, set[int]]] = {}

    def take_capped(self) -> int:
        """The targets whose sample the fanout capped since the last call."""
        capped, self.capped = self.capped, 0
        return capped

    @contextmanager
    def running_on(self, device: torch.device) -> Iterator[None]:
        """Run the layers on ``device`` inside the block (the model's weights move there and back)."""
        self.gnn.to(device)
        self.device = device
        try:
            yield
        finally:
            self.device = torch.device("cpu")
            self._device_table = None
            self.gnn.to(self.device)

    def stages(self, targets: np.ndarray) -> np.ndarray:
        """The cold-start stage of each target (``STAGE_*``) at the store's stream time."""
        degree = np.maximum(self.store.node_arrays(targets)[0], 0)
        if not self.staged:
            return self.policy.stages(degree, None)
        now = self.store.stream_time or 0.0
        return self.policy.stages(degree, now - self.store.first_ts(targets))

    def samples(self, targets: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(S_k of every target as a [len(targets), k] iid matrix in rank order padded with -1, target degrees)``.

        A node the cold-start policy keeps off its neighbours gets an empty sample; an expanded node (the staged
        policy) gets the bottom-k of its neighbours and their plain samples, and is recorded as their reader.
        """
        store = self.store
        mat = store.sample_matrix(k, targets)
        degree, _, _ = store.node_arrays(targets)
        if self.plain:
            return mat, degree
        stage = self.stages(targets)
        mat[stage == STAGE_NONE] = -1
        if self.staged:
            expanded = np.flatnonzero(stage == STAGE_EXPANDED)
            held = self.reads.setdefault(k, {})
            if held:
                for v in targets[stage != STAGE_EXPANDED].tolist():
                    if v in held:
                        self._unwatch(k, v)
            for row, (v, chosen, read) in zip(expanded.tolist(), self._expanded(targets[expanded], k)):
                mat[row] = -1
                mat[row, :len(chosen)] = chosen
                self._unwatch(k, v)
                held[v] = read
                readers = self.readers.setdefault(k, {})
                for w in read:
                    readers.setdefault(w, set()).add(v)
        return mat, degree

    def _unwatch(self, k: int, v: int) -> None:
        read = self.reads.get(k, {}).pop(v, None)
        if read:
            readers = self.readers[k]
            for w in read:
                who = readers.get(w)
                if who is not None:
                    who.discard(v)
                    if not who:
                        del readers[w]

    def readers_of(self, k: int, sources: np.ndarray) -> np.ndarray:
        """The expanded nodes that read the sample or row of any of ``sources`` at fanout ``k``."""
        readers = self.readers.get(k)
        if not readers or not len(sources):
            return np.zeros(0, dtype=np.int64)
        found: set[int] = set()
        for w in sources.tolist():
            who = readers.get(w)
            if who:
                found |= who
        return np.fromiter(found, np.int64, len(found))

    def _expanded(self, targets: np.ndarray, k: int) -> list[tuple[int, list[int], list[int]]]:
        """``(v, chosen, read)`` of each expanded target: the ``k`` members of ``X_k(v) = (N(v) ∪ ⋃_{u ∈ N(v)}
        S_k(u)) \\ {v}`` with the smallest ``(r(v, w), w)``, and the nodes it read (``N(v)`` and ``chosen``).
        ``N(v)`` has fewer than ``min_neighbours`` members, so this never reads a hub's list."""
        store, rank, name = self.store, self._rank, self.store.name
        out = []
        for v in targets.tolist():
            nbrs = [u for _, u in store.ranked_neighbours(v)]
            pool = set(nbrs)
            if nbrs and k:
                mat = store.sample_matrix(k, np.asarray(nbrs, dtype=np.int64))
                pool.update(mat[mat >= 0].tolist())
            pool.discard(v)
            v_name = name(v)
            chosen = [w for _, _, w in sorted((rank(v_name, n), n, w) for w in pool for n in (name(w),))][:k]
            out.append((v, chosen, sorted(set(nbrs) | set(chosen))))
        return out

    def neighbour_counts(self, nbrs: np.ndarray, k: int) -> np.ndarray:
        """``|S_k(u)|`` of every neighbour row as the layer sees it (0 for a node kept off its neighbours)."""
        degree = np.maximum(self.store.node_arrays(nbrs)[0], 0)
        count = np.minimum(degree, k)
        if self.plain:
            return count
        stage = self.stages(nbrs)
        count[stage == STAGE_NONE] = 0
        expanded = np.flatnonzero(stage == STAGE_EXPANDED)
        if len(expanded):
            distinct, inverse = np.unique(nbrs[expanded], return_inverse=True)
            sizes = np.asarray([len(chosen) for _, chosen, _ in self._expanded(distinct, k)], dtype=count.dtype)
            count[expanded] = sizes[inverse]
        return count

    def tensor(self, array: np.ndarray) -> torch.Tensor:
        """``array`` as a tensor on the engine's device (the CPU but inside :meth:`running_on` another)."""
        return torch.from_numpy(array).to(self.device, non_blocking=True)  # on the CPU: the array's memory

    def table_tensor(self, table: np.ndarray) -> torch.Tensor:
        """A layer's input table as :meth:`tensor`, copied to another device once per table (every chunk of a
        layer reads rows of the same one), not once per chunk."""
        if self.device.type == "cpu":
            return self.tensor(table)
        held = self._device_table
        if held is None or held[0] is not table:  # the array is held, so its identity is not reused meanwhile
            self._device_table = held = (table, self.tensor(table))
        return held[1]

    def projector(self, layer: int) -> Project:
        """Layer ``layer``'s projections of rows (a :data:`Project`): the model's two, or a typed model's planes
        of each row's node type (zeros for an iid below 0)."""
        def project(rows: np.ndarray, iids: np.ndarray) -> tuple[np.ndarray, ...]:
            with threads_for(len(rows)):
                first, second = self.gnn.project(layer, self.tensor(rows))
            return first.cpu().numpy(), second.cpu().numpy()

        def project_typed(rows: np.ndarray, iids: np.ndarray) -> tuple[np.ndarray, ...]:
            kinds = np.full(len(iids), -1, dtype=np.int64)
            kinds[iids >= 0] = self.typed.types(iids[iids >= 0])
            planes = tuple(np.zeros((len(rows), self.dims[layer + 1]), dtype=np.float32)
                           for _ in range(self.gnn.planes))
            for t, index in self.typed.type_index.items():
                sel = np.flatnonzero(kinds == index)
                if len(sel):
                    width = self.gnn.widths[layer][t]  # the first layer's rows are features padded to the widest type's
                    with threads_for(len(sel)):
                        out = self.gnn.project(layer, t, self.tensor(np.ascontiguousarray(rows[sel, :width])))
                    for plane, h in zip(planes, out):
                        plane[sel] = h.cpu().numpy()
            return planes

        return project if self.typed is None else project_typed

    def compute(self, layer: int, targets: np.ndarray, inputs: Rows) -> tuple[np.ndarray, int]:
        """``h^{layer+1}`` of ``targets`` (0-based layer index) from the ``h^layer`` rows of ``inputs``.

        A GraphSAGE layer past the first runs from its inputs' projections
        (``W_l h_u`` and ``W_r h_u + b_l`` of every node, kept by the source):
        a target then costs one gathered sum and no matrix product, and only
        the rows that changed are projected again. Backfill, recompute and
        ``from_scratch`` all compute such a layer this way, so they agree
        up to the rounding of a matrix product over other sets of rows; against
        the layer's plain form (and PyG) the difference is float rounding
        (4.5e-7 in ``bench/backfill.py``).

        Returns:
            The new rows and the number of sampled neighbours read.
        """
        if self.typed is not None:
            return self._compute_typed(layer, targets, inputs)
        k = self.fanouts[layer]
        projected = getattr(inputs, "projected", None) if self.projects[layer] else None
        out = np.empty((len(targets) if len(targets) > self.chunk_nodes else 0, self.dims[layer + 1]),
                       dtype=np.float32)
        sampled = 0
        for start in range(0, len(targets), self.chunk_nodes):
            chunk = targets[start:start + self.chunk_nodes]
            mat, degree = self.samples(chunk, k)
            valid = mat >= 0
            counts = valid.sum(axis=1)
            sampled += int(counts.sum())
            if k:
                self.capped += int(np.count_nonzero((counts == k) & (degree > k)))
            if projected is not None:  # padding points at the target itself, with weight 0
                table, pos, half = projected(np.concatenate([chunk, np.where(valid, mat, chunk[:, None]).ravel()]),
                                             self.projector(layer))
                nbr_rows = pos[len(chunk):].reshape(mat.shape)
                with torch.no_grad(), threads_for(len(chunk)):
                    h = self.gnn.layer_projected(layer, self.table_tensor(table), self.tensor(nbr_rows),
                                                 self.tensor(valid), self.tensor(pos[:len(chunk)] + half))
            else:
                flat = mat[valid]
                self_count = self.tensor(counts.astype(np.int64, copy=False))
                table, pos = inputs(np.concatenate([chunk, flat]))
                if self.uses_counts[layer]:
                    nbr_count = self.tensor(self.neighbour_counts(flat, k))
                else:
                    nbr_count = self.tensor(np.zeros(len(flat), dtype=np.int64))
                with torch.no_grad(), threads_for(len(chunk)):
                    h = self.gnn.layer_indexed(layer, self.tensor(table[pos[:len(chunk)]]), self.table_tensor(table),
                                               self.tensor(pos[len(chunk):]), self_count, nbr_count)
            h = h.cpu()  # no copy on the CPU
            if len(chunk) == len(targets):  # one chunk: keep torch's output, no copy
                return h.numpy(), sampled
            out[start:start + len(chunk)] = h.numpy()
        return out, sampled

    def _compute_typed(self, layer: int, targets: np.ndarray, inputs: Rows) -> tuple[np.ndarray, int]:
        """:meth:`compute` of a typed graph's nodes, :attr:`chunk_nodes` at a time: the samples of each edge type
        reaching a target (its slots' lists, :mod:`gnnstream.workers.engine.typed`) into
        :meth:`HeteroSAGE.layer_projected`, from the projections the source keeps (every layer, every node
        type in one call: a target costs one gathered sum, and only the rows that changed are projected
        again)."""
        k, projected = self.fanouts[layer], getattr(inputs, "projected")
        kinds = self.typed.types(targets)
        of_type = np.flatnonzero(kinds >= 0)
        whole = len(of_type) == len(targets) <= self.chunk_nodes  # one chunk of typed nodes: no copy
        out = None if whole else np.zeros((len(targets), self.dims[layer + 1]), dtype=np.float32)
        sampled = 0
        for start in range(0, len(of_type), self.chunk_nodes):
            sel = of_type[start:start + self.chunk_nodes]
            chunk = targets[sel]
            mat, planes = self._typed_samples(chunk, kinds[sel], k)
            h, read = self._typed_projected(layer, chunk, mat, planes, projected)
            sampled += read
            if whole:
                return h.cpu().numpy(), sampled
            out[sel] = h.cpu().numpy()
        if out is None:  # no target
            out = np.zeros((0, self.dims[layer + 1]), dtype=np.float32)
        return out, sampled

    def _typed_samples(self, chunk: np.ndarray, kinds: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``S_{k,ρ}`` of the ``j``-th edge type ``ρ`` reaching each target of ``chunk`` (its type's inbound
        order): a ``[len(chunk), places, k]`` iid matrix padded with -1 (empty past its type's edge types), read
        from the slots in one call; and ``[len(chunk), places]``, the projection plane of each ``ρ`` in its
        source type (:meth:`HeteroSAGE.project`). Counts the targets whose sample the fanout capped, in any
        edge type."""
        typed, store = self.typed, self.store
        schema = typed.schema
        present = [(t, np.flatnonzero(kinds == index)) for t, index in typed.type_index.items()]
        present = [(t, rows) for t, rows in present if len(rows)]
        places = max((len(schema.inbound(t)) for t, _ in present), default=0)
        slots = np.full((len(chunk), places), -1, dtype=np.int64)
        planes = np.zeros((len(chunk), places), dtype=np.int64)
        for t, rows in present:
            for j, e in enumerate(schema.inbound(t)):
                slots[rows, j] = typed.slots(chunk[rows], e)
                planes[rows, j] = 1 + self.gnn.outbound[e[0]].index(e)
        mat = np.full((len(chunk), places, k), -1, dtype=np.int64)
        flat = slots.ravel()
        live = np.flatnonzero(flat >= 0)
        degree = store.node_arrays(flat[live])[0]
        live, degree = live[degree >= 0], degree[degree >= 0]
        if len(live) and k:
            mat.reshape(-1, k)[live] = store.sample_matrix(k, flat[live])
            capped = np.zeros(len(flat), dtype=bool)
            capped[live] = degree > k
            self.capped += int(np.count_nonzero(capped.reshape(slots.shape).any(axis=1)))
        return mat, planes

    def _typed_projected(self, layer: int, chunk: np.ndarray, mat: np.ndarray, planes: np.ndarray,
                         projected: Any) -> tuple[torch.Tensor, int]:
        """A target's root plane (weight 1) and, per edge type, its neighbours' planes of that edge type
        (weight ``1 / |S_ρ(v)|``) in one gathered sum, a bag per target (the root first, then the samples in
        :meth:`_typed_samples`'s order); and the number of neighbours read."""
        n = len(chunk)
        valid = mat >= 0
        nbrs = mat[valid]  # grouped by target, then place
        table, pos, stride = projected(np.concatenate([chunk, nbrs]), self.projector(layer))
        counts = valid.sum(axis=2)  # [n, places]
        size = 1 + counts.sum(axis=1)
        offsets = np.cumsum(size) - size
        rows = np.empty(n + len(nbrs), dtype=np.int64)
        weights = np.ones(n + len(nbrs), dtype=np.float32)
        rows[offsets] = pos[:n]
        at = np.arange(len(nbrs)) + np.repeat(np.arange(1, n + 1), size - 1)  # after the root and the bags before
        per = counts.ravel()
        rows[at] = np.repeat((planes * stride).ravel(), per) + pos[n:]
        weights[at] = np.repeat((1.0 / np.maximum(per, 1)).astype(np.float32), per)
        with torch.no_grad(), threads_for(n):
            h = self.gnn.layer_projected(layer, self.table_tensor(table), self.tensor(rows), self.tensor(weights),
                                         self.tensor(offsets))
        return h, len(nbrs)
