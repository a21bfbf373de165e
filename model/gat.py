"""Graph attention layer over a sampled neighbour list (PyG ``GATConv`` math)."""

from __future__ import annotations

import logging
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gnnstream.model.aggregate import check_layer_inputs, glorot_, scatter_softmax_with_self, scatter_sum

__all__ = ["GATLayer"]

logger = logging.getLogger(__name__)


class GATLayer(nn.Module):
    r"""Multi-head graph attention, equal to PyG
    ``GATConv(in_dim, out_dim, heads, concat=concat, add_self_loops=True)``.

    Per head ``k`` with ``z_w = W_k x_w``:

    .. math::
        e_{vu} = \operatorname{LeakyReLU}_{0.2}(a_{src,k} \cdot z_u + a_{dst,k} \cdot z_v),
        \quad
        \alpha_{vu} = \operatorname{softmax}_{u \in S(v) \cup \{v\}} e_{vu},
        \quad
        h_{v,k} = \sum_{u \in S(v) \cup \{v\}} \alpha_{vu} z_u

    The heads are concatenated (``concat=True``, output ``heads * out_dim``)
    or averaged (``concat=False``, output ``out_dim``); then ``bias`` is added.

    Dependencies of ``h_v`` (what the incremental engine must track): the
    target's own input ``x_v`` and the inputs of the members of ``S(v)`` (as
    a set; their order does not matter). Sample sizes are not used beyond the
    sample itself.

    Parameters (state-dict keys as PyG): ``lin.weight [heads*out, in]`` (no
    bias), ``att_src [1, heads, out]``, ``att_dst [1, heads, out]``,
    ``bias [heads*out if concat else out]``.

    Args:
        in_dim: input dimension.
        out_dim: output dimension of each head.
        heads: number of attention heads.
        concat: concatenate the heads (else average them).
        negative_slope: LeakyReLU slope of the attention scores.
    """

    uses_neighbour_counts: ClassVar[bool] = False

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        heads: int = 1,
        concat: bool = True,
        negative_slope: float = 0.2,
    ) -> None:
        super().__init__()
        if in_dim <= 0 or out_dim <= 0 or heads <= 0:
            raise ValueError(f"Expected positive in_dim, out_dim and heads (got {in_dim}, {out_dim}, {heads})")
        self.in_dim = in_dim
        self.out_dim = out_dim
        self.heads = heads
        self.concat = concat
        self.negative_slope = negative_slope
        self.lin = nn.Linear(in_dim, heads * out_dim, bias=False)
        self.att_src = nn.Parameter(torch.empty(1, heads, out_dim))
        self.att_dst = nn.Parameter(torch.empty(1, heads, out_dim))
        self.bias = nn.Parameter(torch.empty(heads * out_dim if concat else out_dim))
        self.reset_parameters()

    @property
    def total_out_dim(self) -> int:
        """Width of the output: ``heads * out_dim`` if ``concat`` else ``out_dim``."""
        return self.heads * self.out_dim if self.concat else self.out_dim

    def reset_parameters(self) -> None:
        """Re-initialise the weights (Glorot weight and attention, zero bias, as PyG)."""
        glorot_(self.lin.weight)
        glorot_(self.att_src)
        glorot_(self.att_dst)
        with torch.no_grad():
            self.bias.zero_()

    def forward(
        self,
        x_self: Tensor,
        x_nbr: Tensor,
        index: Tensor,
        self_count: Tensor,
        nbr_count: Tensor,
    ) -> Tensor:
        """Compute the layer for a batch of targets.

        Args:
            x_self: own input of every target.
            x_nbr: input of every sampled neighbour row.
            index: target row (in ``[0, B)``) of every neighbour row.
            self_count: sample size ``|S(v_b)|`` of every target; must equal
                the number of rows with ``index == b``.
            nbr_count: sample size of every neighbour (unused by this layer,
                checked for shape only).

        Returns:
            The output of every target.

        Shapes:
            ``x_self: [B, in_dim]``, ``x_nbr: [E, in_dim]``, ``index: [E]``,
            ``self_count: [B]``, ``nbr_count: [E]`` -> ``[B, total_out_dim]``.
        """
        check_layer_inputs(type(self).__name__, self.in_dim, x_self, x_nbr, index, self_count, nbr_count)
        heads, dim = self.heads, self.out_dim
        z_self = self.lin(x_self).view(-1, heads, dim)
        z_nbr = self.lin(x_nbr).view(-1, heads, dim)
        src_self = (z_self * self.att_src).sum(-1)
        src_nbr = (z_nbr * self.att_src).sum(-1)
        dst = (z_self * self.att_dst).sum(-1)
        score_self = F.leaky_relu(src_self + dst, self.negative_slope)
        score_nbr = F.leaky_relu(src_nbr + dst[index], self.negative_slope)
        alpha_self, alpha_nbr = scatter_softmax_with_self(score_self, score_nbr, index)
        out = scatter_sum(alpha_nbr.unsqueeze(-1) * z_nbr, index, x_self.size(0), self_count)
        out = out + alpha_self.unsqueeze(-1) * z_self
        out = out.reshape(-1, heads * dim) if self.concat else out.mean(dim=1)
        return out + self.bias

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.in_dim}, {self.out_dim}, "
                f"heads={self.heads}, concat={self.concat})")
