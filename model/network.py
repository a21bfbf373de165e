"""A stack of layers with PyG ``BasicGNN`` state-dict keys, run one layer at a time.

The layer stack mirrors ``torch_geometric.nn.models.GraphSAGE / GCN / GAT``
built as ``Model(in_dim, hidden_dim, num_layers, out_channels=out_dim)``
(plus ``heads=heads`` for GAT), so a state dict trained with PyG loads as is:

- ``sage``: ``convs.{l}.lin_l.weight``, ``convs.{l}.lin_l.bias``, ``convs.{l}.lin_r.weight``
- ``gcn``: ``convs.{l}.lin.weight``, ``convs.{l}.bias``
- ``gat``: ``convs.{l}.lin.weight``, ``convs.{l}.att_src``, ``convs.{l}.att_dst``, ``convs.{l}.bias``

Layers ``0 … L-2`` map to ``hidden_dim`` and are followed by ReLU; the last
layer maps to ``out_dim`` with no activation. For GAT the hidden layers are
``GATLayer(d, hidden_dim // heads, heads, concat=True)`` and the last is
``GATLayer(d, out_dim, heads, concat=False)`` (heads averaged).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from gnnstream.model.config import ARCHITECTURES, ModelConfig
from gnnstream.model.exceptions import UnknownArchitecture
from gnnstream.model.gat import GATLayer
from gnnstream.model.gcn import GCNLayer
from gnnstream.model.sage import SAGELayer

__all__ = ["GNN", "Layer", "build_layer"]

logger = logging.getLogger(__name__)

Layer = SAGELayer | GCNLayer | GATLayer


def build_layer(arch: str, in_dim: int, out_dim: int, *, last: bool, heads: int = 1) -> Layer:
    """Build layer ``l`` of a model as PyG's ``BasicGNN`` does.

    Args:
        arch: ``sage`` | ``gcn`` | ``gat``.
        in_dim: input dimension of the layer.
        out_dim: output dimension of the layer (``hidden_dim`` or ``out_dim``).
        last: whether it is the model's last layer (GAT then averages heads).
        heads: GAT heads.

    Returns:
        The layer, freshly initialised.
    """
    if arch == "sage":
        return SAGELayer(in_dim, out_dim)
    if arch == "gcn":
        return GCNLayer(in_dim, out_dim)
    if arch == "gat":
        if last:
            return GATLayer(in_dim, out_dim, heads=heads, concat=False)
        if out_dim % heads != 0:
            raise ValueError(f"Expected hidden dim divisible by heads (got {out_dim} and {heads})")
        return GATLayer(in_dim, out_dim // heads, heads=heads, concat=True)
    raise UnknownArchitecture(f"unknown arch {arch!r}; use one of {list(ARCHITECTURES)}")


class GNN(nn.Module):
    """A ``num_layers``-deep GNN evaluated layer by layer.

    Args:
        arch: ``sage`` | ``gcn`` | ``gat``.
        in_dim: node feature dimension.
        hidden_dim: width of hidden layers.
        out_dim: embedding dimension.
        num_layers: number of layers.
        heads: GAT heads (1 for the other architectures).
    """

    def __init__(self, arch: str, in_dim: int, hidden_dim: int, out_dim: int, num_layers: int,
                 heads: int = 1) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"Expected num_layers >= 1 (got {num_layers})")
        self.arch = arch
        self.heads = heads
        self._dims = tuple([in_dim] + [hidden_dim] * (num_layers - 1) + [out_dim])
        self.convs = nn.ModuleList(
            build_layer(arch, self._dims[l], self._dims[l + 1], last=l == num_layers - 1, heads=heads)
            for l in range(num_layers)
        )

    @classmethod
    def from_config(cls, config: ModelConfig) -> GNN:
        """Build a freshly initialised model for ``config``."""
        return cls(config.arch, config.in_dim, config.hidden_dim, config.out_dim, config.num_layers,
                   heads=config.heads)

    @property
    def num_layers(self) -> int:
        """Number of layers."""
        return len(self.convs)

    @property
    def dims(self) -> tuple[int, ...]:
        """``(in_dim, hidden_dim, …, out_dim)``: input dim of each layer, then the output dim."""
        return self._dims

    @property
    def uses_neighbour_counts(self) -> bool:
        """Whether the layers read ``nbr_count`` (GCN)."""
        return bool(self.convs[0].uses_neighbour_counts)

    def reset_parameters(self) -> None:
        """Re-initialise every layer."""
        for conv in self.convs:
            conv.reset_parameters()

    @torch.no_grad()
    def layer(self, l: int, x_self: Tensor, x_nbr: Tensor, index: Tensor, self_count: Tensor,
              nbr_count: Tensor) -> Tensor:
        """Run layer ``l`` and its activation (ReLU except after the last layer) for a batch.

        Args:
            l: layer number in ``[0, num_layers)``.
            x_self: layer-``l`` input of every target.
            x_nbr: layer-``l`` input of every sampled neighbour row.
            index: target row of every neighbour row.
            self_count: sample size of every target at fanout ``k_l``.
            nbr_count: sample size of every neighbour at fanout ``k_l``.

        Returns:
            The layer-``l`` output of every target.

        Shapes:
            ``x_self: [B, dims[l]]``, ``x_nbr: [E, dims[l]]``, ``index: [E]``,
            ``self_count: [B]``, ``nbr_count: [E]`` -> ``[B, dims[l+1]]``.
        """
        if not 0 <= l < self.num_layers:
            raise ValueError(f"Expected a layer number in [0, {self.num_layers}) (got {l})")
        out = self.convs[l](x_self, x_nbr, index, self_count, nbr_count)
        return out.relu() if l < self.num_layers - 1 else out

    def layer_indexed(self, l: int, x_self: Tensor, table: Tensor, nbr_rows: Tensor, self_count: Tensor,
                      nbr_count: Tensor) -> Tensor:
        """:meth:`layer` with the neighbour inputs given as rows of ``table``.

        Neighbour ``e`` is ``table[nbr_rows[e]]``; rows are grouped by target
        in order (``self_count[b]`` rows for target ``b``). A layer that can
        reduce straight from the table (GraphSAGE: an ``embedding_bag`` sum)
        never materialises the ``[E, in_dim]`` neighbour matrix; the others
        get it gathered. The result equals :meth:`layer` on the gathered rows.

        Shapes:
            ``x_self: [B, dims[l]]``, ``table: [N, dims[l]]``, ``nbr_rows: [E]``,
            ``self_count: [B]``, ``nbr_count: [E]`` -> ``[B, dims[l+1]]``.
        """
        if not 0 <= l < self.num_layers:
            raise ValueError(f"Expected a layer number in [0, {self.num_layers}) (got {l})")
        conv = self.convs[l]
        if hasattr(conv, "forward_indexed"):
            out = conv.forward_indexed(x_self, table, nbr_rows, self_count, nbr_count)
        else:
            index = torch.repeat_interleave(torch.arange(x_self.size(0), device=x_self.device), self_count)
            out = conv(x_self, table.index_select(0, nbr_rows), index, self_count, nbr_count)
        return out.relu() if l < self.num_layers - 1 else out

    def projects(self, l: int) -> bool:
        """Whether layer ``l`` can run from projected inputs (:meth:`project`, :meth:`layer_projected`)."""
        return hasattr(self.convs[l], "project")

    @torch.no_grad()
    def project(self, l: int, x: Tensor) -> tuple[Tensor, Tensor]:
        """Layer ``l``'s two projections of its inputs ``x`` (GraphSAGE: ``W_l x`` and ``W_r x + b_l``).

        Shapes:
            ``x: [N, dims[l]]`` -> ``([N, dims[l+1]], [N, dims[l+1]])``.
        """
        return self.convs[l].project(x)

    @torch.no_grad()
    def layer_projected(self, l: int, table: Tensor, nbr_rows: Tensor, nbr_valid: Tensor, self_rows: Tensor) -> Tensor:
        """:meth:`layer_indexed` from projected inputs (:meth:`project`), both projections of every node
        stacked in ``table``: target ``b``'s neighbours are ``table[nbr_rows[b, j]]`` where ``nbr_valid[b, j]``
        (first projections; other entries are ignored but must be valid rows), its own row
        ``table[self_rows[b]]`` (a second projection). Equal to :meth:`layer_indexed` up to float rounding.

        Shapes:
            ``table: [M, dims[l+1]]``, ``nbr_rows: [B, k]``, ``nbr_valid: [B, k]``, ``self_rows: [B]``
            -> ``[B, dims[l+1]]``.
        """
        if not 0 <= l < self.num_layers:
            raise ValueError(f"Expected a layer number in [0, {self.num_layers}) (got {l})")
        out = self.convs[l].forward_projected(table, nbr_rows, nbr_valid, self_rows)
        return out.relu() if l < self.num_layers - 1 else out

    def forward(self, x: Tensor, edge_index: Tensor | Sequence[Tensor]) -> Tensor:
        """Embed every node of a graph from its sampled edge list(s): the from-scratch reference.

        Args:
            x: features of all ``N`` nodes.
            edge_index: sampled edges ``[2, E]`` (row 0 = neighbour ``u``,
                row 1 = target ``v``, one column per ``u ∈ S(v)``), either
                one tensor for every layer or a sequence of one per layer.

        Returns:
            The output embedding of every node.

        Shapes:
            ``x: [N, dims[0]]``, ``edge_index: [2, E]`` -> ``[N, dims[-1]]``.
        """
        if isinstance(edge_index, Tensor):
            edge_lists = [edge_index] * self.num_layers
        else:
            edge_lists = list(edge_index)
        if len(edge_lists) != self.num_layers:
            raise ValueError(f"Expected {self.num_layers} edge lists (got {len(edge_lists)})")
        for l, edges in enumerate(edge_lists):
            if edges.dim() != 2 or edges.size(0) != 2:
                raise ValueError(f"Expected edge_index of shape [2, E] (got {list(edges.shape)})")
            src, dst = edges[0], edges[1]
            count = torch.bincount(dst, minlength=x.size(0))
            out = self.convs[l](x, x[src], dst, count, count[src])
            x = out.relu() if l < self.num_layers - 1 else out
        return x

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(arch={self.arch!r}, dims={list(self.dims)}, "
                f"heads={self.heads})")
