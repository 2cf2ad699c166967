"""Wheel verification: every check collects issues; :func:`verify_wheel` raises once with all.

Checks: the archive structure (:mod:`release.zipread`, first violation only: nothing else can be
trusted after it); file name grammar; one ``.dist-info`` named like the file; METADATA ``Name``
and ``Version``; WHEEL ``Wheel-Version``, ``Root-Is-Purelib``, expanded ``Tag`` lines,
``Build``; RECORD (strictly parsed, every file once, sha256 or stronger, sizes, hashes of the
data inflated to its exact size and CRC); path safety; size and ratio limits.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from packaging.tags import Tag
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from release.errors import Issue, WheelVerificationError
from release.metadata import get_all, get_first
from release.record import STRONG_ALGORITHMS, Hash, RecordEntry, RecordParseError, parse_record
from release.safety import Limits, check_path
from release.wheelname import WheelName, format_build_tag, parse_wheel_name
from release.zipread import ZipArchive, ZipEntry, ZipFormatError

__all__ = ["Limits", "WheelReport", "check_path", "inspect_wheel", "verify_wheel"]

_PARALLEL_MIN = 64 << 20  # hash in threads above this many uncompressed bytes
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


class _Checker:
    def __init__(
        self, path: Path, release: bool, check_hashes: bool, limits: Limits, filename: str | None
    ) -> None:
        self.path = path
        self.art = filename or path.name
        self.release = release
        self.check_hashes = check_hashes
        self.limits = limits
        self.issues: list[Issue] = []
        self.report = WheelReport(path=path)

    def err(self, code: str, where: str, detail: str) -> None:
        self.issues.append(Issue(code, self.art, where, detail))

    def warn(self, code: str, where: str, detail: str) -> None:
        self.report.warnings.append(Issue(code, self.art, where, detail))

    def run(self) -> None:
        wn = self.check_filename()
        try:
            archive = ZipArchive.open(self.path, max_entries=self.limits.max_members)
        except ZipFormatError as exc:
            self.err(exc.code, exc.where, exc.detail)
            return
        except OSError as exc:
            self.err("bad-zip", "archive", f"expected a readable zip file, got {exc}")
            return
        with archive:
            self.check_archive(archive, wn)

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
        """A checked member read whole, or ``None`` after reporting why it cannot be."""
        try:
            return archive.read(entry, _MAX_TEXT)
        except ZipFormatError as exc:
            self.err(exc.code, exc.where, exc.detail)
            return None

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
        to_hash: list[tuple[ZipEntry, Hash]] = []
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
            if self.check_hashes:
                to_hash.append((info, entry.hash))
        self._check_hashes(archive, to_hash)

    def _check_hashes(self, archive: ZipArchive, items: list[tuple[ZipEntry, Hash]]) -> None:
        """Hash members, in threads for large archives (hashlib and zlib release the GIL)."""
        total = sum(entry.usize for entry, _ in items)
        workers = min(4, os.cpu_count() or 1)
        if total < _PARALLEL_MIN or workers < 2:
            found = [_hash_member(archive, entry, expected) for entry, expected in items]
        else:
            with ThreadPoolExecutor(workers) as pool:
                found = list(pool.map(lambda item: _hash_member(archive, *item), items))
        for (entry, _), (issue, sha256) in zip(items, found, strict=True):
            if issue:
                self.err(*issue)
            else:
                self.report.sha256[entry.name] = sha256


def _hash_member(
    archive: ZipArchive, entry: ZipEntry, expected: Hash
) -> tuple[tuple[str, str, str] | None, str]:
    """``((code, member, detail) or None, sha256)``: the member's checked data against RECORD."""
    digest = hashlib.new(expected.name)
    sha = digest if expected.name == "sha256" else hashlib.sha256()
    try:
        for chunk in archive.iter_data(entry):
            digest.update(chunk)
            if sha is not digest:
                sha.update(chunk)
    except ZipFormatError as exc:
        return (exc.code, exc.where, exc.detail), ""
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
    checker = _Checker(Path(path), release, check_hashes, limits or Limits(), filename)
    checker.run()
    return checker.report, checker.issues


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
