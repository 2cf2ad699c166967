"""Minimal, byte-preserving editing of ``METADATA`` and ``WHEEL`` header blocks.

Only the header block (up to the first blank line) is parsed; the body (the long
description) is never decoded or re-encoded, so its bytes stay identical.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from packaging.tags import Tag

__all__ = [
    "add_headers",
    "get_all",
    "get_first",
    "parse_headers",
    "render_wheel_file",
    "replace_header",
    "split_header_block",
]


def split_header_block(data: bytes) -> tuple[list[bytes], bytes]:
    """Return the header lines (with their line ends) and the remaining bytes."""
    lines = data.splitlines(keepends=True)
    for index, line in enumerate(lines):
        if line in (b"\n", b"\r\n"):
            return lines[:index], b"".join(lines[index:])
    return lines, b""


def _fields(lines: Sequence[bytes]) -> list[tuple[int, int, str, str]]:
    """``(first line, end line, key, unfolded value)`` for each header field."""
    out: list[tuple[int, int, str, str]] = []
    for index, raw in enumerate(lines):
        line = raw.decode("utf-8").rstrip("\r\n")
        if line[:1] in (" ", "\t") and out:
            start, _, key, value = out[-1]
            out[-1] = (start, index + 1, key, value + "\n" + line.strip())
            continue
        key, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"header line {index + 1}: expected 'Key: value', got {line!r}")
        out.append((index, index + 1, key.strip(), value.strip()))
    return out


def parse_headers(data: bytes) -> list[tuple[str, str]]:
    """All header fields as ``(key, value)`` in file order (keys as written)."""
    lines, _ = split_header_block(data)
    return [(key, value) for _, _, key, value in _fields(lines)]


def get_all(data: bytes, key: str) -> list[str]:
    return [v for k, v in parse_headers(data) if k.lower() == key.lower()]


def get_first(data: bytes, key: str) -> str | None:
    values = get_all(data, key)
    return values[0] if values else None


def _line_end(lines: Sequence[bytes]) -> bytes:
    return b"\r\n" if lines and lines[0].endswith(b"\r\n") else b"\n"


def replace_header(data: bytes, key: str, value: str) -> bytes:
    """Replace the single ``key`` field; every other byte stays as it was."""
    lines, body = split_header_block(data)
    matches = [f for f in _fields(lines) if f[2].lower() == key.lower()]
    if len(matches) != 1:
        raise ValueError(f"expected exactly one {key!r} header, got {len(matches)}")
    start, end, _, _ = matches[0]
    eol = _line_end(lines)
    new = [*lines[:start], f"{key}: {value}".encode() + eol, *lines[end:]]
    return b"".join(new) + body


def add_headers(data: bytes, key: str, values: Iterable[str]) -> bytes:
    """Append ``key: value`` fields not already present (idempotent) at the header end."""
    lines, body = split_header_block(data)
    present = {v for k, v in parse_headers(data) if k.lower() == key.lower()}
    eol = _line_end(lines)
    extra = []
    for value in values:
        if value not in present:
            present.add(value)
            extra.append(f"{key}: {value}".encode() + eol)
    if not extra:
        return data
    if lines and not lines[-1].endswith(b"\n"):
        lines = [*lines[:-1], lines[-1] + eol]
    return b"".join([*lines, *extra]) + body


def render_wheel_file(original: bytes, tags: Iterable[Tag], build: str) -> bytes:
    """A WHEEL file keeping the original non-tag fields, then one ``Tag`` per tag, then ``Build``."""
    kept = [(k, v) for k, v in parse_headers(original) if k.lower() not in ("tag", "build")]
    ordered = sorted(set(tags), key=lambda t: (t.interpreter, t.abi, t.platform))
    lines = [f"{k}: {v}" for k, v in kept]
    lines += [f"Tag: {t}" for t in ordered]
    if build:
        lines.append(f"Build: {build}")
    return ("\n".join(lines) + "\n").encode("utf-8")
