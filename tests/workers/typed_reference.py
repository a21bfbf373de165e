"""An independent from-scratch reference for typed graphs (docs/design.md, Typed graphs and transaction scores).

Nothing here uses gnnstream: a typed event file is folded into PyTorch
Geometric's ``HeteroData`` with plain dicts, ``ToUndirected()`` builds the
neighbourhoods, the bottom-k samples per edge type are drawn with an inline
copy of the rank formula (relation in the message, nodes keyed ``type/id``),
and PyG's ``HeteroConv`` of a ``SAGEConv`` per edge type (``aggr="sum"``, what
``to_hetero`` builds from a GraphSAGE), one per layer with ReLU between, computes
the embeddings from a model directory's ``weights.pt``.
"""

from __future__ import annotations

import json
from hashlib import blake2b
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch_geometric.data import HeteroData
from torch_geometric.nn import HeteroConv, SAGEConv
from torch_geometric.transforms import ToUndirected

__all__ = ["rank", "hetero_data", "sampled", "hetero_forward", "typed_embeddings"]


def rank(seed: int, edge_type: tuple[str, str, str], v_key: str, u_key: str) -> int:
    message = f"{seed}:{'__'.join(edge_type)}:{v_key}:{u_key}"
    return int.from_bytes(blake2b(message.encode(), digest_size=8).digest(), "big")


def hetero_data(events: Iterable[Mapping[str, Any]], schema: Mapping[str, Any],
                edge_ttl: float = 0, counts: dict[str, int] | None = None) -> tuple[HeteroData, dict, dict]:
    """The graph the events leave, as ``HeteroData`` after ``ToUndirected()``, each type's id -> row (every node
    ever named) and each type's nodes that exist at the end (named since their last ``node_delete``).

    With ``edge_ttl`` the event-time rules hold per typed edge ``u -r-> v``: ``T`` the largest ``ts`` seen, the
    edge present while ``t(e) > T - ttl`` (``t(e)`` the largest ``ts`` of its upserts since it was last created),
    and an upsert with ``ts <= T - ttl`` on arrival late (it names its ends and adds nothing); ``counts`` gets
    the number of late upserts (``"late"``) and of edges that fell out of the window (``"expired"``)."""
    counts = {} if counts is None else counts
    counts.update(late=0, expired=0)
    rows: dict[str, dict[str, int]] = {t: {} for t in schema["node_types"]}
    alive: dict[str, set[str]] = {t: set() for t in schema["node_types"]}
    feats: dict[str, dict[str, list[float]]] = {t: {} for t in schema["node_types"]}
    edges: dict[tuple[str, str, str], dict[tuple[str, str], float]] = {
        (r["src_type"], r["rel"], r["dst_type"]): {} for r in schema["relations"]}  # edge -> t(e)
    now: float | None = None

    def name(t: str, node: str) -> None:
        rows[t].setdefault(node, len(rows[t]))
        alive[t].add(node)

    for ev in events:
        ts = ev.get("ts", 0)
        if ev["op"] == "node_upsert":
            name(ev["type"], ev["id"])
            feats[ev["type"]][ev["id"]] = ev["features"]
        elif ev["op"] == "node_delete":
            t, node = ev["type"], ev["id"]
            alive[t].discard(node)
            feats[t].pop(node, None)
            for (s, _, d), pairs in edges.items():
                for a, b in [e for e in pairs if (s == t and e[0] == node) or (d == t and e[1] == node)]:
                    del pairs[a, b]
        elif ev["op"] == "edge_upsert":
            name(ev["src_type"], ev["src"])
            name(ev["dst_type"], ev["dst"])
            if edge_ttl and now is not None and ts <= now - edge_ttl:
                counts["late"] += 1
            else:
                pairs = edges[(ev["src_type"], ev["rel"], ev["dst_type"])]
                pairs[ev["src"], ev["dst"]] = max(ts, pairs.get((ev["src"], ev["dst"]), ts))
        elif ev["op"] == "edge_delete":
            edges[(ev["src_type"], ev["rel"], ev["dst_type"])].pop((ev["src"], ev["dst"]), None)
        now = ts if now is None else max(now, ts)
        if edge_ttl:
            for pairs in edges.values():
                for e in [e for e, t_e in pairs.items() if t_e <= now - edge_ttl]:
                    del pairs[e]
                    counts["expired"] += 1
    data = HeteroData()
    for t, width in schema["node_types"].items():
        x = torch.zeros(len(rows[t]), width)
        for node, f in feats[t].items():
            x[rows[t][node]] = torch.tensor(f)
        data[t].x = x
    for (s, r, t), pairs in edges.items():
        data[s, r, t].edge_index = torch.tensor([[rows[s][u], rows[t][v]] for u, v in sorted(pairs)],
                                                dtype=torch.long).reshape(-1, 2).t()
    return ToUndirected()(data), rows, alive


def sampled(data: HeteroData, rows: Mapping[str, Mapping[str, int]], seed: int, k: int) -> dict:
    """``S_{k,ρ}(v)`` of every node and edge type: the ``k`` members of ``N_ρ(v)`` with the smallest
    ``(r_ρ(v, u), key(u))``, as edge lists (row 0 the neighbour, row 1 the target)."""
    names = {t: {row: node for node, row in ids.items()} for t, ids in rows.items()}
    out = {}
    for edge_type in data.edge_types:
        s, _, t = edge_type
        src, dst = data[edge_type].edge_index.tolist()
        nbrs: dict[int, set[int]] = {}
        for u, v in zip(src, dst):
            if not (s == t and u == v):
                nbrs.setdefault(v, set()).add(u)
        cols = []
        for v, members in sorted(nbrs.items()):
            v_key = f"{t}/{names[t][v]}"
            ranked = sorted((rank(seed, edge_type, v_key, f"{s}/{names[s][u]}"), f"{s}/{names[s][u]}", u)
                            for u in members)
            cols += [(u, v) for _, _, u in ranked[:k]]
        out[edge_type] = torch.tensor(cols, dtype=torch.long).reshape(-1, 2).t()
    return out


def hetero_forward(model_dir: str | Path, data: HeteroData, edge_lists: list[Mapping]) -> dict[str, torch.Tensor]:
    """The embeddings of the directory's typed GraphSAGE (weights keyed as ``to_hetero`` keys them) on one sampled
    edge-list mapping per layer: a ``HeteroConv`` of ``SAGEConv((-1, -1), …)`` per layer, ReLU between."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    weights = torch.load(Path(model_dir) / "weights.pt", weights_only=True)
    layers = config["num_layers"]
    assert len(edge_lists) == layers
    x = dict(data.x_dict)
    with torch.no_grad():
        for l, edges in enumerate(edge_lists):
            width = config["out_dim"] if l == layers - 1 else config["hidden_dim"]
            conv = HeteroConv({e: SAGEConv((-1, -1), width) for e in data.edge_types}, aggr="sum")
            conv(x, dict(edges))  # the lazy layers take their shapes
            for e in data.edge_types:
                name = "__".join(e)
                sage = conv.convs[e]
                sage.lin_l.weight.copy_(weights[f"convs.{l}.{name}.lin_l.weight"])
                sage.lin_l.bias.copy_(weights[f"convs.{l}.{name}.lin_l.bias"])
                sage.lin_r.weight.copy_(weights[f"convs.{l}.{name}.lin_r.weight"])
            out = conv(x, dict(edges))
            x = {t: (h.relu() if l < layers - 1 else h) for t, h in out.items()}
    return x


def typed_embeddings(events: Iterable[Mapping[str, Any]], schema: Mapping[str, Any],
                     model_dir: str | Path, edge_ttl: float = 0,
                     counts: dict[str, int] | None = None) -> dict[str, Any]:
    """``{"type/id": embedding}`` of every node the events leave, from scratch (the model's seed and fanouts;
    ``edge_ttl`` and ``counts`` as :func:`hetero_data`'s)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    data, rows, alive = hetero_data(events, schema, edge_ttl, counts)
    h = hetero_forward(model_dir, data, [sampled(data, rows, config["seed"], k) for k in config["fanouts"]])
    return {f"{t}/{node}": h[t][row].numpy() for t, ids in rows.items() for node, row in ids.items()
            if node in alive[t]}
