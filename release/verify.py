"""Wheel verification: every check collects issues; :func:`verify_wheel` raises once with all.

Checks: the archive structure (:mod:`release.zipread`, first violation only: nothing else can be
trusted after it); file name grammar; one ``.dist-info`` named like the file; METADATA ``Name``
and ``Version``; WHEEL ``Wheel-Version``, ``Root-Is-Purelib``, expanded ``Tag`` lines,
``Build``; RECORD (strictly parsed, every file once, sha256 or stronger, sizes, hashes of the
data inflated to its exact size and CRC); path safety; size and ratio limits.

:class:`WheelChecker` runs them in two phases: :meth:`~WheelChecker.check_static` (everything but
the member hashes; METADATA, WHEEL and RECORD are read whole and kept) and
:meth:`~WheelChecker.check_member` per member. ``verify`` runs both; ``repack`` runs the same
two on its input, checking each member while it copies it (one pass), so it refuses exactly
what ``verify`` rejects.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from packaging.tags import Tag
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from release.errors import Issue, WheelVerificationError
from release.inflate import crc32
from release.metadata import get_all, get_first
from release.record import STRONG_ALGORITHMS, Hash, RecordEntry, RecordParseError, parse_record
from release.safety import Limits, check_path
from release.wheelname import WheelName, format_build_tag, parse_wheel_name
from release.zipread import DataCheck, ZipArchive, ZipEntry, ZipFormatError

__all__ = [
    "Limits",
    "WheelChecker",
    "WheelReport",
    "check_path",
    "inspect_wheel",
    "verify_wheel",
    "verify_written",
]

_PARALLEL_MIN = 64 << 20  # hash in threads above this many uncompressed bytes
_PIPELINE_MIN = 8 << 20  # members this large are hashed in a helper thread while they inflate
_PIPELINE_DEPTH = 3  # inflated pieces (of at most 1 MiB each) waiting for the helper thread
Issue3 = tuple[str, str, str]
Sink = Callable[[bytes], None]
_MAX_TEXT = 64 << 20  # METADATA, WHEEL and RECORD are read whole; larger ones are refused


@dataclass
class WheelReport:
    """What a verified wheel is; ``warnings`` are findings that do not fail verification."""

    path: Path
    name: str = ""
    display_name: str = ""
    version: str = ""
    build: str = ""
    tags: list[str] = field(default_factory=list)
    dist_info: str = ""
    files: list[str] = field(default_factory=list)
    total_size: int = 0
    record: dict[str, RecordEntry] = field(default_factory=dict)
    sha256: dict[str, str] = field(default_factory=dict)  # member -> digest of its checked data
    warnings: list[Issue] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {
            "wheel": str(self.path),
            "name": self.name,
            "display_name": self.display_name,
            "version": self.version,
            "build": self.build,
            "tags": self.tags,
            "dist_info": self.dist_info,
            "files": len(self.files),
            "uncompressed_size": self.total_size,
            "warnings": [w.as_dict() for w in self.warnings],
        }


class WheelChecker:
    """Every check of one wheel, collecting issues; see the module docstring for the phases."""

    def __init__(
        self,
        path: str | Path,
        *,
        release: bool = False,
        limits: Limits | None = None,
        filename: str | None = None,
    ) -> None:
        self.path = Path(path)
        self.art = filename or self.path.name
        self.release = release
        self.limits = limits or Limits()
        self.issues: list[Issue] = []
        self.report = WheelReport(path=self.path)
        self.texts: dict[str, bytes] = {}  # members read whole (METADATA, WHEEL, RECORD, directories)
        self.expected: dict[str, Hash] = {}  # member -> its RECORD hash, to be checked
        self._name: WheelName | None = None

    def err(self, code: str, where: str, detail: str) -> None:
        self.issues.append(Issue(code, self.art, where, detail))

    def warn(self, code: str, where: str, detail: str) -> None:
        self.report.warnings.append(Issue(code, self.art, where, detail))

    def run(self, check_hashes: bool = True) -> None:
        archive = self.open()
        if archive is None:
            return
        with archive:
            self.check_static(archive)
            if check_hashes:
                self.check_all_members(archive)

    def open(self) -> ZipArchive | None:
        """Check the file name and parse the archive; ``None`` after reporting why it cannot be."""
        if not self.path.is_file():
            got = "a directory" if self.path.is_dir() else "no such file"
            self.err("no-such-file", str(self.path), f"expected a wheel file, got {got}")
            return None
        self._name = self.check_filename()
        try:
            return ZipArchive.open(self.path, max_entries=self.limits.max_members)
        except ZipFormatError as exc:
            self.err(exc.code, exc.where, exc.detail)
        except OSError as exc:
            self.err("bad-zip", "archive", f"expected a readable zip file, got {exc}")
        return None

    def check_static(self, archive: ZipArchive) -> None:
        """Every check but the member hashes, which :attr:`expected` then lists."""
        self.check_archive(archive, self._name)

    def check_all_members(self, archive: ZipArchive) -> None:
        """Hash every member RECORD lists, in threads for large archives (zlib, hashlib release the GIL)."""
        entries = {e.name: e for e in archive.entries}
        items = [entries[name] for name in self.expected]
        total = sum(entry.usize for entry in items)
        workers = min(4, os.cpu_count() or 1)
        if total < _PARALLEL_MIN or workers < 2:
            found = [self.member_result(archive, entry) for entry in items]
        else:
            with ThreadPoolExecutor(workers) as pool:
                found = list(pool.map(lambda entry: self.member_result(archive, entry), items))
        for entry, result in zip(items, found, strict=True):
            self.record_member(entry, result)

    def check_member(self, archive: ZipArchive, entry: ZipEntry, sink: Sink | None = None) -> bool:
        """Check one member against RECORD (its raw chunks also go to ``sink``); True when it passed."""
        return self.record_member(entry, self.member_result(archive, entry, sink))

    def member_result(
        self, archive: ZipArchive, entry: ZipEntry, sink: Sink | None = None
    ) -> tuple[Issue3 | None, str]:
        expected = self.expected[entry.name]
        text = self.texts.get(entry.name)
        if text is not None and sink is None:  # already inflated and checked when it was read
            digest = hashlib.new(expected.name, text)
            sha256 = digest if expected.name == "sha256" else hashlib.sha256(text)
            return _compare(entry, expected, digest, sha256)
        return _hash_member(archive, entry, expected, sink)

    def record_member(self, entry: ZipEntry, result: tuple[Issue3 | None, str]) -> bool:
        issue, sha256 = result
        if issue:
            self.err(*issue)
            return False
        self.report.sha256[entry.name] = sha256
        return True

    def check_archive(self, archive: ZipArchive, wn: WheelName | None) -> None:
        self.check_members(archive.entries)
        for entry in archive.entries:
            if entry.is_dir:  # read too: an empty deflate stream, nothing hidden behind it
                self.read_text(archive, entry)
        if wn is None:
            return
        files = {e.name: e for e in archive.entries if not e.is_dir}
        dist_info = self.check_layout(wn, list(files))
        if dist_info is None:
            return
        self.report.dist_info = dist_info
        self.report.files = list(files)
        self.report.total_size = sum(e.usize for e in files.values())
        for member, check in (("METADATA", self.check_metadata), ("WHEEL", self.check_wheel_file)):
            entry = files.get(f"{dist_info}/{member}")
            data = None if entry is None else self.read_text(archive, entry)
            if data is not None:
                check(wn, data, entry.name)
        record_name = f"{dist_info}/RECORD"
        if record_name in files:
            self.check_record(archive, files, record_name)

    def read_text(self, archive: ZipArchive, entry: ZipEntry) -> bytes | None:
        """A checked member read whole (kept in :attr:`texts`), or ``None`` after reporting why not."""
        if entry.name in self.texts:
            return self.texts[entry.name]
        try:
            data = archive.read(entry, _MAX_TEXT)
        except ZipFormatError as exc:
            self.err(exc.code, exc.where, exc.detail)
            return None
        self.texts[entry.name] = data
        return data

    def check_filename(self) -> WheelName | None:
        try:
            wn = parse_wheel_name(self.art)
        except ValueError as exc:
            self.err(
                "invalid-filename",
                "file name",
                f"expected '{{name}}-{{version}}[-{{build}}]-"
                f"{{python}}-{{abi}}-{{platform}}.whl', got {self.art!r}: {exc}",
            )
            return None
        if wn.raw_name != wn.escaped_name:
            self.err(
                "filename-not-normalized",
                "file name: name",
                f"expected {wn.escaped_name!r}, got {wn.raw_name!r}",
            )
        if wn.raw_version != str(wn.version):
            self.err(
                "filename-not-normalized",
                "file name: version",
                f"expected {str(wn.version)!r}, got {wn.raw_version!r}",
            )
        if self.release and wn.version.local is not None:
            self.err(
                "local-version",
                "file name: version",
                f"expected a public version (PyPI rejects local versions), got {str(wn.version)!r}",
            )
        self.report.name = wn.name
        self.report.version = str(wn.version)
        self.report.build = wn.raw_build
        self.report.tags = sorted(str(t) for t in wn.tags)
        return wn

    def check_members(self, entries: list[ZipEntry]) -> None:
        seen: dict[str, int] = {}
        folded: dict[str, str] = {}
        total = 0
        for entry in entries:
            name = entry.name
            seen[name] = seen.get(name, 0) + 1
            if seen[name] == 2:
                self.err("duplicate-entry", name, "expected one zip entry, got several")
            why = check_path(name)
            if why:
                self.err("unsafe-path", name, f"expected a relative, normalized '/' path; the path {why}")
            mode = entry.external_attr >> 16
            if stat.S_ISLNK(mode):
                self.err("symlink-entry", name, f"expected a regular file, got a symlink (mode {oct(mode)})")
            lower = name.lower()
            if lower in folded and folded[lower] != name:
                self.err(
                    "case-collision",
                    name,
                    f"expected unique names ignoring case, collides with {folded[lower]!r}",
                )
            folded.setdefault(lower, name)
            total += entry.usize
            if entry.usize >= self.limits.ratio_min_size:
                ratio = entry.usize / max(entry.csize, 1)
                if ratio > self.limits.max_ratio:
                    self.err(
                        "too-large",
                        name,
                        f"expected compression ratio <= {self.limits.max_ratio:g}, "
                        f"got {ratio:.0f} ({entry.usize} bytes from {entry.csize})",
                    )
        if total > self.limits.max_total_size:
            self.err(
                "too-large",
                "archive",
                f"expected uncompressed size <= {self.limits.max_total_size}, got {total}",
            )
        self.check_conflicts(seen)

    def check_conflicts(self, names: dict[str, int]) -> None:
        """A file may not also be a parent directory of another member (no installer can do both)."""
        files = {n for n in names if not n.endswith("/")}
        for name in names:
            parts = name.rstrip("/").split("/")
            for depth in range(1, len(parts)):
                parent = "/".join(parts[:depth])
                if parent in files:
                    self.err("path-conflict", name, f"expected {parent!r} to be a directory, it is a file")
                    break

    def check_layout(self, wn: WheelName, names: list[str]) -> str | None:
        tops = sorted({n.split("/", 1)[0] for n in names})
        dist_infos = [t for t in tops if t.endswith(".dist-info")]
        if not dist_infos:
            self.err("structure", "*.dist-info", f"expected {wn.dist_info!r}, got no .dist-info directory")
            return None
        if len(dist_infos) > 1:
            self.err("multiple-dist-info", "*.dist-info", f"expected exactly one, got {dist_infos}")
            return None
        dist_info = dist_infos[0]
        if dist_info != wn.dist_info:
            self.err("dist-info-mismatch", dist_info, f"expected {wn.dist_info!r} (from the file name)")
        for top in tops:
            if top.endswith(".data") and top != wn.data_dir:
                self.err("data-dir-mismatch", top, f"expected {wn.data_dir!r} (from the file name)")
        for required in ("METADATA", "WHEEL", "RECORD"):
            if f"{dist_info}/{required}" not in names:
                self.err("structure", f"{dist_info}/{required}", "expected the file, got nothing")
        for forbidden in ("INSTALLER", "REQUESTED"):
            if f"{dist_info}/{forbidden}" in names:
                self.err("forbidden-member", f"{dist_info}/{forbidden}", "expected no installer-written file")
        return dist_info

    def check_metadata(self, wn: WheelName, data: bytes, where: str) -> None:
        try:
            name = get_first(data, "Name")
            version = get_first(data, "Version")
            meta_version = get_first(data, "Metadata-Version")
        except (ValueError, UnicodeDecodeError) as exc:
            self.err("metadata-invalid", where, f"expected RFC 822 headers, got {exc}")
            return
        if not meta_version:
            self.err("metadata-invalid", f"{where}: Metadata-Version", "expected a value, got none")
        for key in ("Name", "Version"):
            count = len(get_all(data, key))
            if count > 1:
                self.err("metadata-invalid", f"{where}: {key}", f"expected one field, got {count}")
        if name is None:
            self.err("name-mismatch", f"{where}: Name", f"expected {wn.name!r}, got no Name field")
        elif canonicalize_name(name) != wn.name:
            self.err(
                "name-mismatch",
                f"{where}: Name",
                f"expected a name canonicalizing to {wn.name!r} (file name), got {name!r}",
            )
        else:
            self.report.display_name = name
        if version is None:
            self.err("version-mismatch", f"{where}: Version", f"expected {str(wn.version)!r}, got no Version")
            return
        try:
            parsed = Version(version)
        except InvalidVersion:
            self.err(
                "version-mismatch",
                f"{where}: Version",
                f"expected {str(wn.version)!r}, got invalid {version!r}",
            )
            return
        if parsed != wn.version or version != str(wn.version):
            self.err(
                "version-mismatch",
                f"{where}: Version",
                f"expected {str(wn.version)!r} (file name), got {version!r}",
            )

    def check_wheel_file(self, wn: WheelName, data: bytes, where: str) -> None:
        try:
            wheel_version = get_all(data, "Wheel-Version")
            purelib = get_all(data, "Root-Is-Purelib")
            tag_lines = get_all(data, "Tag")
            builds = get_all(data, "Build")
        except (ValueError, UnicodeDecodeError) as exc:
            self.err("wheel-file-invalid", where, f"expected 'Key: value' lines, got {exc}")
            return
        if len(wheel_version) != 1 or not re.fullmatch(r"1\.\d+", wheel_version[0]):
            self.err(
                "wheel-version", f"{where}: Wheel-Version", f"expected one '1.x' value, got {wheel_version}"
            )
        if len(purelib) != 1 or purelib[0].lower() not in ("true", "false"):
            self.err(
                "purelib-missing", f"{where}: Root-Is-Purelib", f"expected one 'true'/'false', got {purelib}"
            )
        tags: set[Tag] = set()
        for line in tag_lines:
            parts = line.split("-")
            if len(parts) != 3 or any("." in p or not p for p in parts):
                self.err(
                    "unexpanded-tag", f"{where}: Tag", f"expected one expanded tag per line, got {line!r}"
                )
                continue
            tags.add(Tag(*parts))
        if len(tags) != len(tag_lines):
            self.err("tag-mismatch", f"{where}: Tag", f"expected unique Tag lines, got {tag_lines}")
        if tags != set(wn.tags) and not any(i.code == "unexpanded-tag" for i in self.issues):
            self.err(
                "tag-mismatch",
                f"{where}: Tag",
                f"expected the file name's tags {sorted(map(str, wn.tags))}, got {sorted(map(str, tags))}",
            )
        expected_build = format_build_tag(wn.build)
        actual_build = builds[0] if len(builds) == 1 else ("" if not builds else str(builds))
        if actual_build != expected_build:
            self.err(
                "build-mismatch",
                f"{where}: Build",
                f"expected {expected_build or '(none)'!r} (file name), got {actual_build or '(none)'!r}",
            )

    def check_record(self, archive: ZipArchive, files: dict[str, ZipEntry], record_name: str) -> None:
        data = self.read_text(archive, files[record_name])
        if data is None:
            return
        try:
            entries = parse_record(data)
        except RecordParseError as exc:
            self.err("record-parse", record_name, f"expected CSV rows 'path,hash,size', got {exc}")
            return
        by_path: dict[str, RecordEntry] = {}
        for entry in entries:
            if entry.path in by_path:
                self.err("record-duplicate", f"{record_name}: {entry.path}", "expected one row, got several")
            by_path[entry.path] = entry
            why = check_path(entry.path)
            if why and not entry.path.endswith("/"):
                self.err(
                    "unsafe-path", f"{record_name}: {entry.path}", f"expected a safe path; the path {why}"
                )
            if entry.path.endswith("/"):
                self.warn("record-directory", f"{record_name}: {entry.path}", "directory rows are ignored")
            elif entry.path not in files:
                self.err(
                    "record-missing", entry.path, "listed in RECORD, expected in the archive, got nothing"
                )
        self.report.record = by_path
        own = by_path.get(record_name)
        if own is None:
            self.warn("record-self", record_name, "expected a 'RECORD,,' row, got none")
        elif own.hash is not None or own.size is not None:
            self.err("record-self", record_name, f"expected empty hash and size, got {own.to_row()}")
        for name, info in files.items():
            if name == record_name:
                continue
            entry = by_path.get(name)
            if entry is None:
                self.err("record-unlisted", name, "in the archive, expected a RECORD row, got none")
                continue
            if entry.hash is None:
                self.err("record-hash", name, "expected a hash in RECORD, got none")
                continue
            if entry.hash.name not in STRONG_ALGORITHMS:
                self.err("weak-hash", name, f"expected sha256 or stronger, got {entry.hash.name!r}")
                continue
            if entry.size is None:
                self.err("record-size", name, f"expected a size in RECORD, got none ({info.usize} bytes)")
            elif entry.size != info.usize:
                self.err("record-size", name, f"expected {entry.size} bytes (RECORD), got {info.usize}")
            self.expected[name] = entry.hash


class _Pipeline:
    """Run ``fn`` (or :meth:`submit`'s) on each piece, in order, in one helper thread (at most a
    few pieces queued); its exceptions are raised in the caller's thread."""

    def __init__(self, fn: Sink, threaded: bool) -> None:
        self._fn = fn
        self._pool = ThreadPoolExecutor(1) if threaded else None
        self._queued: deque[Future[None]] = deque()

    def __call__(self, piece: bytes) -> None:
        self.submit(self._fn, piece)

    def submit(self, fn: Sink, piece: bytes) -> None:
        """``fn(piece)`` after everything queued before it."""
        if self._pool is None:
            fn(piece)
            return
        self._queued.append(self._pool.submit(fn, piece))
        if len(self._queued) > _PIPELINE_DEPTH:
            self._queued.popleft().result()

    def __enter__(self) -> _Pipeline:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        if self._pool is not None:
            while self._queued:
                self._queued.popleft().result()
            self._pool.shutdown()


def _hash_member(
    archive: ZipArchive, entry: ZipEntry, expected: Hash, sink: Sink | None = None
) -> tuple[Issue3 | None, str]:
    """``((code, member, detail) or None, sha256)``: the member's checked data against RECORD.

    One read of the compressed bytes (each chunk also handed to ``sink``), one inflate, one hash;
    for a large member the CRC, the hashes and ``sink`` run in a helper thread (in order) while
    the next chunk inflates.
    """
    digest = hashlib.new(expected.name)
    sha = digest if expected.name == "sha256" else hashlib.sha256()
    check = DataCheck(entry)
    crc = 0

    def update(piece: bytes) -> None:
        nonlocal crc
        crc = crc32(piece, crc)
        digest.update(piece)
        if sha is not digest:
            sha.update(piece)

    try:
        with _Pipeline(update, threaded=entry.usize >= _PIPELINE_MIN) as feed:
            for raw in archive.iter_raw(entry):
                if sink is not None:
                    feed.submit(sink, raw)
                for piece in check.inflate(raw):
                    feed(piece)
        check.end(crc)
    except ZipFormatError as exc:
        return (exc.code, exc.where, exc.detail), ""
    return _compare(entry, expected, digest, sha)


def _compare(
    entry: ZipEntry, expected: Hash, digest: hashlib._Hash, sha: hashlib._Hash
) -> tuple[Issue3 | None, str]:
    actual = Hash.of_digest(expected.name, digest.digest())
    if actual != expected:
        return ("record-hash", entry.name, f"expected {expected} (RECORD), got {actual}"), ""
    return None, Hash.of_digest("sha256", sha.digest()).value


def inspect_wheel(
    path: str | Path,
    *,
    release: bool = False,
    check_hashes: bool = True,
    limits: Limits | None = None,
    filename: str | None = None,
) -> tuple[WheelReport, list[Issue]]:
    """Run every check; return the report and the list of issues (empty when valid).

    ``filename`` checks a file (for example a temporary one) as if it had that name.
    """
    checker = WheelChecker(path, release=release, limits=limits, filename=filename)
    checker.run(check_hashes)
    return checker.report, checker.issues


def verify_written(
    path: str | Path,
    *,
    filename: str,
    texts: Mapping[str, bytes],
    written: Mapping[str, tuple[int, int, int, str]],
    release: bool = False,
    limits: Limits | None = None,
) -> WheelReport:
    """Check a wheel this tool just wrote, from what it knows instead of reading the data again.

    The archive structure is parsed from the file (headers only, with every strict rule) and must
    list exactly the ``written`` members (name -> CRC, compressed size, size, sha256 of the data
    that was checked while it was copied); ``texts`` are the members written from memory. Then
    every check of :func:`verify_wheel` runs, RECORD against those digests.
    """
    checker = WheelChecker(path, release=release, limits=limits, filename=filename)
    checker.texts.update(texts)
    archive = checker.open()
    if archive is not None:
        with archive:
            checker.check_static(archive)
            entries = {e.name: e for e in archive.entries}
            if sorted(entries) != sorted(written):
                checker.err("structure", "archive", f"expected the members written, got {sorted(entries)}")
            for name, expected in checker.expected.items():
                entry = entries[name]
                crc, csize, usize, sha256 = written.get(name, (-1, -1, -1, ""))
                if (entry.crc, entry.csize, entry.usize) != (crc, csize, usize):
                    checker.err("bad-zip", name, "expected the CRC and sizes that were written")
                elif name in texts:
                    checker.record_member(entry, checker.member_result(archive, entry))
                elif expected != Hash("sha256", sha256):
                    checker.err("record-hash", name, f"expected {expected} (RECORD), got sha256={sha256}")
                else:
                    checker.report.sha256[name] = sha256
    if checker.issues:
        raise WheelVerificationError(f"{filename}: {len(checker.issues)} issue(s) found", checker.issues)
    return checker.report


def verify_wheel(
    path: str | Path,
    *,
    release: bool = False,
    check_hashes: bool = True,
    limits: Limits | None = None,
    filename: str | None = None,
) -> WheelReport:
    """Return the report of a valid wheel; raise :class:`WheelVerificationError` with all issues."""
    report, issues = inspect_wheel(
        path, release=release, check_hashes=check_hashes, limits=limits, filename=filename
    )
    if issues:
        name = filename or Path(path).name
        raise WheelVerificationError(f"{name}: {len(issues)} issue(s) found", issues)
    return report
