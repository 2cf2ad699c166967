"""RECORD files: parse (row-indexed errors), hash streams, serialize (LF, sorted as written)."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "STRONG_ALGORITHMS",
    "Hash",
    "RecordEntry",
    "RecordParseError",
    "parse_record",
    "serialize_record",
]

# sha256 or stronger (the binary distribution format forbids md5 and sha1).
STRONG_ALGORITHMS = frozenset({"sha256", "sha384", "sha512", "sha3_256", "sha3_384", "sha3_512", "blake2b"})


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
        if not sep or not name or not value:
            raise ValueError(f"expected 'algorithm=digest', got {text!r}")
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
        try:
            parsed_size = int(size) if size else None
        except ValueError:
            raise ValueError(f"size: expected an integer, got {size!r}") from None
        if parsed_size is not None and parsed_size < 0:
            raise ValueError(f"size: expected >= 0, got {parsed_size}")
        return cls(path, parsed_hash, parsed_size)

    def to_row(self) -> tuple[str, str, str]:
        return (
            self.path,
            str(self.hash) if self.hash else "",
            str(self.size) if self.size is not None else "",
        )


def parse_record(data: bytes) -> list[RecordEntry]:
    """Parse RECORD bytes (UTF-8, ``\\n`` or ``\\r\\n``); raise naming the first bad row."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecordParseError(f"RECORD is not UTF-8: {exc}") from None
    entries = []
    for index, row in enumerate(csv.reader(io.StringIO(text, newline="")), start=1):
        if not row:
            continue
        if len(row) != 3:
            raise RecordParseError(f"row {index}: expected 3 fields, got {len(row)}: {row!r}")
        try:
            entries.append(RecordEntry.from_elements(*row))
        except ValueError as exc:
            raise RecordParseError(f"row {index} ({row[0]!r}): {exc}") from None
    return entries


def serialize_record(entries: Iterable[RecordEntry]) -> bytes:
    """CSV with ``\\n`` line ends and minimal quoting, in the given (archive) order."""
    buf = io.StringIO(newline="")
    writer = csv.writer(buf, lineterminator="\n", quoting=csv.QUOTE_MINIMAL)
    for entry in entries:
        writer.writerow(entry.to_row())
    return buf.getvalue().encode("utf-8")
