"""``train_fraud_model``: a GraphSAGE model and a logistic fraud head from Bitcoin OTC.

One use of the generic trainer (:func:`gnnstream.workers.offline.train.train_model`, ``gnnstream train``):
the SNAP CSV is turned into events (edges plus derived node features), the first ``train_fraction`` of the
ratings by time is the training window, and the labels are the demo's: a user whose received ratings average
below zero is *distrusted* (1), else trusted (0). A user rated in the training window is labelled from its
ratings in the window (a training label); a user first rated later is labelled from all its ratings and held
out (the users whose fraud scores the demo's ROC AUC is taken on).

The output directory is a normal model directory (``config.json`` + ``weights.pt``) plus ``head.json`` (the
logistic head and the ``NAME:VERSION`` tag of the model it was trained for, which the scorer checks every update
against) and ``train.json`` (what was trained on, and the metrics). An existing non-empty output directory is
refused unless ``overwrite`` is set.

``name`` and ``version`` make the tag (default ``otc-sage:1``): a second version to roll out beside the first is
trained with another ``version`` (and, for other weights, another ``seed``); it publishes to its own topic
(:func:`gnnstream.stream.rollout.version_topic`).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Sequence

from gnnstream.stream.snap import SnapRating, read_snap
from gnnstream.workers.offline.train import roc_auc, roc_curve, train_model

__all__ = ["distrust_labels", "otc_labels", "train_fraud_model", "roc_auc", "roc_curve"]

logger = logging.getLogger(__name__)


def distrust_labels(rows: Sequence[SnapRating]) -> dict[str, int]:
    """1 for users whose received ratings average below zero, 0 for the other rated users."""
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for r in rows:
        total[r.dst] += r.rating
        count[r.dst] += 1
    return {node: int(total[node] / count[node] < 0) for node in count}


def otc_labels(rows: Sequence[SnapRating], train_fraction: float) -> dict[str, tuple[int, float]]:
    """The demo's labels with the time each is known (the user's first rating): from the training window's
    ratings for users rated in it, from all ratings for the others."""
    cut = int(len(rows) * train_fraction)
    first: dict[str, float] = {}
    for r in rows:
        first.setdefault(r.dst, r.ts)
    labels = {**distrust_labels(rows), **distrust_labels(rows[:cut])}
    return {node: (y, first[node]) for node, y in labels.items()}


def train_fraud_model(csv: str | Path, out: str | Path, *, train_fraction: float = 0.7, hidden: int = 64,
                      out_dim: int = 32, fanouts: Sequence[int] = (25, 10), seed: int = 0, epochs: int = 300,
                      lr: float = 0.01, cold_start: Mapping[str, Any] | None = None, edge_ttl: int = 0,
                      name: str = "otc-sage", version: int = 1, overwrite: bool = False) -> dict[str, Any]:
    """Train and save; returns the summary (sizes, training and held-out AUC).

    ``cold_start`` (the model's policy, default plain) and ``edge_ttl`` (the edge window in seconds of the state
    that will serve it, default none) shape the training neighbourhoods as :func:`train_model` describes.

    Raises:
        ValueError: ``epochs`` < 1, ``train_fraction`` not in (0, 1), ``name:version`` not a model id
            (a name of letters, digits, ``.``, ``_`` or ``-``; a non-negative version), or ``csv`` holds no
            ratings (not a SNAP signed-network CSV) or too few to train on.
        ModelDirExists: ``out`` exists and is not empty, and ``overwrite`` is false.
    """
    if not 0 < train_fraction < 1:
        raise ValueError(f"train_fraction must be between 0 and 1, both excluded (got {train_fraction})")
    rows = read_snap(csv)
    summary = train_model(csv, otc_labels(rows, train_fraction), out, arch="sage", hidden=hidden, out_dim=out_dim,
                          fanouts=fanouts, seed=seed, epochs=epochs, lr=lr, train_fraction=train_fraction,
                          cold_start=cold_start, edge_ttl=edge_ttl, name=name, version=version, overwrite=overwrite)
    return {**summary, "ratings": len(rows), "train_ratings": summary["train_edges"]}
