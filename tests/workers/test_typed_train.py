"""``gnnstream train --schema``: a typed model and a transaction head trained on a generated payment stream;
its sampler and layers against the independent typed reference (PyG HeteroData, ToUndirected, to_hetero)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gnnstream.fraud.payments import generate, write_stream
from gnnstream.model import load_model_dir
from gnnstream.model.head import HEAD_FILE
from gnnstream.model.schema import GraphSchema
from gnnstream.workers.cli import main
from gnnstream.workers.offline.typed_train import TypedGraph, read_typed_events
from tests.workers.typed_reference import hetero_data, hetero_forward, sampled


@pytest.fixture(scope="module")
def payments(tmp_path_factory):
    out = tmp_path_factory.mktemp("payments")
    stream = generate(3, accounts=300, merchants=30, days=8, rings=4, bursts=2, chains=4)
    paths = write_stream(stream, out)
    model = out / "model"
    assert main(["train", "--events", paths["events.jsonl"], "--labels", paths["labels.csv"], "--schema",
                 paths["schema.json"], "--out", str(model), "--epochs", "80", "--fanouts", "4,3", "--hidden", "16",
                 "--out-dim", "8", "--seed", "5", "--slices", "3"]) == 0
    return stream, paths, model


def test_a_typed_model_is_trained_and_scored_on_held_out_transactions(payments):
    stream, paths, model = payments
    summary = json.loads((model / "train.json").read_text())
    payments_labelled = len(stream.labels)
    assert summary["train_transactions"] + summary["held_out"] == payments_labelled
    assert summary["held_out_positive"] == sum(
        label for txn, (label, _) in stream.labels.items()) - summary["train_positive"]
    assert summary["held_out_positive"] > 0 and summary["held_out_auc"] is not None
    assert summary["held_out_auc"] > 0.7, summary  # the planted patterns are learnable from the graph
    head = json.loads((model / HEAD_FILE).read_text())
    assert head["relation"] == "account__pays__merchant" and len(head["weights"]) == 2 * 8 + 4
    loaded = load_model_dir(model)
    assert loaded.config.graph_schema == GraphSchema.from_dict(json.loads(open(paths["schema.json"]).read()))


def test_the_trainers_samples_and_layers_equal_the_typed_reference(payments):
    _, paths, model = payments
    schema_dict = json.loads(open(paths["schema.json"]).read())
    schema = GraphSchema.from_dict(schema_dict)
    events = [json.loads(line) for line in open(paths["events.jsonl"])]
    data, rows, _ = hetero_data(events, schema_dict)
    want = hetero_forward(model, data, [sampled(data, rows, 5, 3)] * 2)
    graph = TypedGraph(schema)
    for ev in read_typed_events(paths["events.jsonl"], schema)[0]:
        graph.apply(ev)
    ours = graph.samples(5, [3, 3])
    ref = sampled(data, rows, 5, 3)
    order = {t: np.array([graph.rows[t][node] for node in sorted(rows[t], key=rows[t].get)]) for t in rows}
    for e, pairs in ref.items():  # the same sampled pairs, by node id
        s, _, t = e
        mine = {(int(order[s].tolist().index(u)), int(order[t].tolist().index(v))) for u, v in ours[0][e].t().tolist()}
        assert mine == {tuple(p) for p in pairs.t().tolist()}, e
    with torch.no_grad():
        got = load_model_dir(model).model(graph.x(), ours)
    for t, h in want.items():
        assert torch.allclose(got[t][torch.from_numpy(order[t])], h, atol=1e-4), t


def test_typed_training_refuses_untyped_options(payments, capsys):
    _, paths, model = payments
    capsys.readouterr()
    assert main(["train", "--events", paths["events.jsonl"], "--labels", paths["labels.csv"], "--schema",
                 paths["schema.json"], "--out", str(model.parent / "gcn"), "--arch", "gcn"]) == 2
    assert capsys.readouterr().err.strip() == ("gnnstream: error: --arch gcn does not apply to a typed model "
                                               "(--schema): it is a GraphSAGE with the plain cold-start policy, "
                                               "without an edge window")
