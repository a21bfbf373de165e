"""Cold-start policies: how nodes with no features or few neighbours are embedded.

A policy is built from the ``cold_start`` object of a model's
``config.json`` and answers two questions for the engine:

- :meth:`ColdStartPolicy.uses_neighbours` — does node ``v`` aggregate its
  sampled neighbours? When it does not, ``v`` is treated as having an empty
  sample ``S_k(v) = ∅`` at *every* layer: no neighbour rows for ``v`` as a
  target, ``self_count = 0`` for it, and ``nbr_count = 0`` wherever ``v``
  appears as a neighbour of another node (GCN). Other nodes still sample
  ``v`` as usual.
- :meth:`ColdStartPolicy.mode` — the ``mode`` reported with ``v``'s
  embedding (``full`` | ``cold_start`` | ``feature_only``).

``degree`` is always ``|N(v)|``, the size of the node's full (unsampled)
neighbourhood, so the decision is the same at every layer and fanout.

A policy also names each node's *stage* (:meth:`ColdStartPolicy.stages`):
``STAGE_NONE`` (an empty sample at every layer), ``STAGE_EXPANDED`` (the
two-hop sample of docs/design.md, "Staged cold start") or ``STAGE_FULL`` (the
plain sample). Only the staged policy reads a node's age ``T - first(v)``.

Policies::

    {"policy": "plain"}                              # the default: the docs/design.md contract
    {"policy": "feature_only", "min_neighbours": 3}  # ignore neighbours below 3
    {"policy": "staged", "feature_only_s": 86400, "expand_s": 259200, "min_neighbours": 3}
                                                     # by age: features only, then two hops while sparse, then full
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from gnnstream.model.exceptions import InvalidModelConfig, UnknownColdStartPolicy

__all__ = [
    "MODE_FULL",
    "MODE_COLD_START",
    "MODE_FEATURE_ONLY",
    "ColdStartPolicy",
    "PlainPolicy",
    "FeatureOnlyPolicy",
    "StagedPolicy",
    "MODE_EXPANDED",
    "STAGE_NONE",
    "STAGE_EXPANDED",
    "STAGE_FULL",
    "policy_from_config",
    "POLICIES",
]

logger = logging.getLogger(__name__)

MODE_FULL = "full"
MODE_COLD_START = "cold_start"
MODE_FEATURE_ONLY = "feature_only"
MODE_EXPANDED = "expanded"
STAGE_NONE, STAGE_EXPANDED, STAGE_FULL = 0, 1, 2


class ColdStartPolicy(ABC):
    """Base class of cold-start policies."""

    name: ClassVar[str]
    by_age: ClassVar[bool] = False  # whether stages depend on a node's age (the staged policy)

    @property
    def age_marks(self) -> tuple[float, ...]:
        """The ages at which a node's stage can change with no event naming it (none unless :attr:`by_age`)."""
        return ()

    def stages(self, degree: np.ndarray, age: np.ndarray) -> np.ndarray:
        """The stage of many nodes (``STAGE_*`` as int8) from ``|N(v)|`` and ``age(v)``."""
        return np.where(self.uses_neighbours_many(np.asarray(degree)), STAGE_FULL, STAGE_NONE).astype(np.int8)

    def stage_mode(self, has_features: bool, degree: int, stage: int) -> str:
        """The ``mode`` of a node in ``stage`` (the stage decides it only for :attr:`by_age` policies)."""
        return self.mode(has_features, degree)

    @abstractmethod
    def uses_neighbours(self, degree: int) -> bool:
        """Return whether a node with ``|N(v)| = degree`` aggregates its sampled neighbours."""

    @abstractmethod
    def mode(self, has_features: bool, degree: int) -> str:
        """Return the ``mode`` published with the node's embedding."""

    def uses_neighbours_many(self, degree: np.ndarray) -> np.ndarray:
        """:meth:`uses_neighbours` of many nodes at once (a bool array)."""
        return np.fromiter((self.uses_neighbours(d) for d in np.asarray(degree).tolist()), dtype=bool,
                           count=len(degree))

    @abstractmethod
    def to_config(self) -> dict[str, Any]:
        """Return the JSON object that :func:`policy_from_config` turns back into this policy."""


@dataclass(frozen=True)
class PlainPolicy(ColdStartPolicy):
    """The plain contract of docs/design.md: every node aggregates its sample.

    A node without features has a zero input vector and is reported as
    ``cold_start``; every other node as ``full``.
    """

    name: ClassVar[str] = "plain"

    def uses_neighbours(self, degree: int) -> bool:
        """Always ``True``."""
        return True

    def uses_neighbours_many(self, degree: np.ndarray) -> np.ndarray:
        return np.ones(len(degree), dtype=bool)

    def mode(self, has_features: bool, degree: int) -> str:
        """``full`` if the node has features, else ``cold_start``."""
        return MODE_FULL if has_features else MODE_COLD_START

    def to_config(self) -> dict[str, Any]:
        """``{"policy": "plain"}``."""
        return {"policy": self.name}


@dataclass(frozen=True)
class FeatureOnlyPolicy(ColdStartPolicy):
    """Nodes with fewer than ``min_neighbours`` neighbours use their own features only.

    Such a node is treated as having an empty sample at every layer (see the
    module docstring) and is reported as ``feature_only``; other nodes follow
    :class:`PlainPolicy`.

    Args:
        min_neighbours: the smallest ``|N(v)|`` at which neighbours are used.
    """

    min_neighbours: int = 1
    name: ClassVar[str] = "feature_only"

    def __post_init__(self) -> None:
        m = self.min_neighbours
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise InvalidModelConfig(
                f"cold_start.min_neighbours must be an integer >= 1 (got {m!r}); "
                f"use {{\"policy\": \"plain\"}} to always use neighbours"
            )

    def uses_neighbours(self, degree: int) -> bool:
        """``degree >= min_neighbours``."""
        return degree >= self.min_neighbours

    def uses_neighbours_many(self, degree: np.ndarray) -> np.ndarray:
        return np.asarray(degree) >= self.min_neighbours

    def mode(self, has_features: bool, degree: int) -> str:
        """``feature_only`` below ``min_neighbours``, else as :class:`PlainPolicy`."""
        if degree < self.min_neighbours:
            return MODE_FEATURE_ONLY
        return MODE_FULL if has_features else MODE_COLD_START

    def to_config(self) -> dict[str, Any]:
        """``{"policy": "feature_only", "min_neighbours": m}``."""
        return {"policy": self.name, "min_neighbours": self.min_neighbours}


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
        raise InvalidModelConfig(f"cold_start.{name} must be a number of seconds >= 0 (got {value!r})")
    return value


@dataclass(frozen=True)
class StagedPolicy(ColdStartPolicy):
    """Stages a node by its age ``T - first(v)`` (docs/design.md, "Staged cold start").

    Below ``feature_only_s`` a node samples nothing; below ``expand_s`` and
    with fewer than ``min_neighbours`` neighbours it is *expanded*: at each
    layer it samples the bottom-k of its neighbours and their plain samples;
    otherwise it follows the plain contract. ``mode`` is ``cold_start`` for a
    node without features, else ``feature_only``, ``expanded`` or ``full``.

    Args:
        feature_only_s: the age up to which a node uses its own features only.
        expand_s: the age up to which a sparse node is expanded (``>= feature_only_s``).
        min_neighbours: the neighbour count from which a node is no longer expanded.
    """

    feature_only_s: float = 0
    expand_s: float = 0
    min_neighbours: int = 1
    name: ClassVar[str] = "staged"
    by_age: ClassVar[bool] = True

    def __post_init__(self) -> None:
        f, e = _seconds("feature_only_s", self.feature_only_s), _seconds("expand_s", self.expand_s)
        if e < f:
            raise InvalidModelConfig(f"cold_start.expand_s ({e}) must be >= cold_start.feature_only_s ({f})")
        m = self.min_neighbours
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise InvalidModelConfig(f"cold_start.min_neighbours must be an integer >= 0 (got {m!r})")

    @property
    def age_marks(self) -> tuple[float, ...]:
        return (float(self.feature_only_s), float(self.expand_s))

    def uses_neighbours(self, degree: int) -> bool:
        """Whether some stage reads neighbours: always (the stage decides, :meth:`stages`)."""
        return True

    def stages(self, degree: np.ndarray, age: np.ndarray) -> np.ndarray:
        degree, age = np.asarray(degree), np.asarray(age, dtype=np.float64)
        out = np.full(len(degree), STAGE_FULL, dtype=np.int8)
        out[(age < self.expand_s) & (degree < self.min_neighbours)] = STAGE_EXPANDED
        out[age < self.feature_only_s] = STAGE_NONE
        return out

    def stage_mode(self, has_features: bool, degree: int, stage: int) -> str:
        if not has_features:
            return MODE_COLD_START
        return (MODE_FEATURE_ONLY, MODE_EXPANDED, MODE_FULL)[stage]

    def mode(self, has_features: bool, degree: int) -> str:
        """The mode of a node past its first stages (its age decides the rest: :meth:`stage_mode`)."""
        return MODE_FULL if has_features else MODE_COLD_START

    def to_config(self) -> dict[str, Any]:
        return {"policy": self.name, "feature_only_s": self.feature_only_s, "expand_s": self.expand_s,
                "min_neighbours": self.min_neighbours}


POLICIES: dict[str, type[ColdStartPolicy]] = {
    PlainPolicy.name: PlainPolicy,
    FeatureOnlyPolicy.name: FeatureOnlyPolicy,
    StagedPolicy.name: StagedPolicy,
}


def policy_from_config(config: Mapping[str, Any] | None) -> ColdStartPolicy:
    """Build a policy from a config's ``cold_start`` object.

    Args:
        config: ``{"policy": name, **options}``; ``None`` means plain.

    Returns:
        The policy.

    Raises:
        UnknownColdStartPolicy: if the name is not one of :data:`POLICIES`.
        InvalidModelConfig: if the object is malformed or has unknown options.
    """
    if config is None:
        return PlainPolicy()
    if not isinstance(config, Mapping) or "policy" not in config:
        raise InvalidModelConfig(
            f"cold_start must be an object with a \"policy\" key, e.g. {{\"policy\": \"plain\"}} (got {config!r})"
        )
    name = config["policy"]
    options = {k: v for k, v in config.items() if k != "policy"}
    if name not in POLICIES:
        raise UnknownColdStartPolicy(
            f"unknown cold_start policy {name!r}; set cold_start.policy to one of {sorted(POLICIES)}"
        )
    if name == PlainPolicy.name:
        allowed: set[str] = set()
    elif name == StagedPolicy.name:
        allowed = {"feature_only_s", "expand_s", "min_neighbours"}
        missing = sorted(allowed - set(options))
        if missing:
            raise InvalidModelConfig(f"cold_start policy 'staged' needs {missing}, e.g. {{\"policy\": \"staged\", "
                                     f"\"feature_only_s\": 86400, \"expand_s\": 259200, \"min_neighbours\": 3}}")
    else:
        allowed = {"min_neighbours"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise InvalidModelConfig(
            f"cold_start policy {name!r} has unknown option(s) {unknown}; "
            f"allowed: {sorted(allowed) or 'none'}"
        )
    return POLICIES[name](**options)
