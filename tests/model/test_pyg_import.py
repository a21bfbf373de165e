"""Importing PyG models: exact when served, refused in one line naming the option otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch_geometric.nn import GAT, GCN, GATConv, GraphSAGE, SAGEConv

from gnnstream.model import load_model_dir
from gnnstream.model.exceptions import CorruptWeights
from gnnstream.model.pyg import UnsupportedModel, import_checkpoint, import_pyg, import_state_dict
from tests.workers.reference import call_gnnstream


def _graph() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(40, 6)
    edges = torch.randint(0, 40, (2, 200))
    edges = torch.unique(edges[:, edges[0] != edges[1]], dim=1)  # a sampled list: no self loops, no repeats
    return x, edges


class _Convs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = SAGEConv(6, 12)
        self.second = SAGEConv(12, 5, bias=False)

    def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x, edges).relu(), edges)


@pytest.mark.parametrize("make", [lambda: GraphSAGE(6, 12, 3, out_channels=5), lambda: GCN(6, 12, 2, out_channels=5),
                                  lambda: GAT(6, 12, 2, out_channels=5, heads=3), _Convs],
                         ids=["graphsage", "gcn", "gat", "module-of-convs"])
def test_imported_models_compute_what_pyg_computes(make, tmp_path: Path) -> None:
    x, edges = _graph()
    module = make().eval()
    layers = sum(1 for m in module.modules() if hasattr(m, "propagate"))
    config = import_pyg(module, tmp_path / "a", fanouts=[5] * layers, seed=3, name="byom")
    ours = load_model_dir(tmp_path / "a").model
    with torch.no_grad():
        assert torch.allclose(ours(x, edges), module(x, edges), atol=1e-5)
    torch.save(module.state_dict(), tmp_path / "sd.pt")
    again = import_checkpoint(tmp_path / "sd.pt", tmp_path / "b", arch=config.arch, fanouts=config.fanouts, seed=3,
                              name="byom")
    assert again == config and config.out_dim == 5 and config.model_id == "byom:1"


@pytest.mark.parametrize(("module", "option"), [
    (GraphSAGE(6, 8, 2, jk="cat"), "jk='cat'"),
    (GraphSAGE(6, 8, 2, norm="batch_norm"), "norm='batch_norm'"),
    (GraphSAGE(6, 8, 2, aggr="max"), "aggr='max'"),
    (GraphSAGE(6, 8, 2, project=True), "project=True"),
    (GraphSAGE(6, 8, 2, act="elu"), "act=ELU"),
    (GraphSAGE(6, 8, 2, dropout=0.5), "dropout=0.5 left on"),
    (GAT(6, 8, 2, heads=2, residual=True), "residual=True"),
    (GAT(6, 8, 2, v2=True), "GATv2Conv"),
    (GCN(6, 8, 2, improved=True), "improved=True"),
], ids=["jk", "norm", "aggr", "project", "act", "dropout", "residual", "v2", "improved"])
def test_what_is_not_served_exactly_is_refused(module, option: str, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModel, match="cannot serve the model exactly") as info:
        import_pyg(module, tmp_path / "m", fanouts=[3, 3])
    assert option in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize(("state_dict", "says"), [
    (GraphSAGE(6, 8, 2, jk="last").state_dict(), "key 'lin.weight' means jumping knowledge"),
    (GraphSAGE(6, 8, 2, norm="layer_norm").state_dict(), "means normalisation layers"),
    (GraphSAGE(6, 8, 2, project=True).state_dict(), "means project=True"),
    (GraphSAGE(6, 8, 2, root_weight=False).state_dict(), "root_weight=False"),
    (GAT(6, 8, 2, edge_dim=3).state_dict(), "edge features (edge_dim=...)"),
    (torch.nn.Sequential(SAGEConv(6, 8), torch.nn.Linear(8, 2)).state_dict(), "key '1.weight' is no parameter"),
], ids=["jk", "norm", "project", "root_weight", "edge_dim", "extra-layer"])
def test_a_state_dict_that_is_not_served_exactly_is_refused(state_dict, says: str, tmp_path: Path) -> None:
    arch = "gat" if any("att_src" in k for k in state_dict) else "sage"
    with pytest.raises(UnsupportedModel, match="cannot serve the model exactly") as info:
        import_state_dict(state_dict, tmp_path / "m", arch=arch, fanouts=[3, 3])
    assert says in str(info.value)


def test_gat_heads_are_read_from_the_weights(tmp_path: Path) -> None:
    x, edges = _graph()
    module = torch.nn.ModuleList([GATConv(6, 4, heads=2), GATConv(8, 5, heads=2, concat=False)]).eval()
    config = import_state_dict(module.state_dict(), tmp_path / "m", arch="gat", fanouts=[2, 2])
    assert (config.heads, config.hidden_dim, config.out_dim) == (2, 8, 5)
    bad = torch.nn.ModuleList([GATConv(6, 4, heads=2), GATConv(8, 5, heads=2, concat=True)])
    with pytest.raises(UnsupportedModel, match="concat=True on the last layer"):
        import_state_dict(bad.state_dict(), tmp_path / "bad", arch="gat", fanouts=[2, 2])


def test_the_command_imports_a_checkpoint_and_refuses_in_one_line(tmp_path: Path) -> None:
    torch.save(GAT(6, 8, 2, out_channels=4, heads=2).state_dict(), tmp_path / "gat.pt")
    proc = call_gnnstream("model", "import", tmp_path / "gat.pt", tmp_path / "m", "--arch", "gat", "--fanouts", "4,2",
                          "--name", "mine", "--version", "3")
    assert proc.returncode == 0, proc.stderr
    assert {k: json.loads(proc.stdout)[k] for k in ("arch", "in_dim", "hidden_dim", "out_dim", "heads", "name",
                                                    "version")} == \
        {"arch": "gat", "in_dim": 6, "hidden_dim": 8, "out_dim": 4, "heads": 2, "name": "mine", "version": 3}
    proc = call_gnnstream("model", "import", tmp_path / "gat.pt", tmp_path / "n", "--arch", "gat", "--fanouts", "4,2",
                          "--aggr", "sum")
    assert proc.returncode == 2 and proc.stderr == ("gnnstream: error: cannot serve the model exactly: aggr='sum'; "
                                                    "only aggr='mean' is served\n")
    torch.save({"model": GAT(6, 8, 2).state_dict(), "epoch": 3}, tmp_path / "wrapped.pt")
    with pytest.raises(CorruptWeights, match="entry 'model' is a OrderedDict, not a tensor"):
        import_checkpoint(tmp_path / "wrapped.pt", tmp_path / "w", arch="gat", fanouts=[1, 1])
