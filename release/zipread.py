"""Strict zip reader shared by ``verify`` and ``repack``: parses the raw bytes, trusts nothing.

* The end record is the file's last 22 bytes (no archive comment, nothing after it); a zip64
  end record and its locator, when present, sit right before it and agree with it.
* The central directory is contiguous, holds exactly the advertised entries and ends where the
  end records begin; entry comments are refused.
* Local headers tile the file from byte 0 up to the central directory (no leading junk, gaps or
  overlaps), and each repeats its central entry: name bytes, flags, method, CRC and sizes.
* Stored or deflate only; no encryption, data descriptors or patched data; names are checked on
  their raw bytes (:mod:`release.ziprecords`); directory entries declare no data.
* Member data is inflated only through :class:`DataCheck` (:meth:`ZipArchive.iter_data` uses it),
  which checks its exact size, its CRC and that the deflate stream fills the member exactly.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from release.inflate import InflateError, Inflater, crc32, inflate, inflater
from release.ziprecords import (
    CENTRAL,
    DEFLATED,
    EOCD,
    EOCD64,
    LOCAL,
    LOCATOR,
    SIG_CENTRAL,
    SIG_EOCD,
    SIG_EOCD64,
    SIG_LOCAL,
    SIG_LOCATOR,
    STORED,
    U16,
    U32,
    ZipFormatError,
    check_flags,
    check_method,
    decode_name,
    parse_extra,
    resolve_zip64,
)

__all__ = ["CHUNK", "DataCheck", "ZipArchive", "ZipEntry", "ZipFormatError"]

CHUNK = 1 << 20
_UTF8 = 0x0800
_MAX_COMMENT = U16 + EOCD.size
_MAX_DIRECTORY = 256 << 20  # read whole; real wheels need well under 1 KiB per member
ReadAt = Callable[[int, int], bytes]


@dataclass(slots=True)
class ZipEntry:
    """One member as the central directory (checked against its local header) describes it."""

    name: str
    flags: int
    method: int
    crc: int
    csize: int
    usize: int
    dos_time: int
    dos_date: int
    external_attr: int
    offset: int
    data_offset: int = 0

    @property
    def is_dir(self) -> bool:
        return self.name.endswith("/")

    @property
    def date_time(self) -> tuple[int, int, int, int, int, int]:
        d, t = self.dos_date, self.dos_time
        return (d >> 9) + 1980, (d >> 5) & 15, d & 31, t >> 11, (t >> 5) & 63, (t & 31) * 2

    def raw_name(self) -> bytes:
        return self.name.encode("utf-8" if self.flags & _UTF8 else "ascii")


class ZipArchive:
    """An archive that passed every structural rule; member data is read with ``os.pread``."""

    def __init__(self, fd: int, entries: list[ZipEntry]) -> None:
        self._fd = fd
        self.entries = entries

    @classmethod
    def open(cls, path: str | Path, *, max_entries: int = 1_000_000) -> ZipArchive:
        """Parse ``path``; raise :class:`ZipFormatError` (or ``OSError``) on the first violation."""
        fd = os.open(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ZipFormatError("bad-zip", "archive", "expected a regular file")
            return cls(fd, parse_archive(_reader(fd, st.st_size), st.st_size, max_entries))
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ZipArchive:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()

    def iter_raw(self, entry: ZipEntry) -> Iterator[bytes]:
        """The member's compressed bytes, in chunks of at most :data:`CHUNK`."""
        pos, left = entry.data_offset, entry.csize
        while left:
            chunk = os.pread(self._fd, min(CHUNK, left), pos)
            if not chunk:
                raise ZipFormatError("bad-zip", entry.name, "member data is truncated (file changed?)")
            pos += len(chunk)
            left -= len(chunk)
            yield chunk

    def iter_data(self, entry: ZipEntry) -> Iterator[bytes]:
        """The member's bytes; raises at the end unless size, CRC and stream end all match."""
        check = DataCheck(entry)
        crc = 0
        for raw in self.iter_raw(entry):
            for piece in check.inflate(raw):
                crc = crc32(piece, crc)
                yield piece
        check.end(crc)

    def read(self, entry: ZipEntry, limit: int) -> bytes:
        """The whole member (checked like :meth:`iter_data`), at most ``limit`` bytes."""
        if entry.usize > limit:
            raise ZipFormatError("too-large", entry.name, f"expected <= {limit} bytes, got {entry.usize}")
        return b"".join(self.iter_data(entry))


class DataCheck:
    """Inflate one member's compressed chunks as they arrive; :meth:`end` checks what they held.

    The one rule for member data (``verify`` and ``repack`` alike): it inflates to exactly the
    declared size, the deflate stream fills the compressed bytes exactly, and the CRC matches.
    """

    def __init__(self, entry: ZipEntry) -> None:
        self.entry = entry
        self.size = 0
        self._inflater = inflater() if entry.method == DEFLATED else None

    def inflate(self, raw: bytes) -> Iterator[bytes]:
        """The data in ``raw`` (the next compressed chunk), in pieces of at most :data:`CHUNK`."""
        name, inflater = self.entry.name, self._inflater
        try:
            if inflater is not None and inflater.eof:
                raise ZipFormatError("bad-zip", name, "expected no data after the deflate stream")
            for piece in (raw,) if inflater is None else inflate(inflater, raw, CHUNK):
                self.size += len(piece)
                if self.size > self.entry.usize:
                    raise ZipFormatError(
                        "bad-zip", name, f"expected {self.entry.usize} bytes, the data holds more"
                    )
                yield piece
            if inflater is not None:
                _check_consumed(name, inflater)
        except InflateError as exc:
            raise ZipFormatError("bad-zip", name, f"expected deflate data, got {exc}") from None

    def end(self, crc: int) -> None:
        """After the last chunk: the stream is complete, the size exact and ``crc`` the declared one."""
        name = self.entry.name
        if self._inflater is not None and not self._inflater.eof:
            raise ZipFormatError(
                "bad-zip", name, "expected a complete deflate stream, it ends early (size too small?)"
            )
        if self.size != self.entry.usize:
            raise ZipFormatError("bad-zip", name, f"expected {self.entry.usize} bytes, got {self.size}")
        if crc != self.entry.crc:
            raise ZipFormatError("bad-zip", name, f"expected CRC {self.entry.crc:08x}, got {crc:08x}")


def _check_consumed(name: str, engine: Inflater) -> None:
    """After a chunk: every compressed byte belongs to the stream."""
    extra = len(engine.unused_data) + (len(engine.unconsumed_tail) if engine.eof else 0)
    if extra:
        raise ZipFormatError("bad-zip", name, f"expected no data after the deflate stream, got {extra} bytes")
    if engine.unconsumed_tail:
        raise ZipFormatError(
            "bad-zip", name, "expected deflate data, the inflater stops short of the chunk's end"
        )


def _reader(fd: int, size: int) -> ReadAt:
    def read_at(offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > size:
            raise ZipFormatError(
                "bad-zip", "archive", f"expected {length} bytes at offset {offset}, the file has {size}"
            )
        data = b""
        while len(data) < length:
            chunk = os.pread(fd, length - len(data), offset + len(data))
            if not chunk:
                raise ZipFormatError("bad-zip", "archive", "file is truncated (changed while being read?)")
            data += chunk
        return data

    return read_at


def parse_archive(at: ReadAt, size: int, max_entries: int) -> list[ZipEntry]:
    """Entries in central-directory order, each checked against its local header."""
    count, cd_offset, cd_size = _end_records(at, size)
    if count > max_entries:
        raise ZipFormatError("too-large", "archive", f"expected <= {max_entries} members, got {count}")
    if cd_size > _MAX_DIRECTORY:
        raise ZipFormatError(
            "too-large", "central directory", f"expected <= {_MAX_DIRECTORY} bytes, got {cd_size}"
        )
    entries = _central_directory(at(cd_offset, cd_size), count)
    _local_headers(at, entries, cd_offset)
    return entries


def _end_records(at: ReadAt, size: int) -> tuple[int, int, int]:
    """``(entries, central directory offset, size)`` from the end record (and zip64 records)."""
    if size < EOCD.size:
        raise ZipFormatError("bad-zip", "archive", f"expected a zip archive, got {size} bytes")
    end = size - EOCD.size
    sig, disk, cd_disk, n_disk, count, cd_size, cd_offset, comment = EOCD.unpack(at(end, EOCD.size))
    if sig != SIG_EOCD:
        _explain_missing_end(at, size)
    if comment:
        raise ZipFormatError("bad-zip", "end record", f"expected comment length 0 at the end, got {comment}")
    if disk or cd_disk or n_disk != count:
        raise ZipFormatError("bad-zip", "end record", "expected a single-disk archive")
    if end >= LOCATOR.size and at(end - LOCATOR.size, 4) == SIG_LOCATOR:
        count, cd_size, cd_offset, end = _zip64_end(at, end, (count, cd_size, cd_offset))
    if cd_offset + cd_size != end:
        if cd_offset + cd_size < end:
            raise ZipFormatError(
                "zip-outside-data",
                "archive",
                f"expected the end records right after the central directory, got "
                f"{end - cd_offset - cd_size} bytes between them",
            )
        raise ZipFormatError(
            "bad-zip",
            "end record",
            f"central directory (offset {cd_offset}, size {cd_size}) runs past the end records at {end}",
        )
    return count, cd_offset, cd_size


def _zip64_end(at: ReadAt, end: int, values: tuple[int, int, int]) -> tuple[int, int, int, int]:
    _, disk, record, disks = LOCATOR.unpack(at(end - LOCATOR.size, LOCATOR.size))
    expected = end - LOCATOR.size - EOCD64.size
    if disk or disks > 1 or record != expected:
        raise ZipFormatError(
            "bad-zip", "zip64 locator", f"expected the zip64 end record at {expected}, got {record}"
        )
    sig, length, _, _, disk, cd_disk, n_disk, count, cd_size, cd_offset = EOCD64.unpack(
        at(record, EOCD64.size)
    )
    if sig != SIG_EOCD64 or length != EOCD64.size - 12:
        raise ZipFormatError(
            "bad-zip", "zip64 end record", "expected a 56-byte zip64 end record without extensible data"
        )
    if disk or cd_disk or n_disk != count:
        raise ZipFormatError("bad-zip", "zip64 end record", "expected a single-disk archive")
    for label, old, new, sentinel in zip(
        ("entries", "size", "offset"), values, (count, cd_size, cd_offset), (U16, U32, U32), strict=True
    ):
        if old not in (new, sentinel):
            raise ZipFormatError(
                "bad-zip",
                "end record",
                f"expected {label} {new} (zip64 end record) or {sentinel:#x}, got {old}",
            )
    return count, cd_size, cd_offset, record


def _explain_missing_end(at: ReadAt, size: int) -> None:
    """Raise the reason the file does not end with an end record."""
    start = max(0, size - _MAX_COMMENT)
    tail = at(start, size - start)
    pos = tail.rfind(SIG_EOCD)
    if pos < 0 or pos + EOCD.size > len(tail):
        raise ZipFormatError(
            "bad-zip", "archive", "expected a zip archive, got no end-of-central-directory record"
        )
    comment = EOCD.unpack_from(tail, pos)[-1]
    extra = len(tail) - pos - EOCD.size
    if comment == extra:
        raise ZipFormatError(
            "zip-outside-data", "end record", f"expected no archive comment, got {comment} bytes"
        )
    raise ZipFormatError(
        "zip-outside-data", "archive", f"expected nothing after the end record, got {extra} bytes"
    )


def _central_directory(data: bytes, count: int) -> list[ZipEntry]:
    entries: list[ZipEntry] = []
    pos = 0
    for index in range(count):
        where = f"central directory entry {index}"
        if pos + CENTRAL.size > len(data) or data[pos : pos + 4] != SIG_CENTRAL:
            raise ZipFormatError(
                "bad-zip", where, f"expected {count} entries, got a bad header at byte {pos}"
            )
        (_, _, _, flags, method, dos_time, dos_date, crc, csize, usize, n_name, n_extra, n_comment,
         disk, _, external_attr, offset) = CENTRAL.unpack_from(data, pos)  # fmt: skip
        start = pos + CENTRAL.size
        pos = start + n_name + n_extra + n_comment
        if pos > len(data):
            raise ZipFormatError("bad-zip", where, "entry runs past the central directory")
        name = decode_name(data[start : start + n_name], flags, where)
        if n_comment:
            raise ZipFormatError(
                "zip-outside-data", name, f"expected no entry comment, got {n_comment} bytes"
            )
        check_method(method, name)
        check_flags(flags, method, name)
        extra = parse_extra(data[start + n_name : start + n_name + n_extra], name, name)
        usize, csize, offset, disk = resolve_zip64([usize, csize, offset, disk], extra, name)
        if disk:
            raise ZipFormatError("bad-zip", name, f"expected disk 0, got {disk}")
        entries.append(
            ZipEntry(name, flags, method, crc, csize, usize, dos_time, dos_date, external_attr, offset)
        )
    if pos != len(data):
        raise ZipFormatError(
            "zip-outside-data",
            "central directory",
            f"expected {count} entries only, got {len(data) - pos} more bytes",
        )
    return entries


def _local_headers(at: ReadAt, entries: list[ZipEntry], cd_offset: int) -> None:
    """Check that the local records tile ``[0, cd_offset)`` and repeat their central entries.

    Sets each entry's ``data_offset``.
    """
    expected = 0
    for entry in sorted(entries, key=lambda e: e.offset):
        name = entry.name
        if entry.offset > expected:
            raise ZipFormatError(
                "zip-outside-data",
                name,
                f"expected its local header at byte {expected}, "
                f"got {entry.offset - expected} unclaimed bytes first",
            )
        if entry.offset < expected:
            raise ZipFormatError(
                "bad-zip",
                name,
                f"local header at {entry.offset} overlaps the previous member (ends at {expected})",
            )
        expected_name = entry.raw_name()
        head = at(entry.offset, max(0, min(LOCAL.size + len(expected_name), cd_offset - entry.offset)))
        if len(head) < LOCAL.size or head[:4] != SIG_LOCAL:
            raise ZipFormatError("bad-zip", name, f"expected a local file header at byte {entry.offset}")
        _, _, flags, method, _, _, crc, csize, usize, n_name, n_extra = LOCAL.unpack_from(head)
        raw = head[LOCAL.size :] if n_name == len(expected_name) else at(entry.offset + LOCAL.size, n_name)
        where = f"{name} (local header)"
        if raw != expected_name:
            raise ZipFormatError(
                "zip-mismatch", where, f"expected the central directory's name {expected_name!r}, got {raw!r}"
            )
        extra = parse_extra(at(entry.offset + LOCAL.size + n_name, n_extra), name, where)
        usize, csize = resolve_zip64([usize, csize], extra, where)
        for label, got, want in (
            ("flags", flags, entry.flags),
            ("compression method", method, entry.method),
            ("CRC", crc, entry.crc),
            ("compressed size", csize, entry.csize),
            ("uncompressed size", usize, entry.usize),
        ):
            if got != want:
                raise ZipFormatError(
                    "zip-mismatch", where, f"expected the central directory's {label} {want}, got {got}"
                )
        if entry.is_dir and entry.usize:
            raise ZipFormatError(
                "zip-directory", name, f"expected a directory entry without data, got {entry.usize} bytes"
            )
        if entry.method == STORED and entry.csize != entry.usize:
            raise ZipFormatError(
                "bad-zip", name, f"stored member: expected equal sizes, got {entry.csize} and {entry.usize}"
            )
        data_offset = entry.offset + LOCAL.size + n_name + n_extra
        expected = data_offset + entry.csize
        entry.data_offset = data_offset
    if expected < cd_offset:
        raise ZipFormatError(
            "zip-outside-data",
            "archive",
            f"expected the central directory right after the last member, "
            f"got {cd_offset - expected} bytes between",
        )
    if expected > cd_offset:
        raise ZipFormatError(
            "bad-zip", "archive", f"member data runs into the central directory ({expected} > {cd_offset})"
        )
