"""GCN layer over a sampled neighbour list (PyG ``GCNConv`` math)."""

from __future__ import annotations

import logging
from typing import ClassVar

import torch
from torch import Tensor, nn

from gnnstream.model.aggregate import check_layer_inputs, glorot_, scatter_sum

__all__ = ["GCNLayer"]

logger = logging.getLogger(__name__)


class GCNLayer(nn.Module):
    r"""Graph convolution, equal to PyG ``GCNConv(in_dim, out_dim)`` on the sampled edge list.

    The sampled edges ``u -> v`` (``u ∈ S(v)``) plus one self loop per node
    are normalised symmetrically with ``d_w = |S(w)| + 1``:

    .. math::
        h_v = \frac{W x_v}{d_v} + \sum_{u \in S(v)} \frac{W x_u}{\sqrt{d_u d_v}} + b

    Dependencies of ``h_v`` (what the incremental engine must track): the
    target's own input ``x_v``, the inputs of the members of ``S(v)``, the
    target's sample size ``|S(v)|`` and the sample size ``|S(u)|`` of *every*
    neighbour ``u ∈ S(v)``. A change of ``|S(u)|`` alone (``u`` gains or
    loses a sampled neighbour, at this layer's fanout) therefore changes every
    ``h_v`` with ``u ∈ S(v)``, even when no input changed.

    Parameters (state-dict keys as PyG): ``lin.weight [out, in]`` (no bias),
    ``bias [out]``, added after propagation.

    Args:
        in_dim: input dimension.
        out_dim: output dimension.
    """

    uses_neighbour_counts: ClassVar[bool] = True

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        if in_dim <= 0 or out_dim <= 0:
            raise ValueError(f"Expected positive in_dim and out_dim (got {in_dim}, {out_dim})")
        self.in_dim = in_dim
        self.out_dim = out_dim
        self.lin = nn.Linear(in_dim, out_dim, bias=False)
        self.bias = nn.Parameter(torch.empty(out_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-initialise the weights (Glorot weight, zero bias, as PyG)."""
        glorot_(self.lin.weight)
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
            nbr_count: sample size ``|S(u_e)|`` of every neighbour.

        Returns:
            The output of every target.

        Shapes:
            ``x_self: [B, in_dim]``, ``x_nbr: [E, in_dim]``, ``index: [E]``,
            ``self_count: [B]``, ``nbr_count: [E]`` -> ``[B, out_dim]``.
        """
        check_layer_inputs(type(self).__name__, self.in_dim, x_self, x_nbr, index, self_count, nbr_count)
        dtype = x_self.dtype
        deg_self = self_count.to(dtype) + 1.0
        inv_sqrt_self = deg_self.rsqrt()
        inv_sqrt_nbr = (nbr_count.to(dtype) + 1.0).rsqrt()
        h_self = self.lin(x_self)
        h_nbr = self.lin(x_nbr)
        weight = inv_sqrt_nbr * inv_sqrt_self[index]
        out = scatter_sum(h_nbr * weight.unsqueeze(-1), index, x_self.size(0), self_count)
        out = out + h_self * (inv_sqrt_self * inv_sqrt_self).unsqueeze(-1)
        return out + self.bias

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.in_dim}, {self.out_dim})"
