"""Archive path safety and zip-bomb limits shared by the wheel and sdist checks."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Limits", "check_path"]

_DRIVE_RE = re.compile(r"^[A-Za-z]:")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class Limits:
    """Zip-bomb guards on declared (and hence enforced) uncompressed sizes."""

    max_total_size: int = 16 << 30
    max_ratio: float = 200.0
    ratio_min_size: int = 1 << 20
    max_members: int = 200_000


def check_path(name: str) -> str | None:
    """Why an archive path is unsafe, or ``None``."""
    if "\\" in name:
        return "contains a backslash"
    if name.startswith("/"):
        return "is absolute"
    if _DRIVE_RE.match(name):
        return "has a drive letter"
    if "\x00" in name:
        return "contains NUL"
    if _CONTROL_RE.search(name):
        return "contains a control character"
    parts = name.rstrip("/").split("/")
    if ".." in parts:
        return "contains '..'"
    if any(p in ("", ".") for p in parts):
        return "is not normalized (empty or '.' component)"
    return None
