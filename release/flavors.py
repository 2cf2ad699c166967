"""The flavor table (``flavors.json``): which wheels the core wheel is repacked into.

The core wheel itself (``thd-kernels``, what ``pip install thd-kernels`` takes) is the default;
each flavor is an alternative distribution of the same code with its own name, tags and extra
requirements (``pip install thd-kernels-cu12`` instead of ``thd-kernels``, never beside it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from release.errors import ReleaseError
from release.wheelname import expand_tags, validate_project_name

__all__ = ["DEFAULT_FLAVORS", "Flavor", "FlavorTable", "load_flavors"]

DEFAULT_FLAVORS = Path(__file__).with_name("flavors.json")
_KEYS = {"extra", "name", "tags", "requires"}
_TOP_KEYS = {"default", "flavors"}


@dataclass(frozen=True)
class Flavor:
    """One repacked distribution: its short name (``extra``), name, tags and added requirements."""

    extra: str
    name: str
    tags: str
    requires: tuple[str, ...]


@dataclass(frozen=True)
class FlavorTable:
    default: str  # the flavor ``make wheel`` builds
    flavors: tuple[Flavor, ...]

    def get(self, extra: str) -> Flavor:
        for flavor in self.flavors:
            if flavor.extra == extra:
                return flavor
        raise ReleaseError(f"unknown flavor {extra!r}: expected one of {[f.extra for f in self.flavors]}")


def load_flavors(path: str | Path = DEFAULT_FLAVORS) -> FlavorTable:
    """Load and validate the flavor table; every problem raises :class:`ReleaseError`."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        unknown = set(data) - _TOP_KEYS
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}, expected {sorted(_TOP_KEYS)}")
        flavors = []
        for index, item in enumerate(data["flavors"]):
            unknown = set(item) - _KEYS
            if unknown:
                raise ValueError(
                    f"flavors[{index}]: unknown keys {sorted(unknown)}, expected {sorted(_KEYS)}"
                )
            validate_project_name(item["name"])
            expand_tags(item["tags"])
            reqs = tuple(str(Requirement(r)) for r in item.get("requires", []))
            flavors.append(Flavor(str(item["extra"]), item["name"], item["tags"], reqs))
        table = FlavorTable(data["default"], tuple(flavors))
    except (OSError, KeyError, TypeError, ValueError, InvalidRequirement) as exc:
        raise ReleaseError(f"{path}: invalid flavor table: {exc}") from exc
    names = [canonicalize_name(f.name) for f in table.flavors]
    if len(set(names)) != len(names):
        raise ReleaseError(f"{path}: flavor names must be unique: {names}")
    table.get(table.default)
    return table
