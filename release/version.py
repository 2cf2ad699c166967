"""Read ``VERSION.txt`` and normalize it exactly once with :class:`packaging.version.Version`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from release.errors import InvalidVersionInput

__all__ = ["VersionInfo", "normalize_version", "read_version_file", "with_local_label"]

_PYPI_LOCAL_RULE = (
    "PyPI rejects local versions ('+label'); the version specifiers spec says indexes MUST NOT allow them"
)


@dataclass(frozen=True)
class VersionInfo:
    """The raw text of the version file and everything derived from it."""

    raw: str
    version: Version
    source: str = "<string>"

    @property
    def normalized(self) -> str:
        return str(self.version)

    @property
    def is_local(self) -> bool:
        return self.version.local is not None

    def require_release(self) -> None:
        """Raise :class:`InvalidVersionInput` if this version may not be published."""
        if self.is_local:
            raise InvalidVersionInput(
                f"{self.source}: local-version: expected a public version, got {self.normalized!r} "
                f"({_PYPI_LOCAL_RULE})"
            )

    def as_dict(self) -> dict[str, object]:
        return {
            "source": self.source,
            "raw": self.raw,
            "normalized": self.normalized,
            "normalized_from": self.raw if self.raw != self.normalized else None,
            "local": self.version.local,
            "epoch": self.version.epoch,
            "is_prerelease": self.version.is_prerelease,
        }


def normalize_version(raw: str, source: str = "<string>") -> VersionInfo:
    """Parse ``raw`` (already stripped) and return its :class:`VersionInfo`."""
    try:
        version = Version(raw)
    except InvalidVersion as exc:
        raise InvalidVersionInput(
            f"{source}: invalid-version: expected a PEP 440 version, got {raw!r}"
        ) from exc
    return VersionInfo(raw=raw, version=version, source=source)


def read_version_file(path: str | Path) -> VersionInfo:
    """Read a version file: exactly one non-empty line, surrounding whitespace stripped.

    A byte-order mark, undecodable bytes, several non-empty lines or an invalid version
    raise :class:`InvalidVersionInput` naming the file and the offending text.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InvalidVersionInput(f"{path}: cannot read version file: {exc.strerror}") from exc
    if data.startswith(b"\xef\xbb\xbf"):
        raise InvalidVersionInput(
            f"{path}: invalid-version: the file starts with a UTF-8 byte-order mark, got {data[:40]!r}"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidVersionInput(f"{path}: invalid-version: not UTF-8 text, got {data[:40]!r}") from exc
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise InvalidVersionInput(f"{path}: invalid-version: expected one non-empty line, got {text!r}")
    if len(lines) > 1:
        raise InvalidVersionInput(
            f"{path}: ambiguous-version: expected exactly one non-empty line, got {len(lines)}: {lines!r}"
        )
    return normalize_version(lines[0], source=str(path))


def with_local_label(info: VersionInfo, label: str) -> VersionInfo:
    """Append a local label (``+label``, or ``.label`` after an existing local part)."""
    sep = "." if info.is_local else "+"
    combined = normalize_version(f"{info.normalized}{sep}{label}", source=f"{info.source} + {label!r}")
    return VersionInfo(raw=info.raw, version=combined.version, source=info.source)
