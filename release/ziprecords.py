"""Zip record layouts and the field rules of the strict reader (names, flags, extra fields).

Each helper raises :class:`ZipFormatError` with the issue code the wheel checks report.
"""

from __future__ import annotations

import re
import struct

__all__ = [
    "CENTRAL",
    "DEFLATED",
    "EOCD",
    "EOCD64",
    "LOCAL",
    "LOCATOR",
    "STORED",
    "ZipFormatError",
    "check_flags",
    "check_method",
    "decode_name",
    "parse_extra",
    "resolve_zip64",
]

LOCAL = struct.Struct("<4sHHHHHIIIHH")  # 30 bytes, then name and extra
CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # 46 bytes, then name, extra, comment
EOCD = struct.Struct("<4sHHHHIIH")  # 22 bytes, then the archive comment
EOCD64 = struct.Struct("<4sQHHIIQQQQ")  # 56 bytes (no extensible data)
LOCATOR = struct.Struct("<4sIQI")  # 20 bytes

SIG_LOCAL = b"PK\x03\x04"
SIG_CENTRAL = b"PK\x01\x02"
SIG_EOCD = b"PK\x05\x06"
SIG_EOCD64 = b"PK\x06\x06"
SIG_LOCATOR = b"PK\x06\x07"

STORED, DEFLATED = 0, 8
U16, U32 = 0xFFFF, 0xFFFFFFFF

_ENCRYPTED = 0x0001
_UTF8 = 0x0800
# Bits 1-2 (deflate level hint, only meaningful for deflate) and 11 (UTF-8 names); every other
# bit is refused: 0 encryption, 3 data descriptor, 5 patched data, 6 strong encryption,
# 13 masked headers, the rest reserved.
_DEFLATE_HINTS = 0x0006
_ZIP64_ID = 0x0001
_CONTROL_RE = re.compile(rb"[\x00-\x1f\x7f]")
_UNICODE_PATH_ID = 0x7075


class ZipFormatError(ValueError):
    """A violation of the strict archive rules: ``code``, where it is, and expected vs got."""

    def __init__(self, code: str, where: str, detail: str) -> None:
        super().__init__(f"{where}: {detail}")
        self.code = code
        self.where = where
        self.detail = detail


def check_flags(flags: int, method: int, where: str) -> None:
    """Refuse encryption, data descriptors, patched data and every reserved bit."""
    if flags & _ENCRYPTED:
        raise ZipFormatError("encrypted-entry", where, "expected an unencrypted member")
    allowed = _UTF8 | (_DEFLATE_HINTS if method == DEFLATED else 0)
    if flags & ~allowed:
        raise ZipFormatError(
            "zip-flags",
            where,
            f"expected general purpose flags within {allowed:#06x} (UTF-8 names, deflate hints), "
            f"got {flags:#06x}; data descriptors (bit 3) and patched data (bit 5) are refused",
        )


def check_method(method: int, where: str) -> None:
    """Only stored (0) and deflate (8): the methods every wheel installer reads."""
    if method not in (STORED, DEFLATED):
        raise ZipFormatError(
            "zip-method", where, f"expected compression method 0 (stored) or 8 (deflate), got {method}"
        )


def decode_name(raw: bytes, flags: int, where: str) -> str:
    """Validate a member name on its raw bytes, then decode it (UTF-8 with bit 11, else ASCII)."""
    if not raw:
        raise ZipFormatError("unsafe-path", where, "expected a member name, got an empty one")
    bad = _CONTROL_RE.search(raw)
    if bad is not None:
        raise ZipFormatError(
            "unsafe-path",
            where,
            f"expected no control characters in the name, got {bad.group()!r} in {raw!r}",
        )
    if flags & _UTF8:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ZipFormatError(
                "name-encoding", where, f"expected UTF-8 (flag bit 11 is set), got {raw!r}"
            ) from None
    if not raw.isascii():
        raise ZipFormatError(
            "name-encoding", where, f"expected ASCII or the UTF-8 flag (bit 11), got {raw!r}"
        )
    return raw.decode("ascii")


def parse_extra(data: bytes, name: str, where: str) -> dict[int, bytes]:
    """Split an extra field block into ``{id: payload}``; it must be exactly tiled, ids unique.

    An Info-ZIP Unicode Path field (0x7075) must name the member exactly as its header does.
    """
    fields: dict[int, bytes] = {}
    pos = 0
    while pos < len(data):
        if len(data) - pos < 4:
            raise ZipFormatError(
                "bad-zip", where, f"expected whole extra fields, got {len(data) - pos} stray bytes"
            )
        ident, size = struct.unpack_from("<HH", data, pos)
        if pos + 4 + size > len(data):
            raise ZipFormatError("bad-zip", where, f"extra field {ident:#06x} runs past the extra block")
        if ident in fields:
            raise ZipFormatError("bad-zip", where, f"expected unique extra fields, got {ident:#06x} twice")
        fields[ident] = data[pos + 4 : pos + 4 + size]
        pos += 4 + size
    unicode_path = fields.get(_UNICODE_PATH_ID)
    if unicode_path is not None and (
        len(unicode_path) < 5 or unicode_path[5:] != name.encode("utf-8") or unicode_path[0] != 1
    ):
        raise ZipFormatError(
            "name-encoding", where, "expected the Unicode Path extra field to repeat the header's name"
        )
    return fields


def resolve_zip64(values: list[int], extra: dict[int, bytes], where: str) -> list[int]:
    """Replace each 32-bit sentinel (the 4th value: 16-bit) by the next zip64 extra value.

    The zip64 field must hold exactly the values that are needed: no more, no less.
    """
    payload = extra.get(_ZIP64_ID, b"")
    if not payload and U32 not in values and (len(values) < 4 or values[3] != U16):
        return values
    out, pos = [], 0
    for index, value in enumerate(values):
        sentinel, width = (U16, 4) if index == 3 else (U32, 8)
        if value != sentinel:
            out.append(value)
            continue
        if pos + width > len(payload):
            raise ZipFormatError(
                "bad-zip", where, f"expected a zip64 extra value for the {value:#x} marker, got none"
            )
        out.append(int.from_bytes(payload[pos : pos + width], "little"))
        pos += width
    if pos != len(payload):
        raise ZipFormatError(
            "bad-zip", where, f"expected {pos} bytes of zip64 extra data, got {len(payload)} (unused values)"
        )
    return out
