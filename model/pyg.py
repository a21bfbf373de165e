"""Model directories from PyTorch Geometric models: a saved ``state_dict`` or a module in memory.

A state dict of ``torch_geometric.nn.GraphSAGE`` / ``GCN`` / ``GAT`` (or of
any module whose parameters are those of its ``SAGEConv`` / ``GCNConv`` /
``GATConv`` layers, e.g. ``self.conv1``, ``self.conv2``) becomes a model
directory whose layers compute exactly what the PyG module computes on the
sampled edge list: ReLU between the layers, none after the last.

What a state dict does not say is given by the caller: the architecture, the
sampling (fanouts, seed), the cold-start policy and the model's name and
version. What it cannot say (SAGE's aggregation, the activation) is taken to
be PyG's default and must be; :func:`import_pyg` checks it on a module in
memory. Anything that would not be served exactly is refused in one line
naming the option: another aggregation, jumping knowledge, normalisation
layers, ``project=True``, ``root_weight=False``, residual or edge features in
GAT, a dropout left on (a module in training mode), layers of another kind.

A typed GraphSAGE, ``to_hetero(GraphSAGE((-1, -1), …), metadata, aggr="sum")``,
imports the same way with its graph schema (:mod:`gnnstream.model.schema`), whose
``metadata()`` is the one ``to_hetero`` was given: its state dict holds a
``SAGEConv`` per layer and edge type, keyed ``PREFIX.{src}__{rel}__{dst}.*``.

Reading a checkpoint never unpickles code (``torch.load(...,
weights_only=True)``) and needs no PyG; only :func:`import_pyg` imports it.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from gnnstream.model.config import ARCHITECTURES, ModelConfig
from gnnstream.model.directory import CONFIG_FILE, save_model_dir
from gnnstream.model.exceptions import CorruptWeights, ModelDirExists, ModelError
from gnnstream.model.schema import GraphSchema, edge_type_name

__all__ = ["UnsupportedModel", "import_checkpoint", "import_state_dict", "import_pyg", "read_checkpoint"]

logger = logging.getLogger(__name__)


class UnsupportedModel(ModelError):
    """The PyG model uses an option the served layers do not compute exactly."""


# the parameters of one conv layer, by suffix; the first names the layer (its prefix is the layer's)
_KEYS = {
    "sage": ("lin_l.weight", "lin_l.bias", "lin_r.weight"),
    "gcn": ("lin.weight", "bias"),
    "gat": ("lin.weight", "att_src", "att_dst", "bias"),
}
_CONV = {"sage": "SAGEConv", "gcn": "GCNConv", "gat": "GATConv"}
# keys that mean an option we cannot serve, by pattern (searched in the key), and what to say
_REFUSED = (
    (r"(^|\.)norms\.\d+\.", "normalisation layers (norm=...)"),
    (r"(^|\.)jk\.", "jumping knowledge (jk=...)"),
    (r"(^|\.)aggr_module\.", "a learnable aggregation (aggr=...); only aggr='mean' is served"),
    (r"(^|\.)lin_src\.|(^|\.)lin_dst\.", "bipartite input channels (in_channels given as a tuple)"),
    (r"(^|\.)lin_edge\.|(^|\.)att_edge$", "edge features (edge_dim=...)"),
    (r"(^|\.)res\.", "residual=True"),
    (r"(^|\.)att$", "GATv2Conv (v2=True); only GATConv is served"),
)


def _refusal(key: str) -> str | None:
    for pattern, what in _REFUSED:
        if re.search(pattern, key):
            return what
    return None


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Read a state dict saved with ``torch.save(module.state_dict(), path)``; no code is unpickled.

    Raises:
        CorruptWeights: the file cannot be read, or holds something other than a state dict.
    """
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CorruptWeights(f"checkpoint {str(path)!r} does not exist; name the file written with "
                             f"torch.save(model.state_dict(), PATH)") from None
    except Exception as exc:  # torch raises many types for files it cannot read safely
        raise CorruptWeights(f"checkpoint {str(path)!r} cannot be read as a state dict ({exc}); save "
                             f"model.state_dict() with torch.save, not the model") from exc
    if not isinstance(data, Mapping):
        raise CorruptWeights(f"checkpoint {str(path)!r} holds a {type(data).__name__}, not a state dict; "
                             f"save model.state_dict() with torch.save")
    bad = next((k for k, v in data.items() if not isinstance(v, Tensor)), None)
    if bad is not None:
        raise CorruptWeights(f"checkpoint {str(path)!r} entry {bad!r} is a {type(data[bad]).__name__}, not a "
                             f"tensor; save only model.state_dict(), not a dict around it")
    return dict(data)


def _layers(arch: str, state_dict: Mapping[str, Tensor]) -> list[dict[str, Tensor]]:
    """The state dict cut into conv layers in order, every key accounted for."""
    anchor = _KEYS[arch][0]
    prefixes = []
    for key in state_dict:
        if key == anchor or key.endswith("." + anchor):
            prefixes.append(key[: len(key) - len(anchor)])
    layers: list[dict[str, Tensor]] = [{} for _ in prefixes]
    for key, value in state_dict.items():
        what = _refusal(key)
        owner = max((i for i, p in enumerate(prefixes) if key.startswith(p)), key=lambda i: len(prefixes[i]),
                    default=None)
        suffix = None if owner is None else key[len(prefixes[owner]):]
        if what is None and arch == "sage" and suffix in ("lin.weight", "lin.bias"):
            what = "project=True"
        if what is None and owner is None and key in ("lin.weight", "lin.bias"):
            what = "jumping knowledge (jk=...), whose output layer this is"
        if what is None and arch == "gat" and suffix in ("lin_l.weight", "lin_r.weight"):
            what = "GATv2Conv (v2=True); only GATConv is served"
        if what is not None:
            raise UnsupportedModel(f"cannot serve the model exactly: key {key!r} means {what}; retrain without it")
        if owner is None or suffix not in _KEYS[arch]:
            raise UnsupportedModel(
                f"cannot serve the model exactly: key {key!r} is no parameter of a {_CONV[arch]} layer (expected "
                f"PREFIX.{', PREFIX.'.join(_KEYS[arch])}); import the module whose output is the embedding, with "
                f"only {_CONV[arch]} layers (check --arch)")
        layers[owner][suffix] = value
    if not layers:
        raise UnsupportedModel(f"the state dict has no {_CONV[arch]} layer (no key ending in {anchor!r}); check "
                               f"--arch (one of {list(ARCHITECTURES)})")
    return layers


def _shape_error(l: int, what: str) -> UnsupportedModel:
    return UnsupportedModel(f"cannot serve the model exactly: layer {l} {what}")


def _convert(arch: str, layers: list[dict[str, Tensor]]) -> tuple[dict[str, Tensor], dict[str, int]]:
    """Our state dict (``convs.{l}.*``, missing biases as zeros) and the dims it implies."""
    out: dict[str, Tensor] = {}
    widths: list[int] = []
    heads = 1
    last = len(layers) - 1
    for l, p in enumerate(layers):
        if arch == "sage":
            if "lin_r.weight" not in p:
                raise _shape_error(l, "has no lin_r: root_weight=False; retrain with root_weight=True")
            w = p["lin_l.weight"]
            bias = p.get("lin_l.bias", w.new_zeros(w.size(0)))
            out.update({f"convs.{l}.lin_l.weight": w, f"convs.{l}.lin_l.bias": bias,
                        f"convs.{l}.lin_r.weight": p["lin_r.weight"]})
            width = w.size(0)
        elif arch == "gcn":
            w = p["lin.weight"]
            out.update({f"convs.{l}.lin.weight": w, f"convs.{l}.bias": p.get("bias", w.new_zeros(w.size(0)))})
            width = w.size(0)
        else:
            if "att_src" not in p or "att_dst" not in p:
                raise _shape_error(l, "has no att_src/att_dst; is it a GATConv?")
            w, att = p["lin.weight"], p["att_src"]
            layer_heads, channels = int(att.shape[1]), int(att.shape[2])
            if l and layer_heads != heads:
                raise _shape_error(l, f"has {layer_heads} heads, layer 0 has {heads}; every layer needs the same heads")
            heads = layer_heads
            concat = l < last
            bias = p.get("bias")
            if bias is not None and heads > 1 and bias.numel() != (heads * channels if concat else channels):
                option = "concat=False on a hidden layer" if concat else "concat=True on the last layer"
                raise _shape_error(l, f"uses {option}; hidden layers concatenate their heads and the last "
                                      f"averages them (as torch_geometric.nn.GAT)")
            width = heads * channels if concat else channels
            if bias is None:
                bias = w.new_zeros(width)
            out.update({f"convs.{l}.lin.weight": w, f"convs.{l}.att_src": att, f"convs.{l}.att_dst": p["att_dst"],
                        f"convs.{l}.bias": bias})
        if l and w.size(1) != widths[-1]:
            raise _shape_error(l, f"takes {w.size(1)} inputs but layer {l - 1} gives {widths[-1]}; with "
                                  f"heads concatenated unless it is the last layer")
        widths.append(width)
    in_dim = int(layers[0]["lin_l.weight" if arch == "sage" else "lin.weight"].size(1))
    hidden = widths[:-1]
    if len(set(hidden)) > 1:
        raise UnsupportedModel(f"cannot serve the model exactly: hidden layers of different widths {hidden}; "
                               f"every hidden layer needs one width (hidden_channels)")
    dims = {"in_dim": in_dim, "hidden_dim": hidden[0] if hidden else widths[-1], "out_dim": widths[-1],
            "num_layers": len(layers), "heads": heads}
    return out, dims


def _convert_hetero(schema: GraphSchema, state_dict: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, int]]:
    """Our state dict (``convs.{l}.{edge type}.*``) of a ``to_hetero`` GraphSAGE and the dims it implies."""
    names = {edge_type_name(e): e for e in schema.edge_types()}
    prefixes: list[str] = []
    layers: list[dict[str, dict[str, Tensor]]] = []
    for key, value in state_dict.items():
        what = _refusal(key)
        if what is not None:
            raise UnsupportedModel(f"cannot serve the model exactly: key {key!r} means {what}; retrain without it")
        parts = key.split(".")
        at = next((i for i, part in enumerate(parts) if "__" in part), None)
        suffix = ".".join(parts[at + 1:]) if at is not None else ""
        if at is None or parts[at] not in names or suffix not in _KEYS["sage"]:
            hint = (f"edge type {parts[at]!r} is not one of the schema's {sorted(names)} (after ToUndirected)"
                    if at is not None and parts[at] not in names else
                    f"expected PREFIX.SRC__REL__DST.{{{', '.join(_KEYS['sage'])}}}")
            raise UnsupportedModel(f"cannot serve the model exactly: key {key!r} is no parameter of a typed "
                                   f"GraphSAGE's SAGEConv layers: {hint}")
        prefix = ".".join(parts[:at])
        if prefix not in prefixes:
            prefixes.append(prefix)
            layers.append({})
        layers[prefixes.index(prefix)].setdefault(parts[at], {})[suffix] = value
    if not layers:
        raise UnsupportedModel("the state dict has no typed SAGEConv layer")
    out: dict[str, Tensor] = {}
    widths = dict(schema.node_types)
    for l, convs in enumerate(layers):
        missing = sorted(set(names) - set(convs))
        if missing:
            raise _shape_error(l, f"has no SAGEConv for edge type(s) {missing}; train the model with "
                                  f"to_hetero(..., metadata) of this schema, after ToUndirected()")
        out_width = set()
        for name, p in convs.items():
            src, _, dst = names[name]
            if "lin_r.weight" not in p:
                raise _shape_error(l, f"{name} has no lin_r: root_weight=False; retrain with root_weight=True")
            w = p["lin_l.weight"]
            for what, have, want in (("neighbour", w.size(1), widths[src]), ("root", p["lin_r.weight"].size(1),
                                                                                widths[dst])):
                if have != want:
                    raise _shape_error(l, f"{name} takes {have} {what} inputs but {src if what == 'neighbour' else dst!r}"
                                          f" gives {want}; check the schema's feature widths")
            out_width.add(int(w.size(0)))
            out.update({f"convs.{l}.{name}.lin_l.weight": w,
                        f"convs.{l}.{name}.lin_l.bias": p.get("lin_l.bias", w.new_zeros(w.size(0))),
                        f"convs.{l}.{name}.lin_r.weight": p["lin_r.weight"]})
        if len(out_width) > 1:
            raise _shape_error(l, f"has outputs of widths {sorted(out_width)}; every edge type's must agree")
        width = out_width.pop()
        widths = {t: width for t in widths}
    last = len(layers) - 1
    hidden = int(out[f"convs.0.{next(iter(names))}.lin_l.weight"].size(0)) if last else next(iter(widths.values()))
    dims = {"in_dim": 0, "hidden_dim": hidden, "out_dim": next(iter(widths.values())), "num_layers": len(layers),
            "heads": 1}
    return out, dims


def import_state_dict(state_dict: Mapping[str, Tensor], out: str | os.PathLike[str], *, arch: str,
                      fanouts: Sequence[int], seed: int = 0, cold_start: Mapping[str, Any] | None = None,
                      name: str = "model", version: int = 1, aggr: str = "mean", act: str = "relu",
                      schema: Mapping[str, Any] | None = None, overwrite: bool = False) -> ModelConfig:
    """Write a model directory from a PyG state dict.

    Args:
        state_dict: ``module.state_dict()`` of a PyG ``GraphSAGE`` / ``GCN`` / ``GAT`` or of a module of
            ``SAGEConv`` / ``GCNConv`` / ``GATConv`` layers (in the order they run).
        out: the model directory to write.
        arch: ``sage`` | ``gcn`` | ``gat``: the kind of conv layers.
        fanouts: the sample size of each layer.
        seed, cold_start, name, version: the :class:`ModelConfig` fields.
        aggr: SAGE's aggregation as the model was built (only ``mean`` is served).
        act: the activation between layers as the model was built (only ``relu`` is served).
        schema: the graph schema (``schema.json`` object) of a ``to_hetero`` GraphSAGE's state dict; None for
            an untyped model.
        overwrite: replace a model already in ``out``.

    Returns:
        The config as written (dims and heads read from the weights).

    Raises:
        UnsupportedModel: for an option that would not be served exactly, naming it.
        InvalidModelConfig: for invalid fanouts, seed, name, version or cold-start policy.
        ModelDirExists: ``out`` holds a model and ``overwrite`` is false.
    """
    if arch not in ARCHITECTURES:
        raise UnsupportedModel(f"unknown arch {arch!r}; use one of {list(ARCHITECTURES)} for SAGEConv, GCNConv or "
                               f"GATConv layers")
    if aggr != "mean":
        raise UnsupportedModel(f"cannot serve the model exactly: aggr={aggr!r}; only aggr='mean' is served")
    if act != "relu":
        raise UnsupportedModel(f"cannot serve the model exactly: act={act!r}; only act='relu' is served")
    if schema is not None:
        if arch != "sage":
            raise UnsupportedModel(f"cannot serve the model exactly: a typed model is served with arch 'sage' only "
                                   f"(got {arch!r})")
        weights, dims = _convert_hetero(GraphSchema.from_dict(schema), state_dict)
    else:
        weights, dims = _convert(arch, _layers(arch, state_dict))
    config = ModelConfig(arch=arch, fanouts=tuple(fanouts), seed=seed,
                         cold_start=dict(cold_start) if cold_start is not None else {"policy": "plain"},
                         name=name, version=version, schema=None if schema is None else dict(schema), **dims)
    if (Path(out) / CONFIG_FILE).exists() and not overwrite:
        raise ModelDirExists(f"{out} already holds a model; choose another directory, or replace it with "
                             f"--force (overwrite=True in Python)")
    written = save_model_dir(out, config, {k: v.float() for k, v in weights.items()})
    logger.info("imported a PyG %s model to %s", _CONV[arch], out)
    return written


def import_checkpoint(path: str | os.PathLike[str], out: str | os.PathLike[str], **options: Any) -> ModelConfig:
    """:func:`import_state_dict` of the state dict saved in ``path`` (read with ``weights_only=True``)."""
    return import_state_dict(read_checkpoint(path), out, **options)


def _check_conv(name: str, conv: nn.Module, training: bool, arch: str, last: bool) -> None:
    def refuse(option: str, fix: str) -> UnsupportedModel:
        return UnsupportedModel(f"cannot serve the model exactly: {name or 'the module'} "
                                f"({type(conv).__name__}) has {option}; {fix}")
    if arch == "sage":
        if conv.aggr != "mean":
            raise refuse(f"aggr={conv.aggr!r}", "only aggr='mean' is served")
        for option, bad in (("normalize", True), ("project", True), ("root_weight", False)):
            if getattr(conv, option) is bad:
                raise refuse(f"{option}={bad}", f"retrain with {option}={not bad}")
    elif arch == "gcn":
        for option, bad in (("improved", True), ("cached", True), ("add_self_loops", False), ("normalize", False)):
            if getattr(conv, option) is bad:
                raise refuse(f"{option}={bad}", f"retrain with {option}={not bad}")
    else:
        for option, bad in (("add_self_loops", False), ("residual", True)):
            if getattr(conv, option, None) is bad:
                raise refuse(f"{option}={bad}", f"retrain with {option}={not bad}")
        if conv.edge_dim is not None:
            raise refuse(f"edge_dim={conv.edge_dim}", "only node features are served")
        if conv.negative_slope != 0.2:
            raise refuse(f"negative_slope={conv.negative_slope}", "only the default 0.2 is served")
        if conv.heads > 1 and conv.concat == last:
            raise refuse(f"concat={conv.concat}", "hidden layers concatenate their heads and the last averages "
                                                  "them (as torch_geometric.nn.GAT)")
        if training and conv.dropout > 0:
            raise refuse(f"dropout={conv.dropout} left on (the module is in training mode)", "call module.eval()")


def import_pyg(module: nn.Module, out: str | os.PathLike[str], *, fanouts: Sequence[int], seed: int = 0,
               cold_start: Mapping[str, Any] | None = None, name: str = "model", version: int = 1,
               overwrite: bool = False) -> ModelConfig:
    """Write a model directory from a PyG module in memory, after checking its config.

    ``module`` is a ``torch_geometric.nn.GraphSAGE`` / ``GCN`` / ``GAT``, or a module whose parameters are all
    those of its ``SAGEConv`` / ``GCNConv`` / ``GATConv`` layers (one kind), run in the order they were
    registered with ReLU between them.

    Raises:
        UnsupportedModel: naming the option that would not be served exactly.
    """
    from torch_geometric.nn import GATConv, GCNConv, SAGEConv
    from torch_geometric.nn.conv import MessagePassing
    from torch_geometric.nn.models.basic_gnn import BasicGNN

    kinds = {SAGEConv: "sage", GCNConv: "gcn", GATConv: "gat"}
    if isinstance(module, BasicGNN):
        kind = type(module).__name__
        if kind not in ("GraphSAGE", "GCN", "GAT"):
            raise UnsupportedModel(f"cannot serve the model exactly: {kind} is not served; use GraphSAGE, GCN or GAT")
        for option, value in (("jk", module.jk_mode), ("norm", module.norm)):
            if value is not None:
                raise UnsupportedModel(f"cannot serve the model exactly: {kind} has {option}={value!r}; retrain "
                                       f"with {option}=None")
        if not isinstance(module.act, nn.ReLU):
            raise UnsupportedModel(f"cannot serve the model exactly: {kind} has act={type(module.act).__name__}; "
                                   f"only act='relu' is served")
        if module.training and module.dropout.p > 0:
            raise UnsupportedModel(f"cannot serve the model exactly: {kind} has dropout={module.dropout.p} left on "
                                   f"(the module is in training mode); call module.eval()")
    convs = [(n, m) for n, m in module.named_modules() if isinstance(m, MessagePassing)]
    other = next(((n, m) for n, m in convs if type(m) not in kinds), None)
    if other is not None:
        raise UnsupportedModel(f"cannot serve the model exactly: {other[0] or 'the module'} is a "
                               f"{type(other[1]).__name__}; only SAGEConv, GCNConv and GATConv layers are served")
    if not convs:
        raise UnsupportedModel("the module has no SAGEConv, GCNConv or GATConv layer")
    arch_of = {kinds[type(m)] for _, m in convs}
    if len(arch_of) > 1:
        raise UnsupportedModel(f"cannot serve the model exactly: the module mixes {sorted(arch_of)} layers; use "
                               f"one kind")
    arch = arch_of.pop()
    for i, (n, m) in enumerate(convs):
        _check_conv(n, m, module.training, arch, last=i == len(convs) - 1)
    return import_state_dict(module.state_dict(), out, arch=arch, fanouts=fanouts, seed=seed,
                             cold_start=cold_start, name=name, version=version, overwrite=overwrite)
