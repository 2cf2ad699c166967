"""Byte-level surgery on valid test archives: locate records and patch fields, names and data.

Deliberately independent of ``release.zipread`` (the code under test): it parses only the
well-formed archives the tests write, then breaks them on purpose.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

# field -> (offset in the record, width in bytes)
LOCAL_FIELDS = {
    "version": (4, 2), "flags": (6, 2), "method": (8, 2), "time": (10, 2), "date": (12, 2),
    "crc": (14, 4), "csize": (18, 4), "usize": (22, 4), "name_len": (26, 2), "extra_len": (28, 2),
}  # fmt: skip
CENTRAL_FIELDS = {
    "made_by": (4, 2), "version": (6, 2), "flags": (8, 2), "method": (10, 2), "time": (12, 2),
    "date": (14, 2), "crc": (16, 4), "csize": (20, 4), "usize": (24, 4), "name_len": (28, 2),
    "extra_len": (30, 2), "comment_len": (32, 2), "disk": (34, 2), "iattr": (36, 2),
    "eattr": (38, 4), "offset": (42, 4),
}  # fmt: skip
EOCD_FIELDS = {
    "disk": (4, 2), "cd_disk": (6, 2), "n_disk": (8, 2), "count": (10, 2), "cd_size": (12, 4),
    "cd_offset": (16, 4), "comment_len": (20, 2),
}  # fmt: skip


@dataclass
class Record:
    """One local or central header: where it starts and where its name and extra are."""

    start: int
    name: bytes
    extra_len: int
    fixed: int  # 30 (local) or 46 (central)

    @property
    def name_at(self) -> int:
        return self.start + self.fixed

    @property
    def end(self) -> int:
        return self.name_at + len(self.name) + self.extra_len


class Layout:
    """Where everything is in a well-formed archive (no comment, members in any order)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.eocd = data.rindex(b"PK\x05\x06")
        count, _, cd_offset = struct.unpack_from("<HII", data, self.eocd + 10)
        self.cd_offset = cd_offset
        self.central: dict[bytes, Record] = {}
        self.local: dict[bytes, Record] = {}
        self.order: list[bytes] = []
        pos = cd_offset
        for _ in range(count):
            n_name, n_extra, n_comment = struct.unpack_from("<HHH", data, pos + 28)
            name = data[pos + 46 : pos + 46 + n_name]
            self.central[name] = Record(pos, name, n_extra + n_comment, 46)
            (offset,) = struct.unpack_from("<I", data, pos + 42)
            l_name, l_extra = struct.unpack_from("<HH", data, offset + 26)
            self.local[name] = Record(offset, data[offset + 30 : offset + 30 + l_name], l_extra, 30)
            self.order.append(name)
            pos += 46 + n_name + n_extra + n_comment

    def data_span(self, name: bytes) -> tuple[int, int]:
        rec = self.local[name]
        (csize,) = struct.unpack_from("<I", self.data, self.central[name].start + 20)
        return rec.end, rec.end + csize

    def get(self, kind: str, name: bytes, field: str) -> int:
        rec, fields = self._where(kind, name)
        off, width = fields[field]
        return int.from_bytes(self.data[rec.start + off : rec.start + off + width], "little")

    def _where(self, kind: str, name: bytes) -> tuple[Record, dict[str, tuple[int, int]]]:
        return (self.local[name], LOCAL_FIELDS) if kind == "local" else (self.central[name], CENTRAL_FIELDS)


def patch(data: bytes, kind: str, name: bytes, field: str, value: int) -> bytes:
    """Set ``field`` of ``name``'s local, central or ``both`` headers (or ``eocd``) to ``value``."""
    layout = Layout(data)
    out = bytearray(data)
    if kind == "eocd":
        off, width = EOCD_FIELDS[field]
        out[layout.eocd + off : layout.eocd + off + width] = (value % (1 << 8 * width)).to_bytes(
            width, "little"
        )
        return bytes(out)
    for k in ("local", "central") if kind == "both" else (kind,):
        rec, fields = layout._where(k, name)
        off, width = fields[field]
        out[rec.start + off : rec.start + off + width] = (value % (1 << 8 * width)).to_bytes(width, "little")
    return bytes(out)


def rename(data: bytes, old: bytes, new: bytes, kind: str = "both") -> bytes:
    """Same-length rename in the local, central or ``both`` headers."""
    assert len(old) == len(new)
    layout = Layout(data)
    out = bytearray(data)
    for k in ("local", "central") if kind == "both" else (kind,):
        rec = layout._where(k, old)[0]
        out[rec.name_at : rec.name_at + len(new)] = new
    return bytes(out)


def replace_stored(data: bytes, name: bytes, content: bytes) -> bytes:
    """Overwrite a stored member's bytes in place (same length) and fix its CRC in both headers."""
    layout = Layout(data)
    start, end = layout.data_span(name)
    assert layout.get("central", name, "method") == 0 and end - start == len(content)
    out = data[:start] + content + data[end:]
    return patch(out, "both", name, "crc", zlib.crc32(content))


def member_bytes(data: bytes, name: bytes) -> bytes:
    start, end = Layout(data).data_span(name)
    return data[start:end]


def insert(data: bytes, at: int, junk: bytes) -> bytes:
    """Insert ``junk`` at byte ``at`` and shift every offset behind it (a gap, not a break)."""
    layout = Layout(data)
    out = bytearray(data[:at] + junk + data[at:])
    shift = len(junk)
    for rec in layout.central.values():
        (offset,) = struct.unpack_from("<I", data, rec.start + 42)
        if offset >= at:
            struct.pack_into("<I", out, rec.start + 42 + (shift if rec.start >= at else 0), offset + shift)
    eocd = layout.eocd + (shift if layout.eocd >= at else 0)
    if layout.cd_offset >= at:
        struct.pack_into("<I", out, eocd + 16, layout.cd_offset + shift)
    return bytes(out)


def set_comment(data: bytes, comment: bytes) -> bytes:
    """Give the archive a comment (the end record's comment field)."""
    eocd = Layout(data).eocd
    return data[: eocd + 20] + struct.pack("<H", len(comment)) + comment
