"""Typed streams and models for the typed graph tests: random typed events of a small account / merchant /
device schema, and a typed GraphSAGE with random weights as PyG's to_hetero builds it, imported."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from gnnstream.model.pyg import import_state_dict
from gnnstream.model.schema import GraphSchema
from tests.workers.typed_reference import hetero_data

SCHEMA = {
    "node_types": {"account": 5, "merchant": 3, "device": 2},
    "relations": [
        {"src_type": "account", "rel": "pays", "dst_type": "merchant", "edge_features": 2},
        {"src_type": "account", "rel": "uses", "dst_type": "device"},
        {"src_type": "account", "rel": "sends", "dst_type": "account"},
    ],
    "scored": {"src_type": "account", "rel": "pays", "dst_type": "merchant"},
}
COUNTS = {"account": 30, "merchant": 8, "device": 10}


def typed_stream(seed: int, n: int = 600, node_deletes: bool = True) -> list[dict]:
    """Random typed events: features, upserts of every relation (self-loops and repeats too), edge deletes of
    present and absent edges, node deletes (unless ``node_deletes`` is false: then the graph Kafka's
    partitions leave does not depend on their interleaving), and nodes named only by an edge (no features)."""
    rng = random.Random(seed)
    relations = SCHEMA["relations"]
    present: list[dict] = []
    out = []
    for i in range(n):
        ts = 1_000 + i
        roll = rng.random()
        if roll < 0.15:
            t = rng.choice(list(SCHEMA["node_types"]))
            out.append({"op": "node_upsert", "type": t, "id": f"{t[0]}{rng.randrange(COUNTS[t])}", "ts": ts,
                        "features": [round(rng.uniform(-1, 1), 3) for _ in range(SCHEMA["node_types"][t])]})
        elif roll < 0.8 or not present:
            r = rng.choice(relations)
            s, t = r["src_type"], r["dst_type"]
            ev = {"op": "edge_upsert", "src_type": s, "src": f"{s[0]}{rng.randrange(COUNTS[s])}", "rel": r["rel"],
                  "dst_type": t, "dst": f"{t[0]}{rng.randrange(COUNTS[t])}", "ts": ts}
            if r.get("edge_features"):
                ev["features"] = [round(rng.uniform(0, 5), 2) for _ in range(r["edge_features"])]
            if r["rel"] == "pays":
                ev["txn_id"] = f"t{i}"
            out.append(ev)
            present.append(ev)
        elif roll < 0.95:
            ev = rng.choice(present) if rng.random() < 0.8 else {**rng.choice(present), "dst": "m999"}
            out.append({k: ev[k] for k in ("src_type", "src", "rel", "dst_type", "dst")} | {"op": "edge_delete",
                                                                                           "ts": ts})
        elif node_deletes:
            t = rng.choice(list(SCHEMA["node_types"]))
            out.append({"op": "node_delete", "type": t, "id": f"{t[0]}{rng.randrange(COUNTS[t])}", "ts": ts})
    return out


def typed_model(path: Path, seed: int, fanouts: list[int], version: int = 1, weights_seed: int | None = None) -> Path:
    """A typed GraphSAGE with random weights (drawn with ``weights_seed``, default ``seed``), as PyG's to_hetero
    builds it, imported as version ``version`` sampling with ``seed``."""
    from torch_geometric.nn import GraphSAGE, to_hetero

    data, _, _ = hetero_data(typed_stream(seed, 200), SCHEMA)
    torch.manual_seed(seed if weights_seed is None else weights_seed)
    module = to_hetero(GraphSAGE((-1, -1), 6, len(fanouts), out_channels=4), GraphSchema.from_dict(SCHEMA).metadata(),
                       aggr="sum").eval()
    with torch.no_grad():
        module(data.x_dict, data.edge_index_dict)
    import_state_dict(module.state_dict(), path, arch="sage", fanouts=fanouts, seed=seed, schema=SCHEMA,
                      version=version)
    return path


def write(path: Path, events: list[dict]) -> Path:
    path.write_text("".join(json.dumps(ev) + "\n" for ev in events))
    return path


def typed_messages(events: list[dict]) -> list[tuple[bytes, bytes]]:
    """Kafka messages of typed events, keyed by ``src`` / ``id`` as producers key them."""
    return [(str(ev.get("src", ev.get("id"))).encode(), json.dumps(ev).encode()) for ev in events]
