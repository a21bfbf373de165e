"""``gnnstream train --schema``: a typed GraphSAGE and a transaction head from a typed event file and
transaction labels.

The events are JSON lines of a typed graph (docs/design.md, Typed graphs),
checked against the schema; lines that are not are skipped and counted. The
split is by time (file order is time order): the first ``train_fraction`` of
the scored relation's transactions, with every event before the first
held-out one, are the training window.

- **Training**: the model's layers run on the graph of the training window
  at its end, sampled as the contract samples it (bottom-k per relation,
  :func:`gnnstream.graph_state.sampler.seeded_rank_bytes` with the relation);
  each training transaction is scored ``sigmoid(w · (h_src ‖ h_dst ‖ x_e) +
  b)`` with those embeddings, and the layers and the head are fitted
  together, full batch, with a loss weighted for the rarer class.
- **Held out**: the held-out window is cut into ``slices`` of as many
  events; each transaction is scored with the embeddings of the graph as it
  stood when its slice began, so no score sees an event after its
  transaction. The metrics are the ROC AUC and the precision among the
  ``alert_rate`` highest scores.

Labels: a CSV with a header naming ``txn_id`` and ``label`` columns (0 or 1),
as ``python -m gnnstream.fraud.payments`` writes them. The output is a typed
model directory (``config.json`` with the schema, ``weights.pt`` keyed as
``to_hetero`` keys them), ``head.json`` (the transaction head) and
``train.json`` (the metrics).
"""

from __future__ import annotations

import csv
import functools
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from gnnstream.graph_state.sampler import seeded_rank_bytes
from gnnstream.model import ModelConfig, ModelDirExists, save_model_dir
from gnnstream.model.head import TransactionHead
from gnnstream.model.hetero import HeteroSAGE
from gnnstream.model.schema import EdgeType, GraphSchema, edge_type_name
from gnnstream.stream.events import (EdgeDelete, EdgeUpsert, Event, NodeDelete, NodeUpsert, check_schema,
                                     decode_event_json)
from gnnstream.stream.rollout import version_topic
from gnnstream.workers.offline.train import TRAIN_FILE, fit, read_events, roc_auc

__all__ = ["TypedGraph", "read_typed_events", "read_transaction_labels", "train_typed_model",
           "precision_at_rate"]

logger = logging.getLogger(__name__)


def read_typed_events(path: str | os.PathLike[str], schema: GraphSchema) -> tuple[list[Event], int]:
    """The events of a typed event file that ``schema`` takes, and how many lines it did not."""
    node_types = dict(schema.node_types)
    relations = {r.edge_type: r.edge_features for r in schema.relations}

    def decode(line: bytes) -> Event:
        ev = decode_event_json(line, typed=True)
        check_schema(ev, node_types, relations)
        return ev

    return read_events(path, decode)


def read_transaction_labels(path: str | os.PathLike[str]) -> dict[str, int]:
    """``{txn_id: label}`` from a CSV whose header names ``txn_id`` and ``label`` columns."""
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        if not reader.fieldnames or not {"txn_id", "label"} <= set(reader.fieldnames):
            raise ValueError(f"labels file {str(path)!r} needs a header with txn_id and label columns (got "
                             f"{reader.fieldnames})")
        out = {}
        for n, row in enumerate(reader, 2):
            if row["label"] not in ("0", "1"):
                raise ValueError(f"labels file {str(path)!r} line {n}: label must be 0 or 1 (got {row['label']!r})")
            out[row["txn_id"]] = int(row["label"])
    if not out:
        raise ValueError(f"labels file {str(path)!r} holds no labels")
    return out


class TypedGraph:
    """A typed graph in memory, as a stream of typed events leaves it: features by node, edges by relation."""

    def __init__(self, schema: GraphSchema):
        self.schema = schema
        self.rows: dict[str, dict[str, int]] = {t: {} for t in schema.type_names}  # id -> row, by type
        self.features: dict[str, dict[str, tuple[float, ...]]] = {t: {} for t in schema.type_names}
        self.edges: dict[EdgeType, set[tuple[str, str]]] = {r.edge_type: set() for r in schema.relations}

    def node(self, node_type: str, node_id: str) -> None:
        """Hold node ``(type, id)``: a row, featureless until its features are upserted."""
        rows = self.rows[node_type]
        if node_id not in rows:
            rows[node_id] = len(rows)

    def apply(self, ev: Event) -> None:
        if isinstance(ev, EdgeUpsert):
            self.node(ev.src_type, ev.src)
            self.node(ev.dst_type, ev.dst)
            self.edges[(ev.src_type, ev.rel, ev.dst_type)].add((ev.src, ev.dst))
        elif isinstance(ev, EdgeDelete):
            self.edges[(ev.src_type, ev.rel, ev.dst_type)].discard((ev.src, ev.dst))
        elif isinstance(ev, NodeUpsert):
            self.node(ev.type, ev.id)
            self.features[ev.type][ev.id] = ev.features
        elif isinstance(ev, NodeDelete):
            self.features[ev.type].pop(ev.id, None)
            for (s, _, t), pairs in self.edges.items():
                if ev.type in (s, t):
                    pairs -= {(u, v) for u, v in pairs
                              if (s == ev.type and u == ev.id) or (t == ev.type and v == ev.id)}

    def x(self) -> dict[str, torch.Tensor]:
        """Every node's features by type (zeros for a node without any), rows as :attr:`rows` numbers them."""
        out = {}
        for t, width in self.schema.node_types:
            x = np.zeros((len(self.rows[t]), width), dtype=np.float32)
            rows = self.rows[t]
            for node_id, feats in self.features[t].items():
                x[rows[node_id]] = feats
            out[t] = torch.from_numpy(x)
        return out

    def neighbourhoods(self) -> dict[EdgeType, dict[str, set[str]]]:
        """``N_ρ(v)`` of every edge type ``ρ`` as ``ToUndirected()`` makes them (docs/design.md)."""
        out: dict[EdgeType, dict[str, set[str]]] = {e: {} for e in self.schema.edge_types()}
        for (s, r, t), pairs in self.edges.items():
            forward = out[(s, r, t)]
            for u, v in pairs:
                if s == t:
                    if u != v:
                        forward.setdefault(v, set()).add(u)
                        forward.setdefault(u, set()).add(v)
                else:
                    forward.setdefault(v, set()).add(u)
                    out[(t, "rev_" + r, s)].setdefault(u, set()).add(v)
        return out

    def samples(self, seed: int, fanouts: Sequence[int]) -> list[dict[EdgeType, torch.Tensor]]:
        """The sampled edge lists of each layer by edge type (row 0 the neighbour's row, row 1 the target's):
        ``S_{k,ρ}(v)``, the ``k`` members of ``N_ρ(v)`` with the smallest ``(r_ρ(v, u), key(u))``."""
        layers: list[dict[EdgeType, torch.Tensor]] = [{} for _ in fanouts]
        key = GraphSchema.key
        for e, nbrs in self.neighbourhoods().items():
            s, _, t = e
            rank = seeded_rank_bytes(seed, edge_type_name(e))
            src_rows, dst_rows = self.rows[s], self.rows[t]
            ranked = {v: [u for _, _, u in sorted((rank(key(t, v), key(s, u)), key(s, u), u) for u in members)]
                      for v, members in nbrs.items()}
            for layer, k in zip(layers, fanouts):
                pairs = [(src_rows[u], dst_rows[v]) for v, members in ranked.items() for u in members[:k]]
                layer[e] = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2).t().contiguous()
        return layers


def precision_at_rate(labels: np.ndarray, scores: np.ndarray, rate: float) -> float:
    """The share of positives among the ``rate`` highest scores (at least one)."""
    top = max(1, int(round(len(scores) * rate)))
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="mergesort")[:top]
    return float(np.asarray(labels)[order].mean())


def _transaction_rows(graph: TypedGraph, txns: Sequence[EdgeUpsert]) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    src_rows = graph.rows[txns[0].src_type] if txns else {}
    dst_rows = graph.rows[txns[0].dst_type] if txns else {}
    x_e = torch.tensor([ev.features for ev in txns], dtype=torch.float32).reshape(len(txns), -1)
    return (np.array([src_rows[ev.src] for ev in txns], dtype=np.int64),
            np.array([dst_rows[ev.dst] for ev in txns], dtype=np.int64), x_e)


def _one_thread(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` on one torch thread: weights that do not depend on how threads split a sum (300 epochs make
    much of a last-bit difference), and no slower on a graph of this size."""
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
    return wrapped


@_one_thread
def train_typed_model(events: str | os.PathLike[str], labels: str | os.PathLike[str] | Mapping[str, int],
                      schema: Mapping[str, Any], out: str | os.PathLike[str], *, hidden: int = 64,
                      out_dim: int = 32, fanouts: Sequence[int] = (25, 10), seed: int = 0, epochs: int = 300,
                      lr: float = 0.01, train_fraction: float = 0.7, slices: int = 8, alert_rate: float = 0.01,
                      name: str = "model", version: int = 1, overwrite: bool = False) -> dict[str, Any]:
    """Train a typed GraphSAGE and a logistic transaction head; save them with their held-out metrics.

    Args:
        events: a typed event file.
        labels: a transaction labels file (:func:`read_transaction_labels`) or ``{txn_id: label}``.
        schema: the graph schema (``schema.json`` object); it must name a ``scored`` relation.
        out: the model directory to write.
        hidden, out_dim, fanouts, seed, name, version: the model (``seed`` also seeds the initial weights).
        epochs, lr: full-batch Adam steps and their learning rate.
        train_fraction: the share of the scored transactions that is the training window, in (0, 1).
        slices: how many parts the held-out window is cut into (each scored with the graph at its start).
        alert_rate: the share of held-out transactions alerted on, for ``held_out_precision``.
        overwrite: replace a non-empty ``out``.

    Returns:
        The summary written to ``train.json``.
    """
    version_topic(f"{name}:{version}")
    if epochs < 1 or slices < 1:
        raise ValueError(f"epochs and slices must be at least 1 (got {epochs} and {slices})")
    if not 0 < train_fraction < 1 or not 0 < alert_rate < 1:
        raise ValueError(f"train_fraction and alert_rate must be in (0, 1) (got {train_fraction} and {alert_rate})")
    graph_schema = GraphSchema.from_dict(schema)
    scored = graph_schema.scored
    if scored is None:
        raise ValueError("the schema names no scored relation; add \"scored\": {src_type, rel, dst_type}")
    out = Path(out)
    if not overwrite and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelDirExists(f"{out} already exists and is not empty; choose another output directory, or pass "
                             f"--force (overwrite=True) to replace the model in it")
    evs, invalid = read_typed_events(events, graph_schema)
    if not isinstance(labels, Mapping):
        labels = read_transaction_labels(labels)
    txn_at = [i for i, ev in enumerate(evs) if isinstance(ev, EdgeUpsert) and ev.txn_id in labels
              and (ev.src_type, ev.rel, ev.dst_type) == scored.edge_type]
    if len(txn_at) < 2:
        raise ValueError(f"{len(txn_at)} labelled transactions of {scored.name} in the events; training needs more")
    cut = txn_at[int(len(txn_at) * train_fraction)]
    train_at = [i for i in txn_at if i < cut]
    held_at = [i for i in txn_at if i >= cut]
    y = torch.tensor([labels[evs[i].txn_id] for i in train_at], dtype=torch.float32)
    if not 0 < float(y.sum()) < len(y):
        raise ValueError(f"the training window labels {len(y)} transactions but not both classes; use a larger "
                         f"--train-fraction")

    config = ModelConfig(arch="sage", in_dim=0, hidden_dim=hidden, out_dim=out_dim, num_layers=len(fanouts),
                         fanouts=tuple(fanouts), seed=seed, name=name, version=version, schema=graph_schema.to_dict())
    torch.manual_seed(seed)
    gnn = HeteroSAGE(graph_schema, hidden, out_dim, len(fanouts))
    head = torch.nn.Linear(2 * out_dim + scored.edge_features, 1)
    graph = TypedGraph(graph_schema)
    for ev in evs[:cut]:
        graph.apply(ev)
    x, edges = graph.x(), graph.samples(seed, fanouts)
    train_nodes = {t: len(rows) for t, rows in graph.rows.items()}
    src, dst, x_e = _transaction_rows(graph, [evs[i] for i in train_at])

    def logits(h: dict[str, torch.Tensor], src: np.ndarray, dst: np.ndarray, x_e: torch.Tensor) -> torch.Tensor:
        return head(torch.cat([h[scored.src][src], h[scored.dst][dst], x_e], dim=1)).squeeze(-1)

    loss = fit(gnn, head, lambda: logits(gnn(x, edges), src, dst, x_e), y, epochs=epochs, lr=lr)
    with torch.no_grad():
        train_scores = torch.sigmoid(logits(gnn(x, edges), src, dst, x_e)).numpy()
        held_scores = []
        bounds = np.linspace(0, len(held_at), slices + 1).astype(int)
        done = cut
        for a, b in zip(bounds[:-1], bounds[1:]):
            if a == b:
                continue
            start = held_at[a]
            for ev in evs[done:start]:
                graph.apply(ev)
            done = start
            txns = [evs[i] for i in held_at[a:b]]
            for ev in txns:  # ends first named by their own transaction
                graph.node(ev.src_type, ev.src)
                graph.node(ev.dst_type, ev.dst)
            h = gnn(graph.x(), graph.samples(seed, fanouts))
            held_scores.append(torch.sigmoid(logits(h, *_transaction_rows(graph, txns))).numpy())
    held_y = np.array([labels[evs[i].txn_id] for i in held_at], dtype=np.int64)
    held_p = np.concatenate(held_scores) if held_scores else np.zeros(0)
    both = 0 < held_y.sum() < len(held_y)
    save_model_dir(out, config, gnn.state_dict())
    TransactionHead(scored.name, tuple(head.weight[0].detach().tolist()), head.bias[0].item(),
                    config.model_id).save(out)
    summary = {
        "model": config.model_id, "events": len(evs), "invalid_lines": invalid, "scored_relation": scored.name,
        "train_events": cut, "train_transactions": len(train_at), "train_positive": int(y.sum()),
        "train_until_ts": evs[cut - 1].ts if cut else None,
        "train_nodes": train_nodes,
        "train_auc": round(roc_auc(y.numpy(), train_scores), 4), "final_loss": round(loss, 4),
        "held_out": len(held_at), "held_out_positive": int(held_y.sum()), "held_out_slices": slices,
        "held_out_auc": round(roc_auc(held_y, held_p), 4) if both else None,
        "alert_rate": alert_rate,
        "held_out_precision": round(precision_at_rate(held_y, held_p, alert_rate), 4) if len(held_p) else None,
        "epochs": epochs,
    }
    (out / TRAIN_FILE).write_text(json.dumps(summary, indent=2))
    logger.info("trained %s: %s", config.model_id, summary)
    return summary
