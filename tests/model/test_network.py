"""Multi-layer models: PyG GraphSAGE / GCN / GAT weights, saved and loaded, give PyG's outputs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch_geometric.nn.models import GAT, GCN, GraphSAGE

from gnnstream.model import GNN, ModelConfig, load_model_dir, save_model_dir
from tests.model.graphs import randomise_, random_neighbourhoods, run_layerwise, sampled_edge_index

ATOL = 1e-5
PYG_MODELS = {"sage": GraphSAGE, "gcn": GCN, "gat": GAT}


def pyg_model(arch: str, in_dim: int, hidden: int, out_dim: int, layers: int, heads: int) -> torch.nn.Module:
    extra = {"heads": heads} if arch == "gat" else {}
    return PYG_MODELS[arch](in_dim, hidden, layers, out_channels=out_dim, **extra).eval()


def config_for(arch, in_dim, hidden, out_dim, layers, heads, fanouts=None) -> ModelConfig:
    return ModelConfig(arch=arch, in_dim=in_dim, hidden_dim=hidden, out_dim=out_dim, num_layers=layers,
                       fanouts=tuple(fanouts or [3] * layers), seed=7, heads=heads, name="t", version=1)


CASES = [
    ("sage", 1, 1), ("sage", 2, 1), ("sage", 3, 1),
    ("gcn", 1, 1), ("gcn", 2, 1), ("gcn", 3, 1),
    ("gat", 1, 1), ("gat", 2, 1), ("gat", 2, 2), ("gat", 3, 4), ("gat", 1, 3),
]


@pytest.mark.parametrize("arch, layers, heads", CASES)
@pytest.mark.parametrize("k", [None, 3])
def test_saved_pyg_model_equals_pyg(tmp_path, arch: str, layers: int, heads: int, k: int | None) -> None:
    in_dim, hidden, out_dim = 5, 8, 3
    torch.manual_seed(layers * 10 + heads)
    reference = randomise_(pyg_model(arch, in_dim, hidden, out_dim, layers, heads), seed=heads, scale=0.4)
    nbrs = random_neighbourhoods(35, 80, seed=layers, isolated=2)
    edge_index = sampled_edge_index(nbrs, k)
    x = torch.randn(35, in_dim)
    with torch.no_grad():
        expected = reference(x, edge_index)

    written = save_model_dir(tmp_path / "m", config_for(arch, in_dim, hidden, out_dim, layers, heads),
                             reference.state_dict())
    loaded = load_model_dir(tmp_path / "m")
    assert loaded.config == written
    assert not loaded.model.training
    assert loaded.model.dims == (in_dim, *[hidden] * (layers - 1), out_dim)
    assert list(loaded.model.state_dict()) == list(reference.state_dict())

    got = run_layerwise(loaded.model, x, [edge_index] * layers, batch_size=6, seed=1)
    assert got.shape == (35, out_dim)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x, edge_index), expected, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("arch, heads", [("sage", 1), ("gcn", 1), ("gat", 2)])
def test_per_layer_edge_lists(tmp_path, arch: str, heads: int) -> None:
    """Layer l uses its own fanout k_l; the reference runs PyG's convs one by one with ReLU between."""
    fanouts = [4, 2, 1]
    reference = randomise_(pyg_model(arch, 4, 6, 2, 3, heads), seed=3, scale=0.4)
    nbrs = random_neighbourhoods(30, 70, seed=4)
    edge_lists = [sampled_edge_index(nbrs, k, salt=i) for i, k in enumerate(fanouts)]
    x = torch.randn(30, 4)
    with torch.no_grad():
        h = x
        for l, conv in enumerate(reference.convs):
            h = conv(h, edge_lists[l])
            h = h.relu() if l < 2 else h
    save_model_dir(tmp_path, config_for(arch, 4, 6, 2, 3, heads, fanouts), reference.state_dict())
    gnn = load_model_dir(tmp_path).model
    torch.testing.assert_close(run_layerwise(gnn, x, edge_lists, batch_size=7, seed=2), h, atol=ATOL, rtol=ATOL)
    with torch.no_grad():
        torch.testing.assert_close(gnn(x, edge_lists), h, atol=ATOL, rtol=ATOL)


def test_model_trained_with_pyg(tmp_path) -> None:
    torch.manual_seed(0)
    nbrs = random_neighbourhoods(40, 100, seed=9)
    full = sampled_edge_index(nbrs, None)
    x, target = torch.randn(40, 6), torch.randn(40, 4)
    reference = GraphSAGE(6, 16, 2, out_channels=4)
    before = {k: v.clone() for k, v in reference.state_dict().items()}
    optimiser = torch.optim.Adam(reference.parameters(), lr=0.05)
    losses = []
    for _ in range(15):
        optimiser.zero_grad()
        loss = torch.nn.functional.mse_loss(reference(x, full), target)
        loss.backward()
        optimiser.step()
        losses.append(loss.detach().item())
    assert losses[-1] < losses[0]
    assert any(not torch.equal(before[k], v) for k, v in reference.state_dict().items())
    reference.eval()

    save_model_dir(tmp_path, config_for("sage", 6, 16, 4, 2, 1, [3, 3]), reference.state_dict())
    gnn = load_model_dir(tmp_path).model
    sampled = sampled_edge_index(nbrs, 3)
    with torch.no_grad():
        expected = reference(x, sampled)
    torch.testing.assert_close(run_layerwise(gnn, x, [sampled, sampled], batch_size=9, seed=0), expected,
                               atol=ATOL, rtol=ATOL)


def test_layer_activation_and_no_grad() -> None:
    gnn = GNN("sage", 3, 4, 2, 2)
    x_self, x_nbr = torch.randn(2, 3), torch.randn(1, 3)
    index, self_count, nbr_count = torch.tensor([1]), torch.tensor([0, 1]), torch.tensor([1])
    hidden = gnn.layer(0, x_self, x_nbr, index, self_count, nbr_count)
    assert not hidden.requires_grad
    torch.testing.assert_close(hidden, gnn.convs[0](x_self, x_nbr, index, self_count, nbr_count).relu())
    last = gnn.layer(1, hidden, hidden[:1], index, self_count, nbr_count)
    torch.testing.assert_close(last, gnn.convs[1](hidden, hidden[:1], index, self_count, nbr_count))
    with pytest.raises(ValueError, match=r"Expected a layer number in \[0, 2\) \(got 2\)"):
        gnn.layer(2, x_self, x_nbr, index, self_count, nbr_count)


def test_gat_layer_construction_matches_pyg() -> None:
    gnn, ref = GNN("gat", 5, 12, 3, 3, heads=4), GAT(5, 12, 3, out_channels=3, heads=4)
    for ours, theirs in zip(gnn.convs, ref.convs):
        assert (ours.in_dim, ours.out_dim, ours.heads, ours.concat) == (
            theirs.in_channels, theirs.out_channels, theirs.heads, theirs.concat)
    assert [c.total_out_dim for c in gnn.convs] == [12, 12, 3]
    assert gnn.uses_neighbour_counts is False and GNN("gcn", 2, 2, 2, 1).uses_neighbour_counts is True


def test_model_package_is_pure_torch() -> None:
    code = ("import sys, model; bad = sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('torch_geometric', 'kafka', 'rocksdict')); print(bad); assert not bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("arch", ["sage", "gcn", "gat"])
def test_layer_indexed_equals_layer(arch: str) -> None:
    """Neighbour rows given as table positions give the same output as gathered rows."""
    torch.manual_seed(7)
    model = GNN(arch, 6, 4, 4, 2, heads=2 if arch == "gat" else 1)
    randomise_(model, seed=3)
    table = torch.randn(40, 6)
    counts = torch.tensor([3, 0, 1, 5, 2])
    rows = torch.randint(0, 40, (int(counts.sum()),))
    index = torch.repeat_interleave(torch.arange(5), counts)
    x_self = table[torch.tensor([0, 7, 9, 11, 39])]
    nbr_count = torch.randint(0, 4, (len(rows),))
    want = model.layer(0, x_self, table[rows], index, counts, nbr_count)
    got = model.layer_indexed(0, x_self, table, rows, counts, nbr_count)
    assert got.shape == (5, 4)
    assert torch.equal(got, want)
    empty = model.layer_indexed(0, x_self[:2], table, rows[:0], torch.zeros(2, dtype=torch.long), nbr_count[:0])
    assert torch.equal(empty, model.layer(0, x_self[:2], table[:0], rows[:0], torch.zeros(2, dtype=torch.long),
                                          nbr_count[:0]))
