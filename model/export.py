"""The layers' forward pass as TorchScript or ONNX, for serving stacks that sample with our sampler.

The exported graph takes the features of the ``N`` nodes of a sampled
subgraph and one sampled edge list per layer, and returns every node's
embedding::

    inputs   x            float32 [N, in_dim]
             edge_index_0 int64   [2, E_0]   row 0 = neighbour u, row 1 = target v, one column per u ∈ S_{k_0}(v)
             ...
             edge_index_{L-1}
    output   embedding    float32 [N, out_dim]

``N`` and every ``E_l`` are dynamic. The embedding of a target equals the
worker's when the subgraph holds its sampled ``L``-hop neighbourhood: layer
``l``'s edges for every node within ``L-1-l`` sampled hops of a target, at
fanout ``k_l``, and no edges into a node whose cold-start policy ignores its
neighbours. ``sampler.json``, written beside the model file, says how to
sample (seed, fanouts, cold-start policy, the rank formula of
docs/design.md) and names the inputs and output.

The exported forward is :class:`ExportedGNN`: the same math as the layers
(:mod:`gnnstream.model.sage`, :mod:`gnnstream.model.gcn`, :mod:`gnnstream.model.gat`), written with
index_add and scatter_reduce only, so that TorchScript and ONNX (opset 18)
both carry it with dynamic shapes. ``torch.jit.load`` alone loads the
TorchScript file; ONNX export needs the ``onnx`` extra.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gnnstream.model.directory import LoadedModel, load_model_dir
from gnnstream.model.exceptions import ModelError

__all__ = ["FORMATS", "SAMPLER_FILE", "ExportedGNN", "export_model", "sampler_settings"]

logger = logging.getLogger(__name__)

FORMATS = ("torchscript", "onnx")
SAMPLER_FILE = "sampler.json"
OPSET = 18
RANK = "r(v, u) = int.from_bytes(blake2b(f'{seed}:{v}:{u}'.encode(), digest_size=8).digest(), 'big'); S_k(v) = " \
       "the k members of N(v) with the smallest (r(v, u), u); N(v) = {u != v : u->v or v->u}"


class ExportedGNN(nn.Module):
    """The GNN's layers over ``(x, edge_index_0, …)``, with tensor ops only (scriptable, ONNX-exportable).

    Args:
        loaded: the model directory's network; its weights are copied.
    """

    def __init__(self, loaded: LoadedModel) -> None:
        super().__init__()
        gnn = loaded.model
        self.arch: str = loaded.config.arch
        self.num_layers: int = gnn.num_layers
        self.heads: int = loaded.config.heads
        weights: list[Tensor] = []  # per layer: the arch's parameters, flat, in a fixed order
        for conv in gnn.convs:
            if self.arch == "sage":
                weights += [conv.lin_l.weight, conv.lin_l.bias, conv.lin_r.weight]
            elif self.arch == "gcn":
                weights += [conv.lin.weight, conv.bias]
            else:
                weights += [conv.lin.weight, conv.att_src, conv.att_dst, conv.bias]
        self.params = nn.ParameterList([nn.Parameter(w.detach().clone(), requires_grad=False) for w in weights])

    def _sage(self, x: Tensor, src: Tensor, dst: Tensor, w_l: Tensor, b_l: Tensor, w_r: Tensor) -> Tensor:
        n = x.size(0)
        count = torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, dst, torch.ones_like(dst, dtype=x.dtype))
        total = torch.zeros(n, x.size(1), dtype=x.dtype, device=x.device).index_add(0, dst, x.index_select(0, src))
        mean = total / count.clamp(min=1.0).unsqueeze(-1)
        return F.linear(mean, w_l, b_l) + F.linear(x, w_r)

    def _gcn(self, x: Tensor, src: Tensor, dst: Tensor, w: Tensor, b: Tensor) -> Tensor:
        n = x.size(0)
        deg = torch.ones(n, dtype=x.dtype, device=x.device).index_add(0, dst, torch.ones_like(dst, dtype=x.dtype))
        inv = deg.rsqrt()
        h = F.linear(x, w)
        norm = (inv.index_select(0, src) * inv.index_select(0, dst)).unsqueeze(-1)
        out = torch.zeros_like(h).index_add(0, dst, h.index_select(0, src) * norm)
        return out + h * (inv * inv).unsqueeze(-1) + b

    def _gat(self, x: Tensor, src: Tensor, dst: Tensor, w: Tensor, att_src: Tensor, att_dst: Tensor, b: Tensor,
             concat: bool) -> Tensor:
        n, heads, dim = x.size(0), att_src.size(1), att_src.size(2)
        z = F.linear(x, w).view(n, heads, dim)
        a_src = (z * att_src).sum(-1)
        a_dst = (z * att_dst).sum(-1)
        e_self = F.leaky_relu(a_src + a_dst, 0.2)
        e = F.leaky_relu(a_src.index_select(0, src) + a_dst.index_select(0, dst), 0.2)
        index = dst.unsqueeze(-1).expand(-1, heads)
        top = e_self.scatter_reduce(0, index, e, reduce="amax", include_self=True)
        p_self = (e_self - top).exp()
        p = (e - top.index_select(0, dst)).exp()
        denom = p_self.index_add(0, dst, p)
        out = (p_self.unsqueeze(-1) * z).index_add(0, dst, p.unsqueeze(-1) * z.index_select(0, src))
        out = out / denom.unsqueeze(-1)
        out = out.reshape(n, heads * dim) if concat else out.mean(dim=1)
        return out + b

    def forward(self, x: Tensor, edge_index: list[Tensor]) -> Tensor:
        """Every node's embedding from its features and one sampled edge list per layer.

        Shapes:
            ``x: [N, in_dim]``, ``edge_index[l]: [2, E_l]`` -> ``[N, out_dim]``.
        """
        per = {"sage": 3, "gcn": 2, "gat": 4}[self.arch]
        p = [w for w in self.params]
        for l in range(self.num_layers):
            src, dst = edge_index[l][0], edge_index[l][1]
            q = p[l * per:(l + 1) * per]
            if self.arch == "sage":
                x = self._sage(x, src, dst, q[0], q[1], q[2])
            elif self.arch == "gcn":
                x = self._gcn(x, src, dst, q[0], q[1])
            else:
                x = self._gat(x, src, dst, q[0], q[1], q[2], q[3], l < self.num_layers - 1)
            if l < self.num_layers - 1:
                x = x.relu()
        return x


class _Positional(nn.Module):
    """``ExportedGNN`` with the edge lists as separate positional inputs (what ONNX names one by one)."""

    def __init__(self, inner: ExportedGNN) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor, *edge_index: Tensor) -> Tensor:
        return self.inner(x, list(edge_index))


def sampler_settings(loaded: LoadedModel, fmt: str, file: str) -> dict[str, Any]:
    """The JSON written beside an exported model: how to sample its inputs and what they are."""
    cfg = loaded.config
    return {
        "model": cfg.model_id, "format": fmt, "file": file, "arch": cfg.arch, "weights_sha256": cfg.weights_sha256,
        "seed": cfg.seed, "fanouts": list(cfg.fanouts), "cold_start": cfg.cold_start, "rank": RANK,
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["N", cfg.in_dim]}]
                  + [{"name": f"edge_index_{l}", "dtype": "int64", "shape": [2, f"E_{l}"], "fanout": k}
                     for l, k in enumerate(cfg.fanouts)],
        "output": {"name": "embedding", "dtype": "float32", "shape": ["N", cfg.out_dim]},
    }


def _example(loaded: LoadedModel) -> tuple[Tensor, list[Tensor]]:
    # distinct tensors of distinct sizes: the exporter would take one tensor given twice for one input
    layers = loaded.config.num_layers
    x = torch.zeros(layers + 4, loaded.config.in_dim)
    edges = [torch.stack([torch.arange(1, l + 4), torch.arange(l + 3) // 2]) for l in range(layers)]
    return x, edges


def export_model(model_dir: str | os.PathLike[str], out: str | os.PathLike[str], fmt: str) -> dict[str, Any]:
    """Write the layers' forward pass of ``model_dir`` to ``out`` (a file), and ``sampler.json`` beside it.

    Args:
        model_dir: a model directory.
        out: the model file to write (``model.pt`` for TorchScript, ``model.onnx`` for ONNX, say).
        fmt: ``torchscript`` | ``onnx``.

    Returns:
        The sampler settings as written, with ``sampler_file``.

    Raises:
        ModelError: an unknown format, or ONNX export without the ``onnx`` extra installed.
    """
    if fmt not in FORMATS:
        raise ModelError(f"unknown export format {fmt!r}; use one of {list(FORMATS)}")
    loaded = load_model_dir(model_dir)
    loaded.config.check_untyped("model export")
    module = ExportedGNN(loaded).eval()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    if fmt == "torchscript":
        torch.jit.save(torch.jit.script(module), str(tmp))
    else:
        try:
            import onnx  # noqa: F401  (the exporter needs it; say so in one line when it is missing)
            import onnxscript  # noqa: F401
        except ImportError as exc:
            raise ModelError(f"ONNX export needs the onnx extra ({exc}); install it with "
                             f"pip install 'gnnstream[onnx]'") from None
        x, edges = _example(loaded)
        names = [f"edge_index_{l}" for l in range(len(edges))]
        dims: dict[str, Any] = {"x": {0: torch.export.Dim("N")}}
        dims.update({name: {1: torch.export.Dim(f"E_{l}")} for l, name in enumerate(names)})
        program = torch.onnx.export(_Positional(module).eval(), (x, *edges), input_names=["x", *names],
                                    output_names=["embedding"], dynamic_shapes=(dims["x"], tuple(dims[n] for n in names)),
                                    opset_version=OPSET, dynamo=True, external_data=False, verbose=False)
        program.save(str(tmp))
    os.replace(tmp, out)
    settings = sampler_settings(loaded, fmt, out.name)
    sampler = out.with_name(SAMPLER_FILE)
    sampler.write_text(json.dumps(settings, indent=2) + "\n")
    logger.info("exported %s as %s to %s", loaded.config.model_id, fmt, out)
    return {**settings, "sampler_file": str(sampler)}
