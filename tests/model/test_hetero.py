"""Typed models: the schema, a ``to_hetero`` GraphSAGE imported from PyG and run on per-relation samples equal
to the PyG module's own forward pass, and the per-relation rank against one written from docs/design.md."""

from __future__ import annotations

import json
import random

import pytest
import torch

from gnnstream.graph_state.sampler import sample_neighbors
from gnnstream.model import InvalidModelConfig, load_model_dir
from gnnstream.model.pyg import UnsupportedModel, import_checkpoint
from gnnstream.model.schema import GraphSchema
from gnnstream.workers.cli import main
from tests.workers.typed_reference import hetero_data, rank, sampled

SCHEMA = {
    "node_types": {"account": 6, "merchant": 5, "device": 3},
    "relations": [
        {"src_type": "account", "rel": "pays", "dst_type": "merchant", "edge_features": 4},
        {"src_type": "account", "rel": "uses", "dst_type": "device"},
        {"src_type": "account", "rel": "sends", "dst_type": "account", "edge_features": 1},
    ],
    "scored": {"src_type": "account", "rel": "pays", "dst_type": "merchant"},
}
COUNTS = {"account": 40, "merchant": 9, "device": 12}


def _typed_graph(seed: int):
    """A random typed graph as PyG's HeteroData after ToUndirected, and each type's id -> row."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    events = []
    for t, width in SCHEMA["node_types"].items():
        for i in range(COUNTS[t]):
            events.append({"op": "node_upsert", "type": t, "id": f"{t[0]}{i}",
                           "features": torch.randn(width, generator=gen).tolist()})
    for r in SCHEMA["relations"]:
        s, t = r["src_type"], r["dst_type"]
        for _ in range(90):
            events.append({"op": "edge_upsert", "src_type": s, "src": f"{s[0]}{rng.randrange(COUNTS[s])}",
                           "rel": r["rel"], "dst_type": t, "dst": f"{t[0]}{rng.randrange(COUNTS[t])}"})
    data, rows, _ = hetero_data(events, SCHEMA)
    return data, rows


def test_schema_flows_as_to_undirected_builds_it():
    schema = GraphSchema.from_dict(SCHEMA)
    data, _ = _typed_graph(0)
    node_types, edge_types = schema.metadata()
    assert sorted(node_types) == sorted(data.node_types) and edge_types == list(data.edge_types)
    assert schema.inbound("account") == [("account", "sends", "account"), ("merchant", "rev_pays", "account"),
                                         ("device", "rev_uses", "account")]
    assert GraphSchema.from_dict(schema.to_dict()) == schema
    assert schema.scored is not None and schema.scored.edge_features == 4


@pytest.mark.parametrize("change, message", [
    ({"node_types": {}}, "node_types must be a non-empty object"),
    ({"node_types": {"account": 6, "merchant": 5, "device": 3, "card": 2}}, "['card'] are in no relation"),
    ({"relations": [{"src_type": "account", "rel": "pays", "dst_type": "shop"}]}, "node type 'shop'"),
    ({"relations": [{"src_type": "account", "rel": "rev_pays", "dst_type": "merchant"}]}, "starts with rev_"),
    ({"relations": [{"src_type": "account", "rel": "pays", "dst_type": "merchant"},
                    {"src_type": "merchant", "rel": "rev_x", "dst_type": "account"}]}, "starts with rev_"),
    ({"scored": {"src_type": "account", "rel": "uses", "dst_type": "merchant"}}, "is not declared"),
    ({"node_types": {"account": 0, "merchant": 5, "device": 3}}, "feature width of 'account'"),
    ({"relations": [{"src_type": "account", "rel": "pa__ys", "dst_type": "merchant"}]}, "single underscores"),
])
def test_schema_refuses_what_it_cannot_serve(change, message):
    with pytest.raises(InvalidModelConfig, match=message.replace("[", r"\[").replace("]", r"\]")):
        GraphSchema.from_dict({**SCHEMA, **change})


def test_relation_rank_is_the_written_one():
    rng = random.Random(3)
    edge_type = ("merchant", "rev_pays", "account")
    members = [f"merchant/{rng.randrange(1000)}" for _ in range(50)]
    want = [u for _, u in sorted((rank(11, edge_type, "account/7", u), u) for u in set(members))[:6]]
    assert sample_neighbors(11, "account/7", members, 6, relation="merchant__rev_pays__account") == want
    assert sample_neighbors(11, "account/7", members, 6) != want  # the relation is part of the rank


@pytest.mark.parametrize("seed, layers", [(0, 2), (5, 1), (9, 3)])
def test_an_imported_to_hetero_model_equals_its_pyg_forward(tmp_path, seed, layers):
    from torch_geometric.nn import GraphSAGE, to_hetero

    data, rows = _typed_graph(seed)
    schema = GraphSchema.from_dict(SCHEMA)
    torch.manual_seed(seed)
    module = to_hetero(GraphSAGE((-1, -1), 16, layers, out_channels=8), schema.metadata(), aggr="sum").eval()
    samples = sampled(data, rows, seed, 3)
    with torch.no_grad():
        want = module(data.x_dict, samples)  # initialises the lazy layers too
    torch.save(module.state_dict(), tmp_path / "typed.pt")
    schema_path = tmp_path / "schema.json"
    schema_path.write_text(json.dumps(SCHEMA))
    assert main(["model", "import", str(tmp_path / "typed.pt"), str(tmp_path / "m"), "--arch", "sage",
                 "--fanouts", ",".join(["3"] * layers), "--seed", str(seed), "--schema", str(schema_path)]) == 0
    loaded = load_model_dir(tmp_path / "m")
    assert loaded.config.in_dim == 0 and loaded.config.graph_schema == schema
    assert (loaded.config.hidden_dim, loaded.config.out_dim, loaded.config.num_layers) == (16 if layers > 1 else 8, 8, layers)
    got = loaded.model(data.x_dict, samples)
    assert set(got) == set(want)
    for t in want:
        assert got[t].shape == want[t].shape
        assert torch.allclose(got[t], want[t], atol=1e-4), (t, float((got[t] - want[t]).abs().max()))
    # the layers read their samples: other samples give other embeddings
    other = loaded.model(data.x_dict, sampled(data, rows, seed, 1))
    assert not torch.allclose(other["account"], want["account"], atol=1e-3)


def test_import_refuses_a_state_dict_of_another_schema(tmp_path):
    from torch_geometric.nn import GraphSAGE, to_hetero

    data, _ = _typed_graph(1)
    schema = GraphSchema.from_dict(SCHEMA)
    module = to_hetero(GraphSAGE((-1, -1), 8, 2, out_channels=4), schema.metadata(), aggr="sum").eval()
    with torch.no_grad():
        module(data.x_dict, data.edge_index_dict)
    torch.save(module.state_dict(), tmp_path / "typed.pt")
    narrower = {**SCHEMA, "node_types": {**SCHEMA["node_types"], "merchant": 7}}
    with pytest.raises(UnsupportedModel, match="account__pays__merchant takes 5 root inputs but 'merchant' gives 7"):
        import_checkpoint(tmp_path / "typed.pt", tmp_path / "a", arch="sage", fanouts=[2, 2], schema=narrower)
    fewer = {**SCHEMA, "relations": SCHEMA["relations"][:2]}
    with pytest.raises(UnsupportedModel, match="'account__sends__account' is not one of the schema's"):
        import_checkpoint(tmp_path / "typed.pt", tmp_path / "b", arch="sage", fanouts=[2, 2], schema=fewer)
    with pytest.raises(UnsupportedModel, match="SAGEConv for edge type"):
        import_checkpoint(tmp_path / "typed.pt", tmp_path / "c", arch="sage", fanouts=[2, 2],
                          schema={**SCHEMA, "relations": SCHEMA["relations"] + [
                              {"src_type": "device", "rel": "seen_at", "dst_type": "merchant"}]})
