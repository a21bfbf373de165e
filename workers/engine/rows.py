"""Sources of a layer's input rows: a dense copy, or the engine's cached tables."""

from __future__ import annotations

from typing import Callable

import numpy as np

from gnnstream.graph_state.row_cache import EmbeddingTables

__all__ = ["Rows", "Project", "DenseRows", "CachedRows"]

Rows = Callable[[np.ndarray], "tuple[np.ndarray, np.ndarray]"]
"""Layer inputs by iid: ``rows(iids) -> (table, positions)``, ``table[positions[i]]`` being the row of ``iids[i]``.

A source may also offer ``projected(iids, project) -> (table, positions, stride)``: a
layer's projections of those rows (``project(rows, iids)``, its planes: the two of
:meth:`gnnstream.model.network.GNN.project`, or a typed layer's) stacked in one table,
each plane ``stride`` rows after the one before, kept between calls where it can."""
Project = Callable[[np.ndarray, np.ndarray], "tuple[np.ndarray, ...]"]


class DenseRows:
    """The rows of ``targets`` (zeros for any other iid) as a :data:`Rows` source, projected once on request."""

    def __init__(self, targets: np.ndarray, rows: np.ndarray):
        self._iids = np.append(targets, -1)  # of the rows, the zeros last
        self._pos = np.full(int(targets.max()) + 1 if len(targets) else 0, len(rows), dtype=np.int64)
        self._pos[targets] = np.arange(len(targets))
        self._rows = np.concatenate([rows, np.zeros((1, rows.shape[1]), dtype=np.float32)])
        self._projected: np.ndarray | None = None

    def _positions(self, iids: np.ndarray) -> np.ndarray:
        inside = iids < len(self._pos)
        return np.where(inside, self._pos[np.where(inside, iids, 0)], len(self._rows) - 1)

    def __call__(self, iids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._rows, self._positions(iids)

    def projected(self, iids: np.ndarray, project: Project) -> tuple[np.ndarray, np.ndarray, int]:
        if self._projected is None:
            self._projected = np.concatenate(project(self._rows, self._iids))
        return self._projected, self._positions(iids), len(self._rows)


class CachedRows:
    """The engine's cached rows of one layer (:class:`EmbeddingTables`) as a :data:`Rows` source."""

    def __init__(self, tables: EmbeddingTables, layer: int):
        self.tables, self.layer = tables, layer

    def __call__(self, iids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.tables.index(self.layer, iids)

    def projected(self, iids: np.ndarray, project: Project) -> tuple[np.ndarray, np.ndarray, int]:
        return self.tables.projected(self.layer, iids, project)
