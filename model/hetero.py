"""A GraphSAGE over a typed graph, as PyG's ``to_hetero(GraphSAGE((-1, -1), hidden, L, out_channels=out),
metadata, aggr="sum")`` builds it, run one layer and one node type at a time.

For a node ``v`` of type ``t`` at layer ``l``::

    h^{l+1}_v = Σ_{ρ = (s, r, t)} [ lin_l^ρ(mean_{u ∈ S_ρ(v)} h^l_u) + lin_r^ρ(h^l_v) ]

over the edge types ``ρ`` reaching ``t`` (:meth:`GraphSchema.inbound`), ReLU
between the layers and none after the last. Layer ``l`` of edge type ``ρ`` is a
:class:`SAGELayer` keyed ``convs.{l}.{s}__{r}__{t}`` as ``to_hetero`` keys it,
so a state dict trained with PyG loads as is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gnnstream.model.schema import EdgeType, GraphSchema, edge_type_name
from gnnstream.model.sage import SAGELayer

__all__ = ["HeteroSAGE", "RelationInputs"]

# one edge type's inputs to a layer: (edge type, the source type's input table, the rows of that table
# sampled by each target grouped by target, the sample size of each target)
RelationInputs = tuple[EdgeType, Tensor, Tensor, Tensor]


class HeteroSAGE(nn.Module):
    """Layers of a typed GraphSAGE over ``schema``.

    Args:
        schema: the graph's node types and relations.
        hidden_dim: width of the hidden layers.
        out_dim: embedding dimension (every node type).
        num_layers: number of layers.
    """

    arch = "sage"
    heads = 1

    def __init__(self, schema: GraphSchema, hidden_dim: int, out_dim: int, num_layers: int) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"Expected num_layers >= 1 (got {num_layers})")
        self.schema = schema
        self.edge_types = schema.edge_types()
        widths = [dict(schema.node_types)]
        for l in range(num_layers):
            width = out_dim if l == num_layers - 1 else hidden_dim
            widths.append({t: width for t in schema.type_names})
        self.widths = widths
        # by node type, the edge types whose messages its nodes send (a projection plane each, :meth:`project`)
        self.outbound = {t: [e for e in self.edge_types if e[0] == t] for t in schema.type_names}
        self.planes = 1 + max(len(out) for out in self.outbound.values())
        self._roots: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
        self.convs = nn.ModuleList(
            nn.ModuleDict({edge_type_name(e): SAGELayer(widths[l][e[0]], widths[l + 1][e[2]], root_dim=widths[l][e[2]])
                           for e in self.edge_types})
            for l in range(num_layers))

    @property
    def num_layers(self) -> int:
        return len(self.convs)

    def layer(self, l: int, node_type: str, x_self: Tensor, inputs: Sequence[RelationInputs]) -> Tensor:
        """Layer ``l`` (and its ReLU unless it is the last) for targets of ``node_type``.

        Args:
            l: layer number in ``[0, num_layers)``.
            node_type: the targets' type.
            x_self: the targets' own layer-``l`` inputs ``[B, width]``.
            inputs: one :data:`RelationInputs` per edge type reaching ``node_type`` (each at most once; a
                missing one counts as empty samples).

        Returns:
            ``[B, widths[l + 1]]``.
        """
        if not 0 <= l < self.num_layers:
            raise ValueError(f"Expected a layer number in [0, {self.num_layers}) (got {l})")
        given = {e: (table, rows, count) for e, table, rows, count in inputs}
        stray = [e for e in given if e not in self.schema.inbound(node_type)]
        if stray:
            raise ValueError(f"edge type(s) {stray} do not reach node type {node_type!r}")
        if torch.is_grad_enabled():  # training: each edge type's layer as to_hetero runs it
            empty = torch.zeros(x_self.size(0), dtype=torch.long, device=x_self.device)
            out = None
            for e in self.schema.inbound(node_type):
                conv = self.convs[l][edge_type_name(e)]
                table, rows, count = given.get(e, (x_self.new_zeros((0, conv.in_dim)), empty[:0], empty))
                h = conv.forward_indexed(x_self, table, rows, count, empty[:0])
                out = h if out is None else out + h
            assert out is not None  # every node type of a valid schema is reached by an edge type
        else:  # serving: the edge types' root terms summed into one matrix product (equal up to rounding)
            weight, bias = self._root(l, node_type)
            out = torch.addmm(bias, x_self, weight.t())
            for e in self.schema.inbound(node_type):
                if e in given:
                    conv = self.convs[l][edge_type_name(e)]
                    table, rows, count = given[e]
                    out.addmm_(conv.mean_indexed(table, rows, count), conv.lin_l.weight.t())
        return out.relu() if l < self.num_layers - 1 else out

    def projects(self, l: int) -> bool:
        """Whether layer ``l`` runs from projected inputs (:meth:`project`, :meth:`layer_projected`): every
        layer does."""
        return True

    @torch.no_grad()
    def project(self, l: int, node_type: str, x: Tensor) -> list[Tensor]:
        """Layer ``l``'s :attr:`planes` projections of the inputs ``x`` of nodes of ``node_type``: the root
        term ``Σ_ρ (W_r^ρ x + b_l^ρ)`` over the edge types reaching the type, then ``W_l^ρ x`` for each edge
        type ``ρ`` of :attr:`outbound` (the type's order), zeros past them.

        The layer is linear before its activation, so a target's
        ``h^{l+1}`` is its root plane plus, per edge type ``ρ``, the mean of
        its neighbours' planes of ``ρ`` (:meth:`layer_projected`); equal to
        :meth:`layer` up to float rounding.

        Shapes:
            ``x: [N, widths[l][node_type]]`` -> :attr:`planes` of ``[N, widths[l + 1][t]]``.
        """
        weight, bias = self._root(l, node_type)
        out = [torch.addmm(bias, x, weight.t())]
        out += [torch.mm(x, self.convs[l][edge_type_name(e)].lin_l.weight.t()) for e in self.outbound[node_type]]
        return out + [torch.zeros_like(out[0]) for _ in range(self.planes - len(out))]

    @torch.no_grad()
    def layer_projected(self, l: int, table: Tensor, rows: Tensor, weights: Tensor, offsets: Tensor) -> Tensor:
        """Layer ``l`` (and its ReLU unless it is the last) from projected inputs (:meth:`project`) stacked in
        ``table``: target ``b`` is ``Σ_j weights[j] · table[rows[j]]`` over its bag ``j ∈ [offsets[b],
        offsets[b + 1])`` (its root plane weighing 1, each neighbour's plane of an edge type ``1 / |S_ρ(v)|``),
        one ``embedding_bag``.

        Shapes:
            ``table: [M, width]``, ``rows: [E]``, ``weights: [E]``, ``offsets: [B]`` -> ``[B, width]``.
        """
        out = F.embedding_bag(rows, table, offsets, mode="sum", per_sample_weights=weights)
        return out.relu_() if l < self.num_layers - 1 else out

    def _root(self, l: int, node_type: str) -> tuple[Tensor, Tensor]:
        """``(Σ_ρ W_r^ρ, Σ_ρ b_l^ρ)`` over the edge types reaching ``node_type`` at layer ``l``, kept while the
        module is in eval mode (:meth:`train` forgets them)."""
        held = self._roots.get((l, node_type))
        if held is None or self.training:
            convs = [self.convs[l][edge_type_name(e)] for e in self.schema.inbound(node_type)]
            held = (sum(c.lin_r.weight for c in convs).detach(), sum(c.lin_l.bias for c in convs).detach())
            if not self.training:
                self._roots[(l, node_type)] = held
        return held

    def train(self, mode: bool = True) -> "HeteroSAGE":
        self._roots.clear()
        return super().train(mode)

    def forward(self, x: Mapping[str, Tensor],
                edge_index: Mapping[EdgeType, Tensor] | Sequence[Mapping[EdgeType, Tensor]]) -> dict[str, Tensor]:
        """Embed every node of a typed graph from its sampled edge lists: the from-scratch computation.

        Args:
            x: features of every node, by type (``[N_t, width_t]``).
            edge_index: sampled edges by edge type (row 0 the neighbour of type ``s``, row 1 the target of type
                ``t``, one column per ``u ∈ S_ρ(v)``), one mapping for every layer or a sequence of one per layer.

        Returns:
            The output embedding of every node, by type.
        """
        layers = [edge_index] * self.num_layers if isinstance(edge_index, Mapping) else list(edge_index)
        if len(layers) != self.num_layers:
            raise ValueError(f"Expected {self.num_layers} edge-list mappings (got {len(layers)})")
        h = dict(x)
        for l, edges in enumerate(layers):
            out = {}
            for t in self.schema.type_names:
                inputs = []
                for e in self.schema.inbound(t):
                    pairs = edges.get(e)
                    if pairs is None or pairs.numel() == 0:
                        continue
                    order = torch.argsort(pairs[1], stable=True)
                    count = torch.bincount(pairs[1], minlength=h[t].size(0))
                    inputs.append((e, h[e[0]], pairs[0][order], count))
                out[t] = self.layer(l, t, h[t], inputs)
            h = out
        return h

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(node_types={self.schema.type_names}, edge_types={len(self.edge_types)}, "
                f"widths={[next(iter(w.values())) for w in self.widths[1:]]})")
