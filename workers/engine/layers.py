"""One GNN layer over a set of targets: their samples from the store, their input rows from a source, the
layer's arithmetic in torch, on the CPU or (for a backfill) another device."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch

from gnnstream.graph_state.store import GraphStore
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
                 chunk_nodes: int):
        self.store, self.gnn, self.policy = store, gnn, policy
        self.plain = policy.name == "plain"
        self.fanouts, self.dims, self.chunk_nodes = fanouts, dims, chunk_nodes
        self.device = torch.device("cpu")  # where the layers run: another only inside running_on
        self._device_table: tuple[np.ndarray, torch.Tensor] | None = None  # the input table copied to the device
        self.uses_counts = [bool(getattr(c, "uses_neighbour_counts", False)) for c in gnn.convs]
        # a layer past the first whose inputs (the engine's own h^l) can be kept projected: see compute
        self.projects = [layer > 0 and gnn.projects(layer) for layer in range(len(fanouts))]
        self.capped = 0  # targets whose sample was capped by the fanout, since take_capped

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

    def samples(self, targets: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(S_k of every target as a [len(targets), k] iid matrix in rank order padded with -1, target degrees)``.

        A node the cold-start policy keeps off its neighbours gets an empty sample.
        """
        store = self.store
        mat = store.sample_matrix(k, targets)
        degree, _, _ = store.node_arrays(targets)
        if not self.plain:
            mat[~self.policy.uses_neighbours_many(np.maximum(degree, 0))] = -1
        return mat, degree

    def neighbour_counts(self, nbrs: np.ndarray, k: int) -> np.ndarray:
        """``|S_k(u)|`` of every neighbour row as the layer sees it (0 for a node kept off its neighbours)."""
        degree = np.maximum(self.store.node_arrays(nbrs)[0], 0)
        count = np.minimum(degree, k)
        if not self.plain:
            count[~self.policy.uses_neighbours_many(degree)] = 0
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
        def project(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            with threads_for(len(rows)):
                first, second = self.gnn.project(layer, self.tensor(rows))
            return first.cpu().numpy(), second.cpu().numpy()
        return project

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
