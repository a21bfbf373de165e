"""A ``to_hetero`` GraphSAGE trained in PyG on the seeded payment stream, saved as a state dict, imported with
``gnnstream model import --schema`` and served by ``gnnstream apply`` over the same stream: the stored
embeddings equal the trained module's own forward pass on the sampled edge lists."""

from __future__ import annotations

import json

import torch

from gnnstream.fraud.payments import SCHEMA, generate
from gnnstream.model.schema import GraphSchema
from tests.workers.reference import assert_embeddings_close, call_gnnstream
from tests.workers.typed_reference import hetero_data, sampled

SEED, FANOUT = 3, 4


def test_a_trained_to_hetero_model_serves_its_own_forward_pass(tmp_path):
    from torch_geometric.nn import GraphSAGE, to_hetero

    stream = generate(SEED, accounts=60, merchants=20, days=4, rings=2, bursts=1, chains=2)
    data, rows, alive = hetero_data(stream.events, SCHEMA)
    edges = sampled(data, rows, SEED, FANOUT)  # what the worker samples, the same for both layers
    payments = [ev for ev in stream.events if ev.get("txn_id")]
    src = torch.tensor([rows["account"][ev["src"]] for ev in payments])
    dst = torch.tensor([rows["merchant"][ev["dst"]] for ev in payments])
    x_e = torch.tensor([ev["features"] for ev in payments])
    y = torch.tensor([float(stream.labels[ev["txn_id"]][0]) for ev in payments])
    assert 0 < y.sum() < len(y)

    torch.manual_seed(SEED)
    module = to_hetero(GraphSAGE((-1, -1), 16, 2, out_channels=8), GraphSchema.from_dict(SCHEMA).metadata(),
                       aggr="sum")
    with torch.no_grad():
        module(data.x_dict, edges)  # the lazy layers take their shapes
    head = torch.nn.Linear(2 * 8 + 4, 1)
    optimiser = torch.optim.Adam([*module.parameters(), *head.parameters()], lr=0.02)
    losses = []
    for _ in range(40):  # the payments' fraud labels, through the embeddings of their two ends
        optimiser.zero_grad()
        h = module(data.x_dict, edges)
        logits = head(torch.cat([h["account"][src], h["merchant"][dst], x_e], dim=1)).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y)
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses  # the weights were trained, not left as initialised
    module.eval()
    with torch.no_grad():
        want = module(data.x_dict, edges)

    torch.save(module.state_dict(), tmp_path / "trained.pt")
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    imported = call_gnnstream("model", "import", tmp_path / "trained.pt", tmp_path / "model", "--arch", "sage",
                              "--fanouts", f"{FANOUT},{FANOUT}", "--seed", str(SEED),
                              "--schema", tmp_path / "schema.json")
    assert imported.returncode == 0, imported.stderr
    with open(tmp_path / "events.jsonl", "w") as fh:
        fh.writelines(json.dumps(ev) + "\n" for ev in stream.events)
    applied = call_gnnstream("apply", "--state", tmp_path / "state", "--model", tmp_path / "model", "--batch", "97",
                             tmp_path / "events.jsonl")
    assert applied.returncode == 0, applied.stderr
    done = call_gnnstream("embeddings", "--state", tmp_path / "state", "--out", "-")
    assert done.returncode == 0, done.stderr
    served = {row["id"]: row["embedding"] for row in map(json.loads, done.stdout.splitlines())}
    expected = {f"{t}/{node}": want[t][row].numpy() for t, ids in rows.items() for node, row in ids.items()
                if node in alive[t]}
    assert len(expected) == sum(len(ids) for ids in rows.values()) > 150
    assert_embeddings_close(served, expected, what="a trained to_hetero model served by apply")
    assert max(float(h.abs().max()) for h in want.values()) > 0.1  # not a degenerate all-zero model
