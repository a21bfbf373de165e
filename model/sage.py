"""GraphSAGE-mean layer over a sampled neighbour list (PyG ``SAGEConv`` math)."""

from __future__ import annotations

import logging
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gnnstream.model.aggregate import check_layer_inputs, scatter_mean

__all__ = ["SAGELayer"]

logger = logging.getLogger(__name__)


class SAGELayer(nn.Module):
    r"""GraphSAGE with mean aggregation, equal to PyG ``SAGEConv(in_dim, out_dim)``.

    .. math::
        h_v = W_l \cdot \operatorname{mean}_{u \in S(v)} x_u + b_l + W_r x_v

    with the mean of an empty sample equal to 0 (so ``h_v = b_l + W_r x_v``).

    Dependencies of ``h_v`` (what the incremental engine must track): the
    target's own input ``x_v``, and the inputs of the members of its sample
    ``S(v)`` as a multiset (their order does not matter). The sample size
    ``self_count`` is only the mean's divisor, i.e. it is implied by the
    sample; the neighbours' sample sizes (``nbr_count``) are not used.

    Parameters (state-dict keys as PyG): ``lin_l.weight [out, in]``,
    ``lin_l.bias [out]``, ``lin_r.weight [out, root]``.

    Args:
        in_dim: input dimension (of the neighbours).
        out_dim: output dimension.
        root_dim: the targets' input dimension where it differs from the
            neighbours' (``SAGEConv((in_dim, root_dim), out_dim)``, a relation
            between two node types); None: ``in_dim``.
    """

    uses_neighbour_counts: ClassVar[bool] = False

    def __init__(self, in_dim: int, out_dim: int, root_dim: int | None = None) -> None:
        super().__init__()
        root_dim = in_dim if root_dim is None else root_dim
        if in_dim <= 0 or out_dim <= 0 or root_dim <= 0:
            raise ValueError(f"Expected positive in_dim, out_dim and root_dim (got {in_dim}, {out_dim}, {root_dim})")
        self.in_dim = in_dim
        self.out_dim = out_dim
        self.root_dim = root_dim
        self.lin_l = nn.Linear(in_dim, out_dim, bias=True)
        self.lin_r = nn.Linear(root_dim, out_dim, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-initialise the weights (uniform Kaiming, as PyG's ``Linear``)."""
        self.lin_l.reset_parameters()
        self.lin_r.reset_parameters()

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
            ``x_self: [B, root_dim]``, ``x_nbr: [E, in_dim]``, ``index: [E]``,
            ``self_count: [B]``, ``nbr_count: [E]`` -> ``[B, out_dim]``.
        """
        check_layer_inputs(type(self).__name__, self.in_dim, x_self, x_nbr, index, self_count, nbr_count,
                           self.root_dim)
        return self._combine(scatter_mean(x_nbr, index, self_count), x_self)

    def forward_indexed(
        self,
        x_self: Tensor,
        table: Tensor,
        nbr_rows: Tensor,
        self_count: Tensor,
        nbr_count: Tensor,
    ) -> Tensor:
        """:meth:`forward` with neighbour row ``e`` being ``table[nbr_rows[e]]``, grouped by target.

        The neighbour sum is one ``embedding_bag`` over the table, so the
        ``[E, in_dim]`` neighbour matrix is never built; sums are taken in
        the same order as :meth:`forward`'s.

        Shapes:
            ``x_self: [B, root_dim]``, ``table: [N, in_dim]``, ``nbr_rows: [E]``,
            ``self_count: [B]``, ``nbr_count: [E]`` -> ``[B, out_dim]``.
        """
        if x_self.dim() != 2 or x_self.size(1) != self.root_dim or table.dim() != 2 or table.size(1) != self.in_dim:
            raise ValueError(f"{type(self).__name__}: Expected x_self [B, {self.root_dim}] and table "
                             f"[N, {self.in_dim}] (got {list(x_self.shape)} and {list(table.shape)})")
        if self_count.numel() != x_self.size(0) or int(self_count.sum()) != nbr_rows.numel():
            raise ValueError(f"{type(self).__name__}: Expected self_count to sum to the {nbr_rows.numel()} "
                             f"neighbour rows, one entry per target")
        if x_self.size(0) == 0:
            return x_self.new_zeros((0, self.out_dim))
        return self._combine(self.mean_indexed(table, nbr_rows, self_count), x_self)

    def mean_indexed(self, table: Tensor, nbr_rows: Tensor, self_count: Tensor) -> Tensor:
        """The mean of each target's neighbour rows ``table[nbr_rows]`` (grouped by target, ``self_count`` of
        each; 0 for none), as one ``embedding_bag`` sum.

        Shapes:
            ``table: [N, in_dim]``, ``nbr_rows: [E]``, ``self_count: [B]`` -> ``[B, in_dim]``.
        """
        if nbr_rows.numel():
            total = F.embedding_bag(nbr_rows, table, torch.cumsum(self_count, 0) - self_count, mode="sum")
        else:
            total = table.new_zeros((self_count.numel(), self.in_dim))
        return total.div_(self_count.clamp(min=1).to(table.dtype).unsqueeze(-1))

    def project(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(W_l x, W_r x + b_l)`` of every row of ``x``.

        The layer is linear before its activation, so
        ``h_v = mean_{u∈S(v)} W_l x_u + (W_r x_v + b_l)``: a caller that keeps
        both projections of every node recomputes a target with one
        ``embedding_bag`` and no matrix product (:meth:`forward_projected`).
        Equal to :meth:`forward` up to float rounding.

        Shapes:
            ``x: [N, in_dim]`` -> ``([N, out_dim], [N, out_dim])``.
        """
        return torch.mm(x, self.lin_l.weight.t()), torch.addmm(self.lin_l.bias, x, self.lin_r.weight.t())

    def forward_projected(self, table: Tensor, nbr_rows: Tensor, nbr_valid: Tensor, self_rows: Tensor) -> Tensor:
        """The layer from projected inputs (:meth:`project`) stacked in one table:
        ``mean_{j: nbr_valid[b, j]} table[nbr_rows[b, j]] + table[self_rows[b]]`` for target ``b``.

        One weighted ``embedding_bag`` over fixed-size bags: each target's
        neighbours' first projections weighted ``1 / |S(v)|`` (entries not
        valid weigh 0, so they must only be rows of the table), then its own
        second projection weighted 1.

        Shapes:
            ``table: [M, out_dim]``, ``nbr_rows: [B, k]``, ``nbr_valid: [B, k]`` bool, ``self_rows: [B]``
            -> ``[B, out_dim]``.
        """
        if table.dim() != 2 or table.size(1) != self.out_dim:
            raise ValueError(f"{type(self).__name__}: Expected table [M, {self.out_dim}] (got {list(table.shape)})")
        if nbr_rows.dim() != 2 or nbr_valid.shape != nbr_rows.shape or self_rows.shape != nbr_rows.shape[:1]:
            raise ValueError(f"{type(self).__name__}: Expected nbr_rows and nbr_valid [B, k] and self_rows [B] "
                             f"(got {list(nbr_rows.shape)}, {list(nbr_valid.shape)} and {list(self_rows.shape)})")
        if self_rows.numel() == 0:
            return table.new_zeros((0, self.out_dim))
        count = nbr_valid.sum(dim=1, keepdim=True).clamp(min=1).to(table.dtype)
        rows = torch.cat([nbr_rows, self_rows.unsqueeze(1)], dim=1)
        weights = torch.cat([nbr_valid.to(table.dtype) / count, table.new_ones((len(self_rows), 1))], dim=1)
        return F.embedding_bag(rows, table, mode="sum", per_sample_weights=weights)

    def _combine(self, mean: Tensor, x_self: Tensor) -> Tensor:
        """``lin_l(mean) + lin_r(x_self)`` as two accumulating matrix products (no temporary for the sum)."""
        out = torch.addmm(self.lin_l.bias, mean, self.lin_l.weight.t())
        return out.addmm_(x_self, self.lin_r.weight.t())

    def __repr__(self) -> str:
        if self.root_dim != self.in_dim:
            return f"{type(self).__name__}(({self.in_dim}, {self.root_dim}), {self.out_dim})"
        return f"{type(self).__name__}({self.in_dim}, {self.out_dim})"
