"""The schema of a typed graph, as a model declares it: node types with their feature widths, relations
``(src_type, rel, dst_type)`` with their edge-feature widths, and the relation whose transactions are scored.

``schema.json`` (the ``schema`` object of a typed model's ``config.json``)::

    {"node_types": {"account": 6, "merchant": 10, "device": 6},
     "relations": [{"src_type": "account", "rel": "pays", "dst_type": "merchant", "edge_features": 4},
                   {"src_type": "account", "rel": "uses", "dst_type": "device"},
                   {"src_type": "account", "rel": "sends", "dst_type": "account", "edge_features": 1}],
     "scored": {"src_type": "account", "rel": "pays", "dst_type": "merchant"}}

Messages flow as PyG's ``ToUndirected()`` arranges them on ``HeteroData``
(:meth:`GraphSchema.edge_types`): each relation between two types also runs
backwards as ``(dst_type, "rev_" + rel, src_type)``, and a relation within one
type is made symmetric in place. Node ``(type, id)`` is keyed ``type/id`` in
ranks (:meth:`GraphSchema.key`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gnnstream.model.exceptions import InvalidModelConfig

__all__ = ["GraphSchema", "Relation", "EdgeType", "edge_type_name"]

EdgeType = tuple[str, str, str]  # (src_type, rel, dst_type), as PyG's HeteroData names an edge type

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_RELATION_KEYS = {"src_type", "rel", "dst_type", "edge_features"}


def edge_type_name(edge_type: EdgeType) -> str:
    """``src__rel__dst``: how ``to_hetero`` keys an edge type's layers, and the relation in a rank's message."""
    return "__".join(edge_type)


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value) or "__" in value:
        raise InvalidModelConfig(f"schema: {what} must be a name of letters, digits and single underscores, "
                                 f"starting with a letter (got {value!r})")
    return value


def _width(value: Any, what: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InvalidModelConfig(f"schema: {what} must be an integer >= {least} (got {value!r})")
    return value


@dataclass(frozen=True)
class Relation:
    """A declared relation ``src -rel-> dst`` and the width of its edges' features (0: none)."""

    src: str
    rel: str
    dst: str
    edge_features: int = 0

    @property
    def edge_type(self) -> EdgeType:
        return (self.src, self.rel, self.dst)

    @property
    def name(self) -> str:
        return edge_type_name(self.edge_type)


@dataclass(frozen=True)
class GraphSchema:
    """Node types (name -> feature width, sorted by name), relations (in declaration order), and the scored
    relation (or None).

    Raises:
        InvalidModelConfig: from :meth:`from_dict`, for anything that is not a valid schema, in one line.
    """

    node_types: tuple[tuple[str, int], ...]
    relations: tuple[Relation, ...]
    scored: Relation | None = None

    @classmethod
    def from_dict(cls, data: Any) -> GraphSchema:
        """Validate a ``schema.json`` object."""
        if not isinstance(data, Mapping):
            raise InvalidModelConfig(f"schema must be a JSON object (got {type(data).__name__})")
        unknown = sorted(set(data) - {"node_types", "relations", "scored"})
        if unknown:
            raise InvalidModelConfig(f"schema has unknown key(s) {unknown}; allowed: node_types, relations, scored")
        types = data.get("node_types")
        if not isinstance(types, Mapping) or not types:
            raise InvalidModelConfig("schema: node_types must be a non-empty object of type name -> feature width")
        node_types = tuple(sorted((_name(t, "a node type"), _width(w, f"the feature width of {t!r}", 1))
                                  for t, w in types.items()))
        raw = data.get("relations")
        if not isinstance(raw, list) or not raw:
            raise InvalidModelConfig("schema: relations must be a non-empty list of {src_type, rel, dst_type}")
        relations = tuple(cls._relation(r, dict(node_types)) for r in raw)
        schema = cls(node_types, relations)
        names = [r.edge_type for r in relations]
        if len(set(names)) != len(names):
            raise InvalidModelConfig("schema: a relation is declared twice")
        derived = schema.edge_types()
        if len(set(derived)) != len(derived):
            clash = next(e for e in derived if derived.count(e) > 1)
            raise InvalidModelConfig(f"schema: relation {edge_type_name(clash)} is also the reverse of another; "
                                     f"rename it (reverse relations are named rev_REL)")
        lonely = [t for t, _ in node_types if not schema.inbound(t)]
        if lonely:
            raise InvalidModelConfig(f"schema: node type(s) {lonely} are in no relation; declare a relation for "
                                     f"each node type or remove it")
        scored = data.get("scored")
        if scored is not None:
            if not isinstance(scored, Mapping) or set(scored) - {"src_type", "rel", "dst_type"}:
                raise InvalidModelConfig("schema: scored must be {src_type, rel, dst_type} of a declared relation")
            key = (scored.get("src_type"), scored.get("rel"), scored.get("dst_type"))
            match = next((r for r in relations if r.edge_type == key), None)
            if match is None:
                raise InvalidModelConfig(f"schema: scored relation {key} is not declared in relations")
            schema = cls(node_types, relations, match)
        return schema

    @staticmethod
    def _relation(raw: Any, types: dict[str, int]) -> Relation:
        if not isinstance(raw, Mapping) or set(raw) - _RELATION_KEYS or {"src_type", "rel", "dst_type"} - set(raw):
            raise InvalidModelConfig(f"schema: a relation must be {{src_type, rel, dst_type[, edge_features]}} "
                                     f"(got {raw!r})")
        src, dst = raw["src_type"], raw["dst_type"]
        for t in (src, dst):
            if t not in types:
                raise InvalidModelConfig(f"schema: relation {raw.get('rel')!r} names node type {t!r}, which is not "
                                         f"in node_types {sorted(types)}")
        rel = _name(raw["rel"], "a relation")
        if rel.startswith("rev_"):
            raise InvalidModelConfig(f"schema: relation {rel!r} starts with rev_, which names reverse relations; "
                                     f"rename it")
        return Relation(src, rel, dst, _width(raw.get("edge_features", 0), f"edge_features of {rel!r}", 0))

    def to_dict(self) -> dict[str, Any]:
        """The ``schema.json`` object."""
        out: dict[str, Any] = {
            "node_types": dict(self.node_types),
            "relations": [{"src_type": r.src, "rel": r.rel, "dst_type": r.dst, "edge_features": r.edge_features}
                          for r in self.relations]}
        if self.scored is not None:
            out["scored"] = {"src_type": self.scored.src, "rel": self.scored.rel, "dst_type": self.scored.dst}
        return out

    @property
    def type_names(self) -> list[str]:
        return [t for t, _ in self.node_types]

    def edge_types(self) -> list[EdgeType]:
        """The edge types messages flow along, in PyG's order after ``ToUndirected()``: the declared relations,
        then the reverse of each one between two types."""
        out = [r.edge_type for r in self.relations]
        out += [(r.dst, "rev_" + r.rel, r.src) for r in self.relations if r.src != r.dst]
        return out

    def metadata(self) -> tuple[list[str], list[EdgeType]]:
        """``HeteroData.metadata()`` of a graph of this schema after ``ToUndirected()`` (what ``to_hetero`` takes)."""
        return self.type_names, self.edge_types()

    def inbound(self, node_type: str) -> list[EdgeType]:
        """The edge types whose messages reach nodes of ``node_type``, in :meth:`edge_types` order."""
        return [e for e in self.edge_types() if e[2] == node_type]

    @staticmethod
    def key(node_type: str, node_id: str) -> str:
        """Node ``(type, id)`` as it is named in ranks: ``type/id``."""
        return f"{node_type}/{node_id}"
