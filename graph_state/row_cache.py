"""The row cache: rows of ``h^0 … h^L`` by interned node id, dense arrays in memory over the store's features
(layer 0) and the page logs (layers ``1 … L``).

The cache is write-through (rows reach the logs in the recompute's WriteBatch)
and bounded: past ``max_rows`` nodes it is dropped and rebuilt lazily from
the logs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from gnnstream.graph_state.idsets import unique_ids

if TYPE_CHECKING:
    from gnnstream.graph_state.page_log import PageLog
    from gnnstream.graph_state.store import GraphStore

__all__ = ["EmbeddingTables"]


class EmbeddingTables:
    """Rows of ``h^0 … h^L`` by interned id.

    Args:
        store: the graph store (owner of the features).
        dims: the row width of each layer, ``dims[0]`` being the feature dim.
        logs: where the rows of layers ``1 … L`` are stored, by layer (the engine's
            :class:`~gnnstream.graph_state.page_log.PageLog` s; the last one also holds versions and modes).
        max_rows: bound on the number of cached rows per layer.
    """

    def __init__(self, store: GraphStore, dims: Sequence[int], logs: "dict[int, PageLog]", max_rows: int = 4_000_000):
        self.store = store
        self.logs = logs
        self.dims = list(dims)
        self.max_rows = max_rows
        self._rows: list[np.ndarray] = [np.zeros((0, d), dtype=np.float32) for d in self.dims]
        self._loaded: list[np.ndarray] = [np.zeros(0, dtype=bool) for _ in self.dims]
        self._present: list[np.ndarray] = [np.zeros(0, dtype=bool) for _ in self.dims]
        # by layer, projections of the cached rows (:meth:`projected`): (their planes stacked, which are current)
        self._proj: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def clear(self) -> None:
        self._rows = [np.zeros((0, d), dtype=np.float32) for d in self.dims]
        self._loaded = [np.zeros(0, dtype=bool) for _ in self.dims]
        self._present = [np.zeros(0, dtype=bool) for _ in self.dims]
        self._proj.clear()

    def _grow(self, layer: int, size: int) -> bool:
        have = len(self._loaded[layer])
        if size <= have:
            return True
        if size > self.max_rows:
            return False
        bound = self.store.iid_bound  # every growth makes room for all the store's nodes, and an eighth more
        new = max(size, min(self.max_rows, max(min(2 * have, size + (1 << 20)), bound + bound // 8)))
        rows = np.zeros((new, self.dims[layer]), dtype=np.float32)
        rows[:have] = self._rows[layer]
        loaded = np.zeros(new, dtype=bool)
        loaded[:have] = self._loaded[layer]
        present = np.zeros(new, dtype=bool)
        present[:have] = self._present[layer]
        self._rows[layer], self._loaded[layer], self._present[layer] = rows, loaded, present
        self._proj.pop(layer, None)
        return True

    def _read(self, layer: int, iids: np.ndarray, keep: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The stored rows of ``iids`` and which exist; ``keep``: the other rows of the frames read are kept too
        (those of nodes not held yet: a held row may be newer than its frame)."""
        if layer == 0:
            return self.store.feature_rows(iids.tolist(), self.dims[0])
        log = self.logs[layer]
        return log.rows(iids, self.dims[layer], others=self._keeper(layer) if keep and log.frame_ids else None)

    def _keeper(self, layer: int) -> Callable[[np.ndarray, np.ndarray], None]:
        def keep(iids: np.ndarray, rows: np.ndarray) -> None:
            self._grow(layer, int(iids.max()) + 1)  # beyond the bound: those past it are left out
            loaded = self._loaded[layer]
            take = iids < len(loaded)
            take[take] = ~loaded[iids[take]]
            iids = iids[take]
            self._rows[layer][iids] = rows[take]
            self._present[layer][iids] = True
            loaded[iids] = True
            self._stale(layer, iids)
        return keep

    def get(self, layer: int, iids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``iids`` at ``layer`` and a mask of which exist (zeros elsewhere)."""
        iids = np.asarray(iids, dtype=np.int64)
        if len(iids) == 0:
            return np.zeros((0, self.dims[layer]), dtype=np.float32), np.zeros(0, dtype=bool)
        if not self._grow(layer, int(iids.max()) + 1):
            self.clear()
            return self._read(layer, iids)
        missing = iids[~self._loaded[layer][iids]]
        if len(missing):
            missing = unique_ids(missing)
            rows, present = self._read(layer, missing, keep=True)
            self._rows[layer][missing] = rows
            self._present[layer][missing] = present
            self._loaded[layer][missing] = True
            self._stale(layer, missing)
        return self._rows[layer][iids], self._present[layer][iids]

    def cached(self, layer: int, iids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``iids`` held in memory and a mask of which are (nothing is read)."""
        iids = np.asarray(iids, dtype=np.int64)
        have = len(self._loaded[layer])
        inside = iids < have
        held = np.zeros(len(iids), dtype=bool)
        held[inside] = self._loaded[layer][iids[inside]] & self._present[layer][iids[inside]]
        rows = np.zeros((len(iids), self.dims[layer]), dtype=np.float32)
        rows[held] = self._rows[layer][iids[held]]
        return rows, held

    def index(self, layer: int, iids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(table, positions)`` with ``table[positions[i]]`` the row of ``iids[i]`` (zeros where absent).

        The table is the cache itself when ``iids`` fit in it (no copy), else
        a fresh array of the requested rows.
        """
        iids = np.asarray(iids, dtype=np.int64)
        if len(iids) and self._grow(layer, int(iids.max()) + 1):
            missing = iids[~self._loaded[layer][iids]]
            if len(missing):
                self.get(layer, missing)
            return self._rows[layer], iids
        rows, _ = self.get(layer, iids)
        return rows, np.arange(len(iids), dtype=np.int64)

    def held(self, layer: int, iids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`index` and a mask of which rows exist: ``(table, positions, present)``."""
        iids = np.asarray(iids, dtype=np.int64)
        if len(iids) and self._grow(layer, int(iids.max()) + 1):
            table, pos = self.index(layer, iids)  # the cache itself
            return table, pos, self._present[layer][iids]
        rows, present = self.get(layer, iids)
        return rows, np.arange(len(iids), dtype=np.int64), present

    def projected(self, layer: int, iids: np.ndarray,
                  project: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, ...]]
                  ) -> tuple[np.ndarray, np.ndarray, int]:
        """``(table, positions, stride)``: ``project``'s outputs (its planes, as many as it returns) for the
        rows of ``iids`` at ``layer``, stacked in one table: ``table[j * stride + positions[i]]`` is plane ``j``
        of ``iids[i]`` (two planes: the first at ``positions[i]``, the second ``stride`` rows further).

        Projections are kept beside the cache and computed again only for
        rows set, loaded or invalidated since, so a layer whose inputs barely
        change costs no matrix product per target (``project`` must map each
        row on its own, like a linear layer); it is given the rows and their
        iids (a typed graph's projections depend on the node's type).
        """
        table, pos = self.index(layer, iids)
        if table is not self._rows[layer]:  # beyond the bound: nothing is kept
            planes = project(table, iids)
            return np.concatenate(planes), pos, len(table)
        held = self._proj.get(layer)
        stale = unique_ids(pos[~held[1][pos]]) if held is not None else unique_ids(pos)
        if len(stale):
            planes = project(table[stale], stale)
            held = self._held_projections(layer, len(planes), planes[0].shape[1])
            for j, plane in enumerate(planes):
                held[0][j * len(table) + stale] = plane
            held[1][stale] = True
        return held[0], pos, len(table)

    def _held_projections(self, layer: int, planes: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        held = self._proj.get(layer)
        if held is None:
            size = len(self._rows[layer])
            held = self._proj[layer] = (np.zeros((planes * size, width), dtype=np.float32),
                                        np.zeros(size, dtype=bool))
        return held

    def _stale(self, layer: int, iids: np.ndarray) -> None:
        held = self._proj.get(layer)
        if held is not None:
            held[1][iids] = False

    def set(self, layer: int, iids: np.ndarray, rows: np.ndarray | None) -> None:
        """Update cached rows of distinct ``iids`` (``rows`` None removes them); the caller writes RocksDB."""
        iids = np.asarray(iids, dtype=np.int64)
        if len(iids) == 0 or not self._grow(layer, int(iids.max()) + 1):
            return
        self._stale(layer, iids)
        if rows is None:
            self._rows[layer][iids] = 0
            self._present[layer][iids] = False
        else:
            table = self._rows[layer]
            rows = np.asarray(rows, dtype=np.float32)
            if np.may_share_memory(rows, table):  # rows read from the table itself: copied before it is written
                rows = rows.copy()
            table[iids] = rows
            self._present[layer][iids] = True
        self._loaded[layer][iids] = True

    def invalidate(self, layer: int, iids: Sequence[int] | np.ndarray) -> None:
        """Forget cached rows so the next read goes to RocksDB (after feature writes)."""
        idx = np.asarray(iids, dtype=np.int64)
        if len(idx) and len(self._loaded[layer]):
            idx = idx[idx < len(self._loaded[layer])]
            self._loaded[layer][idx] = False
            self._stale(layer, idx)
