"""Model directories: ``config.json`` + ``weights.pt``, loaded and saved with checks.

A model directory holds::

    config.json   the ModelConfig, including the sha256 of weights.pt
    weights.pt    a state dict (``torch.save``), keys as PyG's BasicGNN models

Loading verifies the checksum, reads the weights with
``torch.load(..., weights_only=True)`` (no code runs) and checks every key
and shape against the config before anything is loaded. Saving validates
first, then writes both files atomically (temporary file + rename).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gnnstream.model.coldstart import ColdStartPolicy
from gnnstream.model.config import ModelConfig
from gnnstream.model.exceptions import (
    ChecksumMismatch,
    CorruptWeights,
    InvalidModelConfig,
    ModelDirExists,
    ModelDirNotFound,
    ModelFileMissing,
    WeightsMismatch,
)
from gnnstream.model.hetero import HeteroSAGE
from gnnstream.model.network import GNN

__all__ = [
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "LoadedModel",
    "load_model_dir",
    "save_model_dir",
    "init_model_dir",
    "check_state_dict",
    "file_sha256",
    "build_network",
]

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "weights.pt"


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for inference.

    Attributes:
        config: the validated config.
        model: the network, in eval mode, with the directory's weights.
        path: the directory it was loaded from.
    """

    config: ModelConfig
    model: GNN | HeteroSAGE
    path: Path

    @property
    def cold_start(self) -> ColdStartPolicy:
        """The model's cold-start policy."""
        return self.config.cold_start_policy


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Return the hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def build_network(config: ModelConfig) -> GNN | HeteroSAGE:
    """A freshly initialised network for ``config``: :class:`HeteroSAGE` for a typed model, else :class:`GNN`."""
    schema = config.graph_schema
    if schema is not None:
        return HeteroSAGE(schema, config.hidden_dim, config.out_dim, config.num_layers)
    return GNN.from_config(config)


def check_state_dict(config: ModelConfig, state_dict: Mapping[str, Any]) -> None:
    """Check that a state dict has exactly the keys and shapes the config implies.

    Raises:
        WeightsMismatch: naming the first missing/unexpected key or the key
            whose shape differs, with the expected and actual shapes.
    """
    with torch.device("meta"):  # shapes only: no memory, no draw from the caller's RNG
        expected = build_network(config).state_dict()
    dims = (f"arch={config.arch!r}, in_dim={config.in_dim}, hidden_dim={config.hidden_dim}, "
            f"out_dim={config.out_dim}, num_layers={config.num_layers}, heads={config.heads}")
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if missing or unexpected:
        raise WeightsMismatch(
            f"state dict does not match config ({dims}): missing keys {missing}, unexpected keys "
            f"{unexpected}; check arch and num_layers in config.json, or re-export the weights "
            f"from a PyG GraphSAGE/GCN/GAT model"
        )
    for key, want in expected.items():
        got = state_dict[key]
        if not isinstance(got, Tensor):
            raise WeightsMismatch(f"state dict entry {key!r} is a {type(got).__name__}, expected a tensor")
        if tuple(got.shape) != tuple(want.shape):
            raise WeightsMismatch(
                f"wrong dims for {key!r}: expected shape {list(want.shape)} from config ({dims}), "
                f"got {list(got.shape)}; fix the dims in config.json to match the weights"
            )


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_model_dir(path: str | os.PathLike[str], config: ModelConfig,
                   state_dict: Mapping[str, Tensor]) -> ModelConfig:
    """Write a model directory (creating it if needed; existing files are replaced).

    Args:
        path: the directory.
        config: the config; its ``weights_sha256`` is ignored and recomputed.
        state_dict: the weights, e.g. ``pyg_model.state_dict()``.

    Returns:
        The config as written, with ``weights_sha256`` set.

    Raises:
        WeightsMismatch: if the state dict does not fit the config.
    """
    check_state_dict(config, state_dict)
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items()}
    weights_path = directory / WEIGHTS_FILE
    tmp = weights_path.with_name(f".{WEIGHTS_FILE}.tmp")
    torch.save(weights, tmp)
    os.replace(tmp, weights_path)
    written = config.with_sha256(file_sha256(weights_path))
    text = json.dumps(written.to_dict(), indent=2, sort_keys=True) + "\n"
    _write_atomic(directory / CONFIG_FILE, text.encode())
    logger.info("saved model %s to %s (sha256 %s)", written.model_id, directory, written.weights_sha256)
    return written


def load_model_dir(path: str | os.PathLike[str]) -> LoadedModel:
    """Load and verify a model directory.

    Args:
        path: the directory.

    Returns:
        The config and the network (eval mode).

    Raises:
        ModelDirNotFound: the directory does not exist.
        ModelFileMissing: ``config.json`` or ``weights.pt`` is missing.
        InvalidModelConfig: ``config.json`` is not valid (incl. unknown arch
            or cold-start policy, wrong number of fanouts).
        ChecksumMismatch: ``weights.pt`` does not match ``weights_sha256``.
        CorruptWeights: ``weights.pt`` is not a readable state dict.
        WeightsMismatch: the weights do not fit the config's dims.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise ModelDirNotFound(f"model directory {str(directory)!r} does not exist; fix the --model path, or "
                               f"create a model with `gnnstream model init` or `gnnstream train`")
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for file in (config_path, weights_path):
        if not file.is_file():
            raise ModelFileMissing(f"model directory {str(directory)!r} has no {file.name}; a model directory "
                                   f"needs {CONFIG_FILE} and {WEIGHTS_FILE}: create one with `gnnstream model "
                                   f"init` or `gnnstream train` (save_model_dir in Python)")
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidModelConfig(f"{config_path} is not valid JSON ({exc}); fix or regenerate it") from exc
    try:
        config = ModelConfig.from_dict(raw)
    except InvalidModelConfig as exc:
        raise type(exc)(f"{config_path}: {exc}") from exc
    if config.weights_sha256 is None:
        raise InvalidModelConfig(f"{config_path} has no weights_sha256; write the directory with "
                                 f"save_model_dir so the weights can be verified")
    actual = file_sha256(weights_path)
    if actual != config.weights_sha256:
        raise ChecksumMismatch(
            f"{weights_path} has sha256 {actual} but {CONFIG_FILE} expects {config.weights_sha256}; "
            f"the files come from different saves or the weights are damaged - copy the model directory "
            f"again or re-export it with save_model_dir"
        )
    try:
        state_dict = torch.load(weights_path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for unreadable files
        raise CorruptWeights(f"{weights_path} cannot be read as a state dict ({exc}); re-export it with "
                             f"save_model_dir") from exc
    if not isinstance(state_dict, Mapping):
        raise CorruptWeights(f"{weights_path} holds a {type(state_dict).__name__}, not a state dict; "
                             f"save model.state_dict(), not the model")
    try:
        check_state_dict(config, state_dict)
    except WeightsMismatch as exc:
        raise WeightsMismatch(f"{directory}: {exc}") from exc
    with torch.random.fork_rng(devices=[]):  # the init is overwritten; keep the caller's RNG as it was
        model = build_network(config)
    model.load_state_dict(state_dict)
    model.eval()
    logger.info("loaded model %s from %s: %r", config.model_id, directory, model)
    return LoadedModel(config=config, model=model, path=directory)


def init_model_dir(
    path: str | os.PathLike[str],
    arch: str,
    in_dim: int,
    hidden: int,
    out_dim: int,
    layers: int,
    fanouts: list[int] | tuple[int, ...],
    seed: int,
    heads: int = 1,
    name: str = "model",
    version: int = 1,
    cold_start: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> ModelConfig:
    """Create a model directory with randomly initialised weights, seeded with ``seed``.

    The same arguments give the same weights on any machine (CPU init under
    ``torch.manual_seed(seed)``, without touching the caller's RNG state).

    Args:
        path: the directory to create.
        arch, in_dim, hidden, out_dim, layers, fanouts, seed, heads, name,
            version, cold_start: the :class:`ModelConfig` fields
            (``hidden`` = ``hidden_dim``, ``layers`` = ``num_layers``;
            ``cold_start=None`` means ``{"policy": "plain"}``).
        overwrite: replace an existing model in ``path``.

    Returns:
        The config as written.

    Raises:
        ModelDirExists: ``path`` already holds a ``config.json`` and
            ``overwrite`` is false.
        InvalidModelConfig: for invalid arguments.
    """
    config = ModelConfig(
        arch=arch, in_dim=in_dim, hidden_dim=hidden, out_dim=out_dim, num_layers=layers,
        fanouts=tuple(fanouts), seed=seed, heads=heads,
        cold_start=dict(cold_start) if cold_start is not None else {"policy": "plain"},
        name=name, version=version,
    )
    if (Path(path) / CONFIG_FILE).exists() and not overwrite:
        raise ModelDirExists(f"{path} already holds a model; choose another directory, or replace it with "
                             f"--force (overwrite=True in Python)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GNN.from_config(config)
    return save_model_dir(path, config, model.state_dict())
