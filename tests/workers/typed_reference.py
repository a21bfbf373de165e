"""An independent from-scratch reference for typed graphs (docs/design.md, Typed graphs and transaction scores).

Nothing here uses gnnstream: a typed event file is folded into PyTorch
Geometric's ``HeteroData`` with plain dicts, ``ToUndirected()`` builds the
neighbourhoods, the bottom-k samples per edge type are drawn with an inline
copy of the rank formula (relation in the message, nodes keyed ``type/id``),
and a ``to_hetero(GraphSAGE((-1, -1), …), metadata, aggr="sum")`` computes the
embeddings from a model directory's ``weights.pt``.
"""

from __future__ import annotations

import json
from hashlib import blake2b
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch_geometric.data import HeteroData
from torch_geometric.nn import GraphSAGE, to_hetero
from torch_geometric.transforms import ToUndirected

__all__ = ["rank", "hetero_data", "sampled", "hetero_forward"]


def rank(seed: int, edge_type: tuple[str, str, str], v_key: str, u_key: str) -> int:
    message = f"{seed}:{'__'.join(edge_type)}:{v_key}:{u_key}"
    return int.from_bytes(blake2b(message.encode(), digest_size=8).digest(), "big")


def hetero_data(events: Iterable[Mapping[str, Any]], schema: Mapping[str, Any]) -> tuple[HeteroData, dict]:
    """The graph the events leave, as ``HeteroData`` after ``ToUndirected()``, and each type's id -> row."""
    rows: dict[str, dict[str, int]] = {t: {} for t in schema["node_types"]}
    feats: dict[str, dict[str, list[float]]] = {t: {} for t in schema["node_types"]}
    edges: dict[tuple[str, str, str], set[tuple[str, str]]] = {
        (r["src_type"], r["rel"], r["dst_type"]): set() for r in schema["relations"]}
    for ev in events:
        if ev["op"] == "node_upsert":
            rows[ev["type"]].setdefault(ev["id"], len(rows[ev["type"]]))
            feats[ev["type"]][ev["id"]] = ev["features"]
        elif ev["op"] == "edge_upsert":
            rows[ev["src_type"]].setdefault(ev["src"], len(rows[ev["src_type"]]))
            rows[ev["dst_type"]].setdefault(ev["dst"], len(rows[ev["dst_type"]]))
            edges[(ev["src_type"], ev["rel"], ev["dst_type"])].add((ev["src"], ev["dst"]))
        elif ev["op"] == "edge_delete":
            edges[(ev["src_type"], ev["rel"], ev["dst_type"])].discard((ev["src"], ev["dst"]))
    data = HeteroData()
    for t, width in schema["node_types"].items():
        x = torch.zeros(len(rows[t]), width)
        for node, f in feats[t].items():
            x[rows[t][node]] = torch.tensor(f)
        data[t].x = x
    for (s, r, t), pairs in edges.items():
        data[s, r, t].edge_index = torch.tensor([[rows[s][u], rows[t][v]] for u, v in sorted(pairs)],
                                                dtype=torch.long).reshape(-1, 2).t()
    return ToUndirected()(data), rows


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


def hetero_forward(model_dir: str | Path, data: HeteroData, edge_index: Mapping) -> dict[str, torch.Tensor]:
    """The embeddings of PyG's ``to_hetero`` GraphSAGE with the directory's weights on one edge list."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    module = to_hetero(GraphSAGE((-1, -1), config["hidden_dim"], config["num_layers"],
                                 out_channels=config["out_dim"]), data.metadata(), aggr="sum")
    with torch.no_grad():
        module(data.x_dict, edge_index)  # the lazy layers take their shapes
        module.load_state_dict(torch.load(Path(model_dir) / "weights.pt", weights_only=True))
        return module.eval()(data.x_dict, edge_index)
