"""Errors raised while building, loading and saving models.

Every message names the object at fault (a path, a config key, a state-dict
key) and says what the operator should do about it.
"""

from __future__ import annotations

__all__ = [
    "ModelError",
    "InvalidModelConfig",
    "UnknownArchitecture",
    "UnknownColdStartPolicy",
    "ModelDirNotFound",
    "ModelFileMissing",
    "ModelDirExists",
    "ChecksumMismatch",
    "CorruptWeights",
    "WeightsMismatch",
]


class ModelError(Exception):
    """Base class of every error of the ``model`` package."""


class InvalidModelConfig(ModelError, ValueError):
    """A model config (``config.json`` or :class:`~gnnstream.model.config.ModelConfig`) is invalid."""


class UnknownArchitecture(InvalidModelConfig):
    """The config names an architecture other than ``sage``, ``gcn`` or ``gat``."""


class UnknownColdStartPolicy(InvalidModelConfig):
    """The config's ``cold_start`` names a policy that does not exist."""


class ModelDirNotFound(ModelError, FileNotFoundError):
    """The model directory does not exist or is not a directory."""


class ModelFileMissing(ModelError, FileNotFoundError):
    """``config.json`` or ``weights.pt`` is missing from a model directory."""


class ModelDirExists(ModelError, FileExistsError):
    """A model directory already holds a model and overwriting was not asked for."""


class ChecksumMismatch(ModelError):
    """``weights.pt`` does not hash to the ``weights_sha256`` recorded in ``config.json``."""


class CorruptWeights(ModelError):
    """``weights.pt`` cannot be read as a state dict of tensors."""


class WeightsMismatch(ModelError):
    """The state dict does not fit the architecture and dims of the config."""
