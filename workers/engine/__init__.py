"""The incremental engine: exact recompute of the embeddings each event can change.

Modules:
    engine: :class:`Engine`, the layer-by-layer wavefront over the store's dirty marks, backfill and the
        from-scratch computation ``verify`` compares with.
    shards: :class:`OutputShards`, the output partitions whose final rows an engine keeps in a group.
    layers: :class:`LayerRunner`, one layer of the model over a set of targets.
    rows: the sources of a layer's input rows.
    stats: :class:`RecomputeStats`, what a recompute did.
    device: the torch device of a backfill and the threads of a layer.
"""

from gnnstream.workers.engine.device import check_device
from gnnstream.workers.engine.engine import DEFERRED_TAG, DELETED, Engine
from gnnstream.workers.engine.shards import kept_partitions
from gnnstream.workers.engine.stats import EngineError, RecomputeStats

__all__ = ["Engine", "EngineError", "RecomputeStats", "DEFERRED_TAG", "DELETED", "check_device", "kept_partitions"]
