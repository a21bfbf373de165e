"""``gnnstream train``: a GNN and a logistic scoring head from an event file and a labels file.

The events (JSON lines of the events schema, or a SNAP signed-network CSV
turned into events as ``gnnstream events from-snap`` does) are split by time:
the first ``train_fraction`` of the edge events in file order (file order is
time order, as a replay sends them), with the node events between them, are
the training window. The GNN is trained on the graph of that window as a
worker's state shows it at the cut: a graph store built from those events
(with the edge window ``edge_ttl`` a state serving the model is created with),
sampled by the engine's own layer runner, so the bottom-k samples, the edges
the window keeps and the cold-start stages of the model's policy (by node age
at the cut's stream time, for ``staged``) are the ones the worker serves with.

Labels (``id,label`` lines, label 0 or 1, an optional third column ``ts``,
a header line allowed): a labelled node is a *training* node when its label
is known before the cut, i.e. its ``ts`` (without one: the time of the first
event naming it) is before the first held-out event's; every other labelled
node is *held out*. Held-out nodes are scored with the embeddings of the
whole stream (what the worker serves once it has applied the file) and their
ROC AUC is the model's held-out metric.

The output is a model directory (``config.json`` + ``weights.pt``) with
``head.json`` (the head and the ``NAME:VERSION`` it was trained for) and
``train.json`` (what was trained on, and the metrics).
"""

from __future__ import annotations

import csv
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from gnnstream.graph_state.store import GraphStore
from gnnstream.model import GNN, ModelConfig, ModelDirExists, save_model_dir
from gnnstream.model.head import ScoreHead
from gnnstream.stream.events import EdgeUpsert, Event, InvalidEvent, NodeUpsert, check_features, decode_event_json
from gnnstream.stream.rollout import version_topic
from gnnstream.stream.snap import read_snap, snap_events
from gnnstream.workers.engine.layers import LayerRunner
from gnnstream.workers.engine.stages import STAGE_NAMES
from gnnstream.workers.offline.jobs import event_lines

__all__ = ["read_events", "read_labels", "train_model", "fit", "roc_auc", "roc_curve", "TRAIN_FILE"]

logger = logging.getLogger(__name__)

TRAIN_FILE = "train.json"
Labels = Mapping[str, int | tuple[int, float]]


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


def _takes_features(ev: Event, dim: int) -> bool:
    """Whether a model of ``dim`` inputs takes ``ev`` (:func:`check_features`)."""
    try:
        check_features(ev, dim, "the first node_upsert gives")
    except InvalidEvent:
        return False
    return True


def read_events(path: str | os.PathLike[str],
                decode: Callable[[bytes], Event] = decode_event_json) -> tuple[list[Event], int]:
    """The events of a file and the number of invalid lines skipped.

    A name ending in ``.csv`` or ``.csv.gz`` is a SNAP signed-network CSV (edges plus derived node features);
    anything else is JSON lines of the events schema, each read with ``decode`` (which raises
    :class:`InvalidEvent` for a line to skip).
    """
    name = str(path)
    if name.endswith((".csv", ".csv.gz")):
        return list(snap_events(read_snap(path))), 0
    events, invalid = [], 0
    for line in event_lines(path, "gunzip it first (a SNAP CSV is read as it is when named *.csv.gz)"):
        if not line.strip():
            continue
        try:
            events.append(decode(line))
        except InvalidEvent:
            invalid += 1
    if not events:
        raise ValueError(f"no events read from {name}: expected JSON lines of the events schema (docs/design.md) "
                         f"or a SNAP CSV named *.csv / *.csv.gz")
    return events, invalid


def read_labels(path: str | os.PathLike[str]) -> dict[str, int | tuple[int, float]]:
    """``id,label[,ts]`` lines (a first line that is not a label is a header) as ``{id: label or (label, ts)}``."""
    out: dict[str, int | tuple[int, float]] = {}
    with open(path, newline="") as fh:
        for n, row in enumerate(csv.reader(fh), 1):
            if not row or not "".join(row).strip():
                continue
            if len(row) not in (2, 3) or row[1].strip() not in ("0", "1"):
                if n == 1 and len(row) in (2, 3):
                    continue  # a header
                raise ValueError(f"labels file {str(path)!r} line {n}: expected id,label[,ts] with label 0 or 1 "
                                 f"(got {','.join(row)!r})")
            label = int(row[1])
            if len(row) == 3:
                try:
                    out[row[0].strip()] = (label, float(row[2]))
                except ValueError:
                    raise ValueError(f"labels file {str(path)!r} line {n}: ts {row[2]!r} is not a number") from None
            else:
                out[row[0].strip()] = label
    if not out:
        raise ValueError(f"labels file {str(path)!r} holds no labels; write one id,label line per labelled node")
    return out


def fit(gnn: torch.nn.Module, head: torch.nn.Module, logits: Callable[[], torch.Tensor], y: torch.Tensor, *,
        epochs: int, lr: float) -> float:
    """Fit ``gnn`` and ``head`` together, full batch: Adam on the logistic loss of ``logits()`` against the labels
    ``y``, the rarer class weighted up; both are left in eval mode. Returns the last loss."""
    optim = torch.optim.Adam(list(gnn.parameters()) + list(head.parameters()), lr=lr, weight_decay=5e-4)
    pos_weight = torch.tensor([(len(y) - y.sum()) / max(float(y.sum()), 1.0)])
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    gnn.train()
    for epoch in range(epochs):
        optim.zero_grad()
        loss = loss_fn(logits(), y)
        loss.backward()
        optim.step()
        if epoch % 50 == 0:
            logger.info("epoch %d loss %.4f", epoch, loss.item())
    gnn.eval()
    return loss.item()


def _edge_cut(events: Sequence[Event], fraction: float) -> int:
    """Position of the first held-out event: the edge event after the first ``fraction`` of the edge events."""
    edges = [i for i, ev in enumerate(events) if isinstance(ev, EdgeUpsert)]
    if len(edges) < 2:
        raise ValueError(f"the events hold {len(edges)} edge_upsert events; training needs a graph")
    k = int(len(edges) * fraction)
    return edges[k] if 0 < k < len(edges) else len(events)


def _store_graph(events: Sequence[Event], tmp: Path, config: ModelConfig, gnn: GNN,
                 edge_ttl: int) -> tuple[list[str], torch.Tensor, list[torch.Tensor], dict[str, int]]:
    """Node names, features, one sampled edge list per layer (row 0 the neighbour, row 1 the target) and how
    many nodes are in each cold-start stage, read from a graph store of ``events`` with the edge window
    ``edge_ttl``: the samples are the engine's (:meth:`LayerRunner.samples`), with the window, the node ages
    and the model's cold-start stages as the store's stream time shows them."""
    store = GraphStore(tmp, seed=config.seed, feature_dim=config.in_dim, edge_ttl=edge_ttl)
    try:
        for start in range(0, len(events), 5000):
            store.apply(list(events[start:start + 5000]))
        iids = np.fromiter(store.node_iids(), dtype=np.int64)
        names = [store.name(int(i)) for i in iids]
        feats, _ = store.feature_rows(iids.tolist())
        runner = LayerRunner(store, gnn, config.cold_start_policy, list(config.fanouts), list(gnn.dims),
                             max(len(iids), 1))
        stages = np.bincount(runner.stages(iids).astype(np.int64), minlength=len(STAGE_NAMES))
        pos = np.zeros(int(iids.max(initial=-1)) + 1, dtype=np.int64)
        pos[iids] = np.arange(len(iids))
        edges = []
        for k in config.fanouts:
            mat, _ = runner.samples(iids, k)
            valid = mat >= 0
            targets = np.repeat(np.arange(len(iids)), valid.sum(axis=1))
            edges.append(torch.from_numpy(np.stack([pos[mat[valid]], targets])))
    finally:
        store.close()
    return names, torch.from_numpy(feats), edges, dict(zip(STAGE_NAMES, stages.tolist()))


def _split(labels: Labels, events: Sequence[Event], cut: int) -> tuple[dict[str, int], dict[str, int]]:
    """(training labels, held-out labels) by when each label is known."""
    first: dict[str, int] = {}
    for i, ev in enumerate(events):
        for node in ((ev.src, ev.dst) if isinstance(ev, EdgeUpsert) else (getattr(ev, "id", None),)):
            if node is not None and node not in first:
                first[node] = i
    cut_ts = events[cut].ts if cut < len(events) else float("inf")
    train, held = {}, {}
    for node, value in labels.items():
        label, ts = value if isinstance(value, tuple) else (value, None)
        if node not in first:
            continue  # never in the events: no embedding to score
        before = ts < cut_ts if ts is not None else first[node] < cut
        (train if before else held)[node] = int(label)
    return train, held


def train_model(events: str | os.PathLike[str] | Sequence[Event], labels: str | os.PathLike[str] | Labels,
                out: str | os.PathLike[str], *, arch: str = "sage", hidden: int = 64, out_dim: int = 32,
                fanouts: Sequence[int] = (25, 10), heads: int = 1, seed: int = 0, epochs: int = 300,
                lr: float = 0.01, train_fraction: float = 0.7, cold_start: Mapping[str, Any] | None = None,
                edge_ttl: int = 0, name: str = "model", version: int = 1, overwrite: bool = False) -> dict[str, Any]:
    """Train a GNN and a logistic head on the training window and save them with their held-out metrics.

    Args:
        events: an event file (see :func:`read_events`) or the events themselves, in time order.
        labels: a labels file (see :func:`read_labels`) or ``{id: label}`` / ``{id: (label, ts)}``.
        out: the model directory to write.
        arch, hidden, out_dim, fanouts, heads, seed, cold_start, name, version: the model
            (:class:`~gnnstream.model.ModelConfig`; ``seed`` also seeds the initial weights).
        epochs, lr: full-batch Adam steps and their learning rate.
        train_fraction: the share of the edge events that is the training window, in (0, 1).
        edge_ttl: the edge window in seconds of the state the model will serve (``--edge-ttl``; 0: none). The
            training graph is the window's at the cut, the held-out one the window's at the end of the events.
        overwrite: replace a non-empty ``out``.

    Returns:
        The summary written to ``train.json``: sizes, ``train_auc``, ``held_out_auc`` (None without both
        classes held out).

    Raises:
        ValueError: for invalid arguments, events without node features, or training labels of one class.
        ModelDirExists: ``out`` exists and is not empty, and ``overwrite`` is false.
    """
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be a non-negative integer (got {version!r})")
    version_topic(f"{name}:{version}")  # a model id whose version topic Kafka accepts
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1 (got {epochs})")
    if not 0 < train_fraction < 1:
        raise ValueError(f"train_fraction must be between 0 and 1, both excluded (got {train_fraction})")
    if isinstance(edge_ttl, bool) or not isinstance(edge_ttl, int) or edge_ttl < 0:
        raise ValueError(f"edge_ttl must be a whole number of seconds >= 0 (got {edge_ttl!r}; 0 = no window)")
    out = Path(out)
    if not overwrite and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelDirExists(f"{out} already exists and is not empty; choose another output directory, or pass "
                             f"--force (overwrite=True) to replace the model in it")
    source = "events" if not isinstance(events, (str, os.PathLike)) else str(events)
    evs, invalid = (list(events), 0) if source == "events" else read_events(events)
    if not isinstance(labels, Mapping):
        labels = read_labels(labels)
    dim = next((len(ev.features) for ev in evs if isinstance(ev, NodeUpsert)), 0)
    if not dim:
        raise ValueError(f"{source} holds no node_upsert event with features; the GNN needs node features")
    kept = [ev for ev in evs if _takes_features(ev, dim)]  # as apply: the first node_upsert sets the width
    evs, invalid = kept, invalid + len(evs) - len(kept)
    cut = _edge_cut(evs, train_fraction)
    train_labels, held_labels = _split(labels, evs, cut)
    if not 0 < sum(train_labels.values()) < len(train_labels):
        raise ValueError(f"the training window of {source} (train fraction {train_fraction}) labels "
                         f"{len(train_labels)} nodes but not both classes; use a larger --train-fraction or "
                         f"more labels")
    config = ModelConfig(arch=arch, in_dim=dim, hidden_dim=hidden, out_dim=out_dim, num_layers=len(fanouts),
                         fanouts=tuple(fanouts), seed=seed, heads=heads,
                         cold_start=dict(cold_start) if cold_start is not None else {"policy": "plain"},
                         name=name, version=version)
    torch.manual_seed(seed)
    gnn = GNN.from_config(config)
    with tempfile.TemporaryDirectory(prefix="gnnstream-train-") as tmp:
        names, x, edges, stages = _store_graph(evs[:cut], Path(tmp) / "train", config, gnn, edge_ttl)
        all_names, all_x, all_edges, _ = _store_graph(evs, Path(tmp) / "all", config, gnn, edge_ttl)
    idx = torch.tensor([i for i, n in enumerate(names) if n in train_labels], dtype=torch.int64)
    y = torch.tensor([train_labels[names[i]] for i in idx.tolist()], dtype=torch.float32)
    head = torch.nn.Linear(out_dim, 1)
    loss = fit(gnn, head, lambda: head(gnn(x, edges)[idx]).squeeze(-1), y, epochs=epochs, lr=lr)
    with torch.no_grad():
        train_scores = torch.sigmoid(head(gnn(x, edges)[idx]).squeeze(-1)).numpy()
        all_scores = torch.sigmoid(head(gnn(all_x, all_edges)).squeeze(-1)).numpy()
    row = {n: i for i, n in enumerate(all_names)}
    held = [(n, yv) for n, yv in held_labels.items() if n in row]
    held_y = np.array([yv for _, yv in held], dtype=np.int64)
    held_p = np.array([all_scores[row[n]] for n, _ in held])
    held_auc = round(roc_auc(held_y, held_p), 4) if 0 < held_y.sum() < len(held_y) else None
    save_model_dir(out, config, gnn.state_dict())
    ScoreHead(tuple(head.weight[0].detach().tolist()), head.bias[0].item(), config.model_id).save(out)
    edge_count = sum(isinstance(ev, EdgeUpsert) for ev in evs)
    summary = {
        "model": config.model_id, "events": len(evs), "invalid_lines": invalid, "edges": edge_count,
        "train_events": cut, "train_edges": sum(isinstance(ev, EdgeUpsert) for ev in evs[:cut]),
        "train_until_ts": evs[cut - 1].ts if cut else None, "edge_ttl": edge_ttl, "train_nodes": len(names),
        "train_edges_sampled": [int(e.shape[1]) for e in edges], "train_stages": stages,
        "labelled": len(idx), "positive": int(y.sum()),
        "train_auc": round(roc_auc(y.numpy(), train_scores), 4), "final_loss": round(loss, 4),
        "held_out": len(held), "held_out_positive": int(held_y.sum()), "held_out_auc": held_auc,
        "epochs": epochs,
    }
    (out / TRAIN_FILE).write_text(json.dumps(summary, indent=2))
    logger.info("trained %s: %s", config.model_id, summary)
    return summary
