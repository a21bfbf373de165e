"""Each layer equals its PyG conv on sampled edge lists; order independence; input checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch_geometric.nn import GATConv, GCNConv, SAGEConv

from gnnstream.model import GATLayer, GCNLayer, SAGELayer
from tests.model.graphs import gather_batch, randomise_, random_neighbourhoods, sampled_edge_index

ATOL = 1e-5

# (label, our layer factory, PyG conv factory, output width)
LAYERS = {
    "sage": (lambda i, o: SAGELayer(i, o), lambda i, o: SAGEConv(i, o), lambda o: o),
    "gcn": (lambda i, o: GCNLayer(i, o), lambda i, o: GCNConv(i, o), lambda o: o),
    "gat-h1": (lambda i, o: GATLayer(i, o, heads=1), lambda i, o: GATConv(i, o, heads=1), lambda o: o),
    "gat-h3-concat": (lambda i, o: GATLayer(i, o, heads=3, concat=True),
                      lambda i, o: GATConv(i, o, heads=3, concat=True, add_self_loops=True), lambda o: 3 * o),
    "gat-h3-mean": (lambda i, o: GATLayer(i, o, heads=3, concat=False),
                    lambda i, o: GATConv(i, o, heads=3, concat=False, add_self_loops=True), lambda o: o),
}


def make_pair(kind: str, in_dim: int, out_dim: int, seed: int):
    ours_factory, pyg_factory, _ = LAYERS[kind]
    pyg = randomise_(pyg_factory(in_dim, out_dim), seed)
    ours = ours_factory(in_dim, out_dim)
    ours.load_state_dict(pyg.state_dict())  # strict: same keys and shapes as PyG
    return ours, pyg


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("dims", [(4, 6), (7, 3)])
@pytest.mark.parametrize("k", [None, 3, 1])
def test_layer_equals_pyg_on_sampled_graph(kind: str, dims: tuple[int, int], k: int | None) -> None:
    in_dim, out_dim = dims
    nbrs = random_neighbourhoods(40, 90, seed=11, isolated=3)
    edge_index = sampled_edge_index(nbrs, k)
    if k is not None:  # sampling really drops edges, and some nodes have none
        assert edge_index.size(1) < sampled_edge_index(nbrs, None).size(1)
    torch.manual_seed(0)
    x = torch.randn(40, in_dim)
    ours, pyg = make_pair(kind, in_dim, out_dim, seed=1)
    expected = pyg(x, edge_index)
    targets = torch.tensor([0, 1, 2, 17, 5, 39, 23, 8, 30, 12])  # includes isolated nodes 0..2
    got = ours(*gather_batch(x, edge_index, targets))
    assert got.shape == (targets.numel(), LAYERS[kind][2](out_dim))
    torch.testing.assert_close(got, expected[targets], atol=ATOL, rtol=ATOL)
    # All nodes at once, too.
    everyone = torch.arange(40)
    torch.testing.assert_close(ours(*gather_batch(x, edge_index, everyone)), expected, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_no_edges_at_all(kind: str) -> None:
    x = torch.randn(5, 4)
    edge_index = torch.empty(2, 0, dtype=torch.long)
    ours, pyg = make_pair(kind, 4, 2, seed=3)
    got = ours(*gather_batch(x, edge_index, torch.arange(5)))
    torch.testing.assert_close(got, pyg(x, edge_index), atol=ATOL, rtol=ATOL)


def test_sage_empty_sample_means_zero() -> None:
    layer = SAGELayer(3, 2)
    x_self = torch.randn(2, 3)
    got = layer(x_self, torch.empty(0, 3), torch.empty(0, dtype=torch.long),
                torch.zeros(2, dtype=torch.long), torch.empty(0, dtype=torch.long))
    torch.testing.assert_close(got, layer.lin_l.bias + layer.lin_r(x_self))


def test_empty_batch() -> None:
    for kind in LAYERS:
        ours, _ = make_pair(kind, 3, 2, seed=0)
        out = ours(torch.empty(0, 3), torch.empty(0, 3), torch.empty(0, dtype=torch.long),
                   torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))
        assert out.shape[0] == 0


@settings(max_examples=40, deadline=None)
@given(
    num_nodes=st.integers(1, 14),
    edges=st.lists(st.tuples(st.integers(0, 13), st.integers(0, 13)), max_size=40),
    k=st.integers(0, 5),
    kind=st.sampled_from(sorted(LAYERS)),
    seed=st.integers(0, 1000),
)
def test_layer_equals_pyg_hypothesis(num_nodes, edges, k, kind, seed) -> None:
    nbrs: list[set[int]] = [set() for _ in range(num_nodes)]
    for u, v in edges:
        u, v = u % num_nodes, v % num_nodes
        if u != v:
            nbrs[v].add(u)
            nbrs[u].add(v)
    edge_index = sampled_edge_index(nbrs, k, salt=seed)
    x = torch.randn(num_nodes, 3, generator=torch.Generator().manual_seed(seed))
    ours, pyg = make_pair(kind, 3, 4, seed=seed)
    targets = torch.randperm(num_nodes, generator=torch.Generator().manual_seed(seed + 1))[: max(1, num_nodes // 2)]
    torch.testing.assert_close(ours(*gather_batch(x, edge_index, targets)), pyg(x, edge_index)[targets],
                               atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_order_independence(kind: str) -> None:
    nbrs = random_neighbourhoods(25, 70, seed=5)
    edge_index = sampled_edge_index(nbrs, 4)
    x = torch.randn(25, 5)
    ours, _ = make_pair(kind, 5, 3, seed=2)
    targets = torch.arange(25)
    x_self, x_nbr, index, self_count, nbr_count = gather_batch(x, edge_index, targets)
    base = ours(x_self, x_nbr, index, self_count, nbr_count)
    for perm_seed in range(3):
        perm = torch.randperm(index.numel(), generator=torch.Generator().manual_seed(perm_seed))
        got = ours(x_self, x_nbr[perm], index[perm], self_count, nbr_count[perm])
        torch.testing.assert_close(got, base, atol=1e-6, rtol=1e-6)
    # Reordering the targets (and remapping index) reorders the output rows only.
    tperm = torch.randperm(25, generator=torch.Generator().manual_seed(9))
    inverse = torch.empty_like(tperm)
    inverse[tperm] = torch.arange(25)
    got = ours(x_self[tperm], x_nbr, inverse[index], self_count[tperm], nbr_count)
    torch.testing.assert_close(got, base[tperm], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_uses_neighbour_counts_is_truthful(kind: str) -> None:
    """Only layers that declare ``uses_neighbour_counts`` react to ``nbr_count``."""
    nbrs = random_neighbourhoods(20, 50, seed=8)
    edge_index = sampled_edge_index(nbrs, 3)
    x = torch.randn(20, 4)
    ours, _ = make_pair(kind, 4, 3, seed=4)
    x_self, x_nbr, index, self_count, nbr_count = gather_batch(x, edge_index, torch.arange(20))
    base = ours(x_self, x_nbr, index, self_count, nbr_count)
    changed = ours(x_self, x_nbr, index, self_count, nbr_count + 5)
    assert (not torch.allclose(base, changed)) == type(ours).uses_neighbour_counts
    assert type(ours).uses_neighbour_counts == (kind == "gcn")


def _inputs(b=3, e=4, d=2):
    return [torch.randn(b, d), torch.randn(e, d), torch.tensor([0, 0, 1, 2])[:e],
            torch.tensor([2, 1, 1])[:b], torch.ones(e, dtype=torch.long)]


@pytest.mark.parametrize("position, bad, message", [
    (0, torch.randn(3, 5), "x_self of shape [B, 2]"),
    (1, torch.randn(4, 3), "x_nbr of shape [E, 2]"),
    (1, torch.randn(4, 2, dtype=torch.float64), "one floating dtype"),
    (2, torch.tensor([0, 0, 1, 3]), "index values in [0, 3)"),
    (2, torch.tensor([0.0, 0.0, 1.0, 2.0]), "index to be a 1-D int64 tensor of length 4"),
    (3, torch.tensor([2, 1]), "self_count to be a 1-D int64 tensor of length 3"),
    (3, torch.tensor([1, 2, 1]), "self_count[b] to equal the number of neighbour rows"),
    (4, torch.tensor([1, 1, -1, 1]), "non-negative nbr_count"),
    (4, torch.ones(3, dtype=torch.long), "nbr_count to be a 1-D int64 tensor of length 4"),
])
@pytest.mark.parametrize("kind", ["sage", "gcn", "gat-h3-concat"])
def test_input_checks(kind, position, bad, message) -> None:
    ours, _ = make_pair(kind, 2, 3, seed=0)
    args = _inputs()
    ours(*args)  # the unmodified inputs are valid
    args[position] = bad
    with pytest.raises(ValueError, match="Expected") as info:
        ours(*args)
    assert message in str(info.value)
    assert "got" in str(info.value)


def test_repr_and_reset() -> None:
    assert repr(SAGELayer(4, 6)) == "SAGELayer(4, 6)"
    assert repr(GCNLayer(4, 6)) == "GCNLayer(4, 6)"
    assert repr(GATLayer(4, 6, heads=2, concat=False)) == "GATLayer(4, 6, heads=2, concat=False)"
    gcn = GCNLayer(3, 2)
    randomise_(gcn, 0)
    gcn.reset_parameters()
    assert torch.count_nonzero(gcn.bias) == 0
    assert GATLayer(3, 2, heads=4).total_out_dim == 8


@pytest.mark.parametrize("k", [None, 3, 1])
def test_sage_from_projected_inputs_equals_the_layer(k: int | None) -> None:
    nbrs = random_neighbourhoods(40, 90, seed=5, isolated=3)
    edge_index = sampled_edge_index(nbrs, k)
    torch.manual_seed(2)
    x = torch.randn(40, 6)
    ours, pyg = make_pair("sage", 6, 4, seed=4)
    targets = torch.tensor([0, 1, 2, 17, 5, 39, 23])  # 0..2 have no neighbours: the output is W_r x + b
    src, dst = edge_index
    lists = [src[dst == t].tolist() for t in targets.tolist()]  # each target's sample, as the engine reads it
    assert [len(x) for x in lists[:3]] == [0, 0, 0] and any(lists)
    width = max(map(len, lists))
    nbr_valid = torch.tensor([[j < len(x) for j in range(width)] for x in lists])
    nbr_rows = torch.tensor([x + [39] * (width - len(x)) for x in lists])  # padding: any row, weight 0
    first, second = ours.project(x)
    torch.testing.assert_close(first, x @ ours.lin_l.weight.t())
    torch.testing.assert_close(second, ours.lin_r(x) + ours.lin_l.bias)
    table = torch.cat([first, second])  # the second projection of node i is row 40 + i
    got = ours.forward_projected(table, nbr_rows, nbr_valid, targets + 40)
    torch.testing.assert_close(got, pyg(x, edge_index)[targets], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(got[:3], second[:3])
    empty = ours.forward_projected(table, nbr_rows[:0], nbr_valid[:0], targets[:0])
    assert empty.shape == (0, 4)
    no_fanout = ours.forward_projected(table, nbr_rows[:, :0], nbr_valid[:, :0], targets + 40)
    torch.testing.assert_close(no_fanout, second[targets])
    with pytest.raises(ValueError, match="nbr_rows and nbr_valid"):
        ours.forward_projected(table, nbr_rows, nbr_valid[:, :-1], targets + 40)
    with pytest.raises(ValueError, match="table"):
        ours.forward_projected(torch.cat([x, x]), nbr_rows, nbr_valid, targets + 40)
