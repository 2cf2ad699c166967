"""RECORD files: strict parse (row-indexed errors), hashes, serialize (LF, in archive order)."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "STRONG_ALGORITHMS",
    "Hash",
    "RecordEntry",
    "RecordParseError",
    "parse_record",
    "serialize_record",
    "split_row",
]

# sha256 or stronger (the binary distribution format forbids md5 and sha1).
STRONG_ALGORITHMS = frozenset({"sha256", "sha384", "sha512", "sha3_256", "sha3_384", "sha3_512", "blake2b"})


# No zip member name can be longer, so no longer field can name a member.
MAX_FIELD = 0xFFFF
_SIZE_RE = re.compile(r"(0|[1-9][0-9]{0,19})\Z", re.ASCII)
_ALGO_RE = re.compile(r"[A-Za-z0-9_]{1,32}\Z", re.ASCII)
_DIGEST_RE = re.compile(r"[A-Za-z0-9_-]{1,256}\Z", re.ASCII)


class RecordParseError(ValueError):
    """A RECORD row that cannot be parsed; the message names the row."""


@dataclass(frozen=True)
class Hash:
    """``algorithm=urlsafe-b64(digest)`` without padding."""

    name: str
    value: str

    def __str__(self) -> str:
        return f"{self.name}={self.value}"

    @classmethod
    def parse(cls, text: str) -> Hash:
        name, sep, value = text.partition("=")
        if not sep or not _ALGO_RE.fullmatch(name) or not _DIGEST_RE.fullmatch(value):
            raise ValueError(f"expected 'algorithm=urlsafe-base64 digest', got {text[:120]!r}")
        return cls(name, value)

    @classmethod
    def of_digest(cls, name: str, digest: bytes) -> Hash:
        return cls(name, base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii"))

    @classmethod
    def of_bytes(cls, data: bytes, name: str = "sha256") -> Hash:
        return cls.of_digest(name, hashlib.new(name, data).digest())


@dataclass(frozen=True)
class RecordEntry:
    """One RECORD row; ``hash`` and ``size`` are ``None`` on RECORD's own row."""

    path: str
    hash: Hash | None
    size: int | None

    @classmethod
    def from_elements(cls, path: str, hash_: str, size: str) -> RecordEntry:
        if not path:
            raise ValueError("empty path")
        parsed_hash = Hash.parse(hash_) if hash_ else None
        if size and not _SIZE_RE.fullmatch(size):
            raise ValueError(f"size: expected ASCII digits without sign or leading zeros, got {size[:40]!r}")
        return cls(path, parsed_hash, int(size) if size else None)

    def to_row(self) -> tuple[str, str, str]:
        return (
            self.path,
            str(self.hash) if self.hash else "",
            str(self.size) if self.size is not None else "",
        )


def parse_record(data: bytes) -> list[RecordEntry]:
    """Parse RECORD bytes strictly; raise naming the first bad row.

    UTF-8, one row per ``\\n`` or ``\\r\\n`` line, no blank rows, three fields each; a field is
    either plain (no ``"`` or ``,``) or fully quoted with ``""`` escapes; at most
    :data:`MAX_FIELD` characters per field. This is a strict subset of what :mod:`csv` reads,
    so installers see the same rows.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecordParseError(f"RECORD is not UTF-8: {exc}") from None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    entries = []
    for index, line in enumerate(lines, start=1):
        line = line.removesuffix("\r")
        try:
            row = split_row(line)
        except ValueError as exc:
            raise RecordParseError(f"row {index}: {exc}") from None
        if len(row) != 3:
            raise RecordParseError(f"row {index}: expected 3 fields, got {len(row)}: {row!r}"[:300])
        try:
            entries.append(RecordEntry.from_elements(*row))
        except ValueError as exc:
            raise RecordParseError(f"row {index} ({row[0]!r}): {exc}") from None
    return entries


def split_row(line: str) -> list[str]:
    """The fields of one CSV line (see :func:`parse_record` for the accepted subset)."""
    if not line:
        raise ValueError("expected 'path,hash,size', got a blank line")
    if "\r" in line:
        raise ValueError("expected no carriage return inside a row")
    fields: list[str] = []
    pos = 0
    while True:
        if line.startswith('"', pos):
            value, pos = _quoted(line, pos)
        else:
            end = line.find(",", pos)
            end = len(line) if end < 0 else end
            value = line[pos:end]
            if '"' in value:
                raise ValueError(f"expected a quote only around a whole field, got {value[:80]!r}")
            pos = end
        if len(value) > MAX_FIELD:
            raise ValueError(f"expected fields of at most {MAX_FIELD} characters, got {len(value)}")
        fields.append(value)
        if pos == len(line):
            return fields
        pos += 1  # the comma


def _quoted(line: str, pos: int) -> tuple[str, int]:
    parts = []
    pos += 1
    while True:
        quote = line.find('"', pos)
        if quote < 0:
            raise ValueError("expected a closing quote")
        parts.append(line[pos:quote])
        if line.startswith('""', quote):
            parts.append('"')
            pos = quote + 2
            continue
        pos = quote + 1
        if pos < len(line) and line[pos] != ",":
            raise ValueError("expected ',' after a closing quote")
        return "".join(parts), pos


def serialize_record(entries: Iterable[RecordEntry]) -> bytes:
    """CSV with ``\\n`` line ends and minimal quoting, in the given (archive) order."""
    buf = io.StringIO(newline="")
    writer = csv.writer(buf, lineterminator="\n", quoting=csv.QUOTE_MINIMAL)
    for entry in entries:
        writer.writerow(entry.to_row())
    return buf.getvalue().encode("utf-8")
