"""Wheel file names: parse strictly, format from normalized parts, expand/compress tag sets."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from packaging.tags import Tag, parse_tag
from packaging.utils import (
    BuildTag,
    InvalidWheelFilename,
    NormalizedName,
    canonicalize_name,
    parse_wheel_filename,
)
from packaging.version import Version

__all__ = [
    "WheelName",
    "compress_tags",
    "dist_info_dir",
    "escape_name",
    "expand_tags",
    "format_build_tag",
    "format_wheel_name",
    "parse_build_tag",
    "parse_wheel_name",
    "sorted_tags",
    "validate_project_name",
]

_NAME_RE = re.compile(r"^([A-Z0-9]|[A-Z0-9][A-Z0-9._-]*[A-Z0-9])\Z", re.IGNORECASE)
_BUILD_RE = re.compile(r"^(\d+)(.*)\Z")


def validate_project_name(name: str) -> NormalizedName:
    """Return the canonical form of a valid project name, or raise :class:`ValueError`."""
    if not _NAME_RE.match(name):
        raise ValueError(f"invalid project name: expected letters, digits, '.', '_', '-', got {name!r}")
    return canonicalize_name(name)


def escape_name(name: str) -> str:
    """The file-name component of a project name: normalized, ``-`` replaced by ``_``."""
    return validate_project_name(name).replace("-", "_")


def dist_info_dir(name: str, version: Version, suffix: str = "dist-info") -> str:
    """``{escaped name}-{normalized version}.dist-info`` (or ``.data``)."""
    return f"{escape_name(name)}-{version}.{suffix}"


def sorted_tags(tags: Iterable[Tag]) -> list[Tag]:
    return sorted(set(tags), key=lambda t: (t.interpreter, t.abi, t.platform))


def expand_tags(compressed: str | Iterable[str]) -> frozenset[Tag]:
    """Expand one or more compressed tag strings (``py2.py3-none-any``) to a tag set."""
    items = [compressed] if isinstance(compressed, str) else list(compressed)
    out: set[Tag] = set()
    for item in items:
        parts = item.split("-")
        if len(parts) != 3 or not all(p and all(x for x in p.split(".")) for p in parts):
            raise ValueError(f"invalid tag: expected 'python-abi-platform', got {item!r}")
        out |= parse_tag(item)
    return frozenset(out)


def compress_tags(tags: Iterable[Tag]) -> str:
    """The sorted compressed form; the set must be a cartesian product of its fields."""
    tagset = set(tags)
    if not tagset:
        raise ValueError("empty tag set")
    interps = sorted({t.interpreter for t in tagset})
    abis = sorted({t.abi for t in tagset})
    plats = sorted({t.platform for t in tagset})
    if len(interps) * len(abis) * len(plats) != len(tagset):
        listing = ", ".join(str(t) for t in sorted_tags(tagset))
        raise ValueError(f"tag set is not a cartesian product, cannot name one wheel: {listing}")
    return "-".join(".".join(field) for field in (interps, abis, plats))


def parse_build_tag(text: str) -> BuildTag:
    match = _BUILD_RE.match(text)
    if not match or "-" in text:
        raise ValueError(f"invalid build tag: expected a leading digit, got {text!r}")
    return (int(match.group(1)), match.group(2))


def format_build_tag(build: BuildTag) -> str:
    return f"{build[0]}{build[1]}" if build else ""


@dataclass(frozen=True)
class WheelName:
    """A parsed wheel file name, with the raw components kept for exact comparisons."""

    filename: str
    name: NormalizedName
    version: Version
    build: BuildTag
    tags: frozenset[Tag]
    raw_name: str
    raw_version: str
    raw_build: str

    @property
    def escaped_name(self) -> str:
        return self.name.replace("-", "_")

    @property
    def dist_info(self) -> str:
        return f"{self.escaped_name}-{self.version}.dist-info"

    @property
    def data_dir(self) -> str:
        return f"{self.escaped_name}-{self.version}.data"


def parse_wheel_name(filename: str) -> WheelName:
    """Parse ``filename`` with packaging's strict parser; raise :class:`ValueError` if invalid."""
    try:
        name, version, build, tags = parse_wheel_filename(filename)
    except InvalidWheelFilename as exc:
        raise ValueError(str(exc)) from exc
    parts = filename[: -len(".whl")].split("-")
    raw_build = parts[2] if len(parts) == 6 else ""
    return WheelName(filename, name, version, build, tags, parts[0], parts[1], raw_build)


def format_wheel_name(name: str, version: Version, build: BuildTag, tags: Iterable[Tag]) -> str:
    """``{name}-{version}[-{build}]-{tags}.whl`` from normalized parts."""
    fields = [escape_name(name), str(version)]
    if build:
        fields.append(format_build_tag(build))
    fields.append(compress_tags(tags))
    return "-".join(fields) + ".whl"
