"""``gnnstream train``: a GraphSAGE model and a logistic fraud head from Bitcoin OTC.

The model is trained on the first ``train_fraction`` of the rating stream (by
time) with exactly the sampler the worker serves with (bottom-k samples read
from a graph store built from those events), so the served embeddings are the
ones the head was trained on. Labels: a user whose received ratings average
below zero is *distrusted* (1), else trusted (0); only users rated in the
training window are labelled for training.

The output directory is a normal model directory (``config.json`` +
``weights.pt``) plus ``head.json`` (the logistic head and the ``NAME:VERSION``
tag of the model it was trained for, which the scorer checks every update
against) and ``train.json`` (what was trained on, for the record). An existing
non-empty output directory is refused unless ``overwrite`` is set.

``name`` and ``version`` make the tag (default ``otc-sage:1``): a second
version to roll out beside the first is trained with another ``version``
(and, for other weights, another ``seed``); it publishes to its own topic
(:func:`stream.rollout.version_topic`).
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from gnnstream.graph_state.store import GraphStore
from gnnstream.model import GNN, ModelConfig, ModelDirExists, save_model_dir
from gnnstream.model.head import ScoreHead
from gnnstream.stream.rollout import version_topic
from gnnstream.stream.snap import FEATURE_DIM, SnapRating, read_snap, snap_events

__all__ = ["distrust_labels", "train_fraud_model", "roc_auc", "roc_curve"]

logger = logging.getLogger(__name__)

def distrust_labels(rows: Sequence[SnapRating]) -> dict[str, int]:
    """1 for users whose received ratings average below zero, 0 for the other rated users."""
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for r in rows:
        total[r.dst] += r.rating
        count[r.dst] += 1
    return {node: int(total[node] / count[node] < 0) for node in count}


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (rank statistic, ties averaged)."""
    labels = np.asarray(labels, dtype=bool)
    scores = np.asarray(scores, dtype=np.float64)
    pos, neg = int(labels.sum()), int((~labels).sum())
    if not pos or not neg:
        raise ValueError(f"Expected both classes for an AUC (got {pos} positive, {neg} negative)")
    order = scores.argsort(kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def roc_curve(labels: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """False- and true-positive rates at every threshold (for plotting)."""
    labels = np.asarray(labels, dtype=bool)
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="mergesort")
    tp = np.concatenate([[0], np.cumsum(labels[order])])
    fp = np.concatenate([[0], np.cumsum(~labels[order])])
    return fp / max(fp[-1], 1), tp / max(tp[-1], 1)


def _sampled_edges(store: GraphStore, iids: np.ndarray, k: int) -> torch.Tensor:
    pos = {int(v): i for i, v in enumerate(iids)}
    src, dst = [], []
    for i, v in enumerate(iids.tolist()):
        for u in store.sample_iids(v, k):
            src.append(pos[u])
            dst.append(i)
    return torch.tensor([src, dst], dtype=torch.int64)


def train_fraud_model(csv: str | Path, out: str | Path, *, train_fraction: float = 0.7, hidden: int = 64,
                      out_dim: int = 32, fanouts: Sequence[int] = (25, 10), seed: int = 0, epochs: int = 300,
                      lr: float = 0.01, name: str = "otc-sage", version: int = 1,
                      overwrite: bool = False) -> dict[str, Any]:
    """Train and save; returns a summary (sizes, training AUC).

    Raises:
        ValueError: ``epochs`` < 1, ``train_fraction`` not in (0, 1), ``name:version`` not a model id
            (a name of letters, digits, ``.``, ``_`` or ``-``; a non-negative version), or ``csv`` holds no
            ratings (not a SNAP signed-network CSV) or too few to train on.
        ModelDirExists: ``out`` exists and is not empty, and ``overwrite`` is false.
    """
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be a non-negative integer (got {version!r})")
    version_topic(f"{name}:{version}")  # a model id whose version topic Kafka accepts
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1 (got {epochs})")
    if not 0 < train_fraction < 1:
        raise ValueError(f"train_fraction must be between 0 and 1, both excluded (got {train_fraction})")
    out = Path(out)
    if not overwrite and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelDirExists(f"{out} already exists and is not empty; choose another output directory, or pass "
                             f"--force (overwrite=True) to replace the model in it")
    rows = read_snap(csv)
    if not rows:
        raise ValueError(f"no ratings read from {csv}: expected a SNAP signed-network CSV (source,target,rating,time)")
    cut = int(len(rows) * train_fraction)
    train_rows = rows[:cut]
    labels = distrust_labels(train_rows)
    if not 0 < sum(labels.values()) < len(labels):
        raise ValueError(f"the first {cut} of the {len(rows)} ratings of {csv} (train fraction {train_fraction}) "
                         f"rate {len(labels)} users but not both trusted and distrusted ones; use a larger "
                         f"--train-fraction or a larger file")
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory(prefix="gnnstream-train-") as tmp:
        store = GraphStore(Path(tmp) / "state", seed=seed, feature_dim=FEATURE_DIM)
        events = list(snap_events(train_rows))
        for start in range(0, len(events), 5000):
            store.apply(events[start:start + 5000])
        iids = np.fromiter(store.node_iids(), dtype=np.int64)
        names = [store.name(int(i)) for i in iids]
        feats, _ = store.feature_rows(iids.tolist())
        edges = [_sampled_edges(store, iids, k) for k in fanouts]
        store.close()
    x = torch.from_numpy(feats)
    rows_labelled = np.array([i for i, n in enumerate(names) if n in labels], dtype=np.int64)
    y = torch.tensor([labels[names[i]] for i in rows_labelled], dtype=torch.float32)
    idx = torch.from_numpy(rows_labelled)
    config = ModelConfig(arch="sage", in_dim=FEATURE_DIM, hidden_dim=hidden, out_dim=out_dim,
                         num_layers=len(fanouts), fanouts=tuple(fanouts), seed=seed, name=name, version=version)
    gnn = GNN.from_config(config)
    head = torch.nn.Linear(out_dim, 1)
    optim = torch.optim.Adam(list(gnn.parameters()) + list(head.parameters()), lr=lr, weight_decay=5e-4)
    pos_weight = torch.tensor([(len(y) - y.sum()) / max(float(y.sum()), 1.0)])
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    gnn.train()
    for epoch in range(epochs):
        optim.zero_grad()
        logits = head(gnn(x, edges)[idx]).squeeze(-1)
        loss = loss_fn(logits, y)
        loss.backward()
        optim.step()
        if epoch % 50 == 0:
            logger.info("epoch %d loss %.4f", epoch, loss.item())
    gnn.eval()
    with torch.no_grad():
        train_scores = torch.sigmoid(head(gnn(x, edges)[idx]).squeeze(-1)).numpy()
    save_model_dir(out, config, gnn.state_dict())
    ScoreHead(tuple(head.weight[0].detach().tolist()), head.bias[0].item(), config.model_id).save(out)
    summary = {
        "model": config.model_id, "ratings": len(rows), "train_ratings": cut,
        "train_until_ts": rows[cut - 1].ts if cut else None, "train_nodes": len(names),
        "labelled": len(rows_labelled), "distrusted": int(y.sum()),
        "train_auc": round(roc_auc(y.numpy(), train_scores), 4), "final_loss": round(loss.item(), 4),
        "epochs": epochs,
    }
    (out / "train.json").write_text(json.dumps(summary, indent=2))
    return summary
