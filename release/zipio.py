"""A small deterministic zip writer (reading is :mod:`release.zipread`'s job).

The writer emits exactly the bytes we ask for: no extra fields besides ZIP64, fixed
version fields, the caller's timestamps and permissions. Unchanged members are copied as
their compressed bytes (no recompression); new members are deflated at a fixed level.
"""

from __future__ import annotations

import struct
import time
import zlib
from dataclasses import dataclass
from typing import BinaryIO

from release.zipread import ZipEntry
from release.ziprecords import DEFLATED, STORED

__all__ = [
    "RawMember",
    "RawSink",
    "ZipWriter",
    "dos_date_time",
    "normalized_mode",
]

_LOCAL_SIG = b"PK\x03\x04"
_U32 = 0xFFFFFFFF
_U16 = 0xFFFF
_FLAG_UTF8 = 0x800
_MIN_DOS_EPOCH = 315532800  # 1980-01-01T00:00:00Z, the earliest zip timestamp


def dos_date_time(epoch: int | None, fallback: tuple[int, ...] = (1980, 1, 1, 0, 0, 0)) -> tuple[int, ...]:
    """UTC date tuple for ``epoch`` (clamped to 1980..2107), or ``fallback`` (1980 if invalid)."""
    if epoch is None:
        dt = tuple(fallback)
        return dt if _valid_date(dt) else (1980, 1, 1, 0, 0, 0)
    epoch = min(max(epoch, _MIN_DOS_EPOCH), 4354819199)
    return tuple(time.gmtime(epoch)[:6])


def _valid_date(dt: tuple[int, ...]) -> bool:
    year, month, day, hour, minute, second = dt
    return (
        1980 <= year <= 2107
        and 1 <= month <= 12
        and 1 <= day <= 31
        and hour < 24
        and minute < 60
        and second < 60
    )


def normalized_mode(external_attr: int) -> int:
    """0o755 if any executable bit is set in the source mode, else 0o644."""
    mode = (external_attr >> 16) & 0o777
    return 0o755 if mode & 0o111 else 0o644


@dataclass
class RawMember:
    """Central-directory facts of one written member."""

    name: str
    method: int
    crc: int
    csize: int
    usize: int
    mode: int
    date_time: tuple[int, ...]
    offset: int


class RawSink:
    """Where the compressed bytes of one copied member go; :meth:`done` checks their count."""

    def __init__(self, fp: BinaryIO, entry: ZipEntry) -> None:
        self._fp = fp
        self._entry = entry
        self.written = 0

    def __call__(self, chunk: bytes) -> None:
        self._fp.write(chunk)
        self.written += len(chunk)

    def done(self) -> None:
        if self.written != self._entry.csize:
            raise ValueError(f"{self._entry.name}: copied {self.written} bytes, expected {self._entry.csize}")


class ZipWriter:
    """Append-only zip writer over a binary file object; call :meth:`close` to finish."""

    def __init__(self, fp: BinaryIO) -> None:
        self._fp = fp
        self._members: list[RawMember] = []
        self._names: set[str] = set()

    @property
    def members(self) -> list[RawMember]:
        """What was written so far, in order."""
        return list(self._members)

    def _start(
        self, name: str, method: int, crc: int, csize: int, usize: int, mode: int, date_time: tuple[int, ...]
    ) -> None:
        if name in self._names:
            raise ValueError(f"duplicate member {name!r}")
        self._names.add(name)
        member = RawMember(name, method, crc, csize, usize, mode, date_time, self._fp.tell())
        self._members.append(member)
        zip64 = csize >= _U32 or usize >= _U32
        extra = struct.pack("<HHQQ", 1, 16, usize, csize) if zip64 else b""
        encoded, flags = _encode(name)
        dostime, dosdate = _dos(date_time)
        self._fp.write(
            struct.pack(
                "<4sHHHHHIIIHH",
                _LOCAL_SIG,
                45 if zip64 else 20,
                flags,
                method,
                dostime,
                dosdate,
                crc,
                _U32 if zip64 else csize,
                _U32 if zip64 else usize,
                len(encoded),
                len(extra),
            )
            + encoded
            + extra
        )

    def start_raw(self, entry: ZipEntry, name: str, mode: int, date_time: tuple[int, ...]) -> RawSink:
        """Start copying a checked member's compressed bytes unchanged under a (possibly new) name.

        Write the bytes through the returned sink, then call its :meth:`RawSink.done`.
        """
        if entry.method not in (STORED, DEFLATED):
            raise ValueError(f"{entry.name}: unsupported compression method {entry.method}")
        self._start(name, entry.method, entry.crc, entry.csize, entry.usize, mode, date_time)
        return RawSink(self._fp, entry)

    def add_bytes(self, name: str, data: bytes, mode: int, date_time: tuple[int, ...]) -> None:
        """Add an in-memory member, deflated at level 6 (stored if that is not smaller)."""
        comp = zlib.compressobj(6, zlib.DEFLATED, -15)
        packed = comp.compress(data) + comp.flush()
        method = DEFLATED
        if len(packed) >= len(data):
            packed, method = data, STORED
        self._start(name, method, zlib.crc32(data), len(packed), len(data), mode, date_time)
        self._fp.write(packed)

    def close(self) -> None:
        """Write the central directory (ZIP64 records when needed)."""
        cd_start = self._fp.tell()
        for m in self._members:
            fields: list[int] = []
            usize, csize, offset = m.usize, m.csize, m.offset
            if usize >= _U32:
                fields.append(usize)
                usize = _U32
            if csize >= _U32:
                fields.append(csize)
                csize = _U32
            if offset >= _U32:
                fields.append(offset)
                offset = _U32
            extra = struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""
            version = 45 if fields else 20
            encoded, flags = _encode(m.name)
            dostime, dosdate = _dos(m.date_time)
            self._fp.write(
                struct.pack(
                    "<4sBBHHHHHIIIHHHHHII",
                    b"PK\x01\x02",
                    version,
                    3,  # made by: Unix, so external_attr carries the mode
                    version,
                    flags,
                    m.method,
                    dostime,
                    dosdate,
                    m.crc,
                    csize,
                    usize,
                    len(encoded),
                    len(extra),
                    0,
                    0,
                    0,
                    ((0o100000 | m.mode) << 16) & _U32,
                    offset,
                )
                + encoded
                + extra
            )
        cd_end = self._fp.tell()
        count, size = len(self._members), cd_end - cd_start
        if count >= _U16 or size >= _U32 or cd_start >= _U32:
            self._fp.write(
                struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, size, cd_start)
            )
            self._fp.write(struct.pack("<4sIQI", b"PK\x06\x07", 0, cd_end, 1))
        self._fp.write(
            struct.pack(
                "<4sHHHHIIH",
                b"PK\x05\x06",
                0,
                0,
                min(count, _U16),
                min(count, _U16),
                min(size, _U32),
                min(cd_start, _U32),
                0,
            )
        )


def _encode(name: str) -> tuple[bytes, int]:
    try:
        return name.encode("ascii"), 0
    except UnicodeEncodeError:
        return name.encode("utf-8"), _FLAG_UTF8


def _dos(dt: tuple[int, ...]) -> tuple[int, int]:
    return dt[3] << 11 | dt[4] << 5 | dt[5] // 2, (dt[0] - 1980) << 9 | dt[1] << 5 | dt[2]
