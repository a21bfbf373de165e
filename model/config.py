"""The model config: the validated content of a model directory's ``config.json``.

Example ``config.json``::

    {"arch": "sage", "in_dim": 16, "hidden_dim": 32, "out_dim": 8,
     "num_layers": 2, "fanouts": [10, 5], "seed": 7, "heads": 1,
     "cold_start": {"policy": "plain"}, "name": "fraud", "version": 3,
     "weights_sha256": "…64 hex digits…"}

A typed model (:mod:`gnnstream.model.hetero`) adds ``"schema"`` (:class:`~gnnstream.model.schema.GraphSchema`)
and sets ``in_dim`` to 0: each node type's input width is in the schema.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from gnnstream.model.coldstart import ColdStartPolicy, policy_from_config
from gnnstream.model.exceptions import InvalidModelConfig, ModelError, UnknownArchitecture
from gnnstream.model.schema import GraphSchema

__all__ = ["ARCHITECTURES", "ModelConfig"]

logger = logging.getLogger(__name__)

ARCHITECTURES = ("sage", "gcn", "gat")

_SHA256 = re.compile(r"[0-9a-f]{64}")
_REQUIRED = ("arch", "in_dim", "hidden_dim", "out_dim", "num_layers", "fanouts", "seed")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ModelConfig:
    """What a model is: architecture, dims, sampling fanouts and identity.

    Args:
        arch: ``sage`` | ``gcn`` | ``gat``.
        in_dim: node feature dimension (0 in a typed model: the schema gives each node type's).
        hidden_dim: width of the hidden layers (ignored when ``num_layers == 1``).
        out_dim: embedding dimension.
        num_layers: number of message-passing layers.
        fanouts: sample size ``k_l`` of each layer (one per layer, ``>= 0``).
        seed: sampling seed.
        heads: attention heads (``gat`` only; 1 otherwise).
        cold_start: the cold-start policy object (see :mod:`gnnstream.model.coldstart`).
        name: model name, published as ``name:version``.
        version: model version.
        weights_sha256: hex sha256 of ``weights.pt``; ``None`` before saving.
        schema: a typed model's graph schema (the ``schema.json`` object); ``None``: untyped.

    Raises:
        UnknownArchitecture: for an ``arch`` other than the three above.
        UnknownColdStartPolicy: for an unknown ``cold_start.policy``.
        InvalidModelConfig: for any other invalid field.
    """

    arch: str
    in_dim: int
    hidden_dim: int
    out_dim: int
    num_layers: int
    fanouts: tuple[int, ...]
    seed: int
    heads: int = 1
    cold_start: dict[str, Any] = field(default_factory=lambda: {"policy": "plain"}, hash=False)
    name: str = "model"
    version: int = 1
    weights_sha256: str | None = None
    schema: dict[str, Any] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise UnknownArchitecture(f"unknown arch {self.arch!r}; set \"arch\" to one of {list(ARCHITECTURES)}")
        if self.schema is not None:
            object.__setattr__(self, "schema", GraphSchema.from_dict(self.schema).to_dict())
            if self.arch != "sage":
                raise InvalidModelConfig(f"a typed model (with a schema) is served with arch 'sage' only (got "
                                         f"{self.arch!r})")
            if self.in_dim != 0:
                raise InvalidModelConfig(f"in_dim must be 0 in a typed model: the schema gives each node type's "
                                         f"feature width (got {self.in_dim!r})")
        for key in ("hidden_dim", "out_dim", "num_layers", "heads") if self.schema is not None else (
                "in_dim", "hidden_dim", "out_dim", "num_layers", "heads"):
            value = getattr(self, key)
            if not _is_int(value) or value < 1:
                raise InvalidModelConfig(f"{key} must be a positive integer (got {value!r})")
        if isinstance(self.fanouts, (str, bytes)) or not hasattr(self.fanouts, "__iter__"):
            raise InvalidModelConfig(f"fanouts must be a list of integers, one per layer (got {self.fanouts!r})")
        object.__setattr__(self, "fanouts", tuple(self.fanouts))
        if len(self.fanouts) != self.num_layers:
            raise InvalidModelConfig(
                f"fanouts has {len(self.fanouts)} entries but num_layers is {self.num_layers}; "
                f"give exactly one fanout per layer"
            )
        if not all(_is_int(k) and k >= 0 for k in self.fanouts):
            raise InvalidModelConfig(f"fanouts must be non-negative integers (got {list(self.fanouts)})")
        if not _is_int(self.seed):
            raise InvalidModelConfig(f"seed must be an integer (got {self.seed!r})")
        if self.arch != "gat" and self.heads != 1:
            raise InvalidModelConfig(f"heads only applies to arch 'gat' (got heads={self.heads} for "
                                     f"arch {self.arch!r}); set heads to 1")
        if self.arch == "gat" and self.num_layers > 1 and self.hidden_dim % self.heads != 0:
            raise InvalidModelConfig(
                f"hidden_dim ({self.hidden_dim}) must be divisible by heads ({self.heads}) for arch 'gat', "
                f"since hidden layers concatenate {self.heads} heads of hidden_dim/heads each"
            )
        policy = policy_from_config(self.cold_start)
        object.__setattr__(self, "cold_start", policy.to_config())
        if not isinstance(self.name, str) or not self.name or ":" in self.name:
            raise InvalidModelConfig(f"name must be a non-empty string without ':' (got {self.name!r})")
        if not _is_int(self.version) or self.version < 0:
            raise InvalidModelConfig(f"version must be a non-negative integer (got {self.version!r})")
        sha = self.weights_sha256
        if sha is not None and (not isinstance(sha, str) or not _SHA256.fullmatch(sha)):
            raise InvalidModelConfig(f"weights_sha256 must be 64 lowercase hex digits (got {sha!r})")

    @property
    def cold_start_policy(self) -> ColdStartPolicy:
        """The :class:`~gnnstream.model.coldstart.ColdStartPolicy` built from ``cold_start``."""
        return policy_from_config(self.cold_start)

    @property
    def graph_schema(self) -> GraphSchema | None:
        """The :class:`GraphSchema` of a typed model; None for an untyped one."""
        return None if self.schema is None else GraphSchema.from_dict(self.schema)

    def check_untyped(self, doing: str) -> None:
        """Refuse a typed model for work that serves untyped graphs only (``doing`` names it).

        Raises:
            ModelError: the model has a schema.
        """
        if self.schema is not None:
            raise ModelError(f"model {self.model_id} is typed (its config.json has a schema); {doing} serves "
                             f"untyped models only: use an untyped model")

    @property
    def model_id(self) -> str:
        """``name:version``, the ``model`` field of published embeddings."""
        return f"{self.name}:{self.version}"

    def with_sha256(self, sha256: str) -> ModelConfig:
        """Return a copy with ``weights_sha256`` set."""
        return replace(self, weights_sha256=sha256)

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON-ready ``config.json`` object."""
        out = asdict(self)
        out["fanouts"] = list(self.fanouts)
        if out["schema"] is None:  # an untyped model's config has no schema
            del out["schema"]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        """Validate a ``config.json`` object.

        Raises:
            InvalidModelConfig: if keys are missing or unknown, or a value is invalid.
        """
        if not isinstance(data, Mapping):
            raise InvalidModelConfig(f"config must be a JSON object (got {type(data).__name__})")
        if data.get("schema") is not None and "in_dim" not in data:
            data = {**data, "in_dim": 0}
        missing = [k for k in _REQUIRED if k not in data]
        if missing:
            raise InvalidModelConfig(f"config is missing required key(s) {missing}; add them to config.json")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidModelConfig(f"config has unknown key(s) {unknown}; allowed keys: {sorted(known)}")
        fanouts = data["fanouts"]
        if not isinstance(fanouts, (list, tuple)):
            raise InvalidModelConfig(f"fanouts must be a list of integers, one per layer (got {fanouts!r})")
        return cls(**{**data, "fanouts": tuple(fanouts)})
