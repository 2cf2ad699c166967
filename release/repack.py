"""Rename and retag a wheel zip-to-zip: no unpacking, no recompression of unchanged members.

Every path is derived from ``canonicalize_name(name)`` and ``str(Version)``; the input is
verified first (structure without hashes, then each member's hash while it is copied),
the output is written to a temporary file next to the target, verified in full, and only
then moved into place with :func:`os.replace`. An identical existing target is left as is.
"""

from __future__ import annotations

import contextlib
import filecmp
import hashlib
import os
import re
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from packaging.requirements import InvalidRequirement, Requirement
from packaging.tags import Tag

from release.errors import Issue, RepackError, WheelVerificationError
from release.metadata import add_headers, render_wheel_file, replace_header
from release.record import Hash, RecordEntry, serialize_record
from release.verify import Limits, WheelReport, inspect_wheel, verify_wheel
from release.wheelname import (
    compress_tags,
    dist_info_dir,
    expand_tags,
    format_wheel_name,
    parse_wheel_name,
    validate_project_name,
)
from release.zipio import CHUNK, ZipWriter, dos_date_time, iter_raw, normalized_mode

__all__ = ["RepackResult", "find_extension_modules", "repack_wheel", "source_date_epoch"]

# Input issues that a repack repairs by construction (it rewrites the WHEEL tags).
_REPAIRABLE = frozenset({"tag-mismatch", "unexpanded-tag"})
_EXT_RE = re.compile(r"\.(cpython-[^/]*|abi3|pypy[^/]*)\.(so|pyd|dylib)$|\.pyd$")

Progress = Callable[[int, int], None]


@dataclass
class RepackResult:
    """What a repack did (or, with ``dry_run``, would do)."""

    input: Path
    output: Path
    written: bool
    plan: dict[str, object]
    report: WheelReport | None = None
    warnings: list[Issue] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {
            "input": str(self.input),
            "output": str(self.output),
            "written": self.written,
            "plan": self.plan,
            "warnings": [w.as_dict() for w in self.warnings],
        }


def source_date_epoch(environ: dict[str, str] | None = None) -> int | None:
    """``SOURCE_DATE_EPOCH`` as an int, ``None`` when unset; an invalid value is an error."""
    value = (os.environ if environ is None else environ).get("SOURCE_DATE_EPOCH", "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise RepackError(
            "invalid-source-date-epoch", f"SOURCE_DATE_EPOCH: expected an integer, got {value!r}"
        )
    return int(value)


def find_extension_modules(names: Sequence[str]) -> list[str]:
    """Members that are CPython (or PyPy) extension modules."""
    return [n for n in names if _EXT_RE.search(n)]


def _rename(member: str, old_di: str, new_di: str, old_data: str, new_data: str) -> str:
    top, sep, rest = member.partition("/")
    if top == old_di:
        return new_di + sep + rest
    if top == old_data:
        return new_data + sep + rest
    return member


def _copy_hashed(
    fp: BinaryIO,
    info: zipfile.ZipInfo,
    writer: ZipWriter,
    name: str,
    mode: int,
    dt: tuple[int, ...],
    algo: str,
) -> tuple[str, str]:
    """Copy compressed bytes, hashing the uncompressed stream; return (sha256, input-algo digest)."""
    sha = hashlib.sha256()
    other = hashlib.new(algo) if algo != "sha256" else sha
    size = 0
    inflater = zlib.decompressobj(-15) if info.compress_type == zipfile.ZIP_DEFLATED else None

    def feed(data: bytes) -> None:
        nonlocal size
        sha.update(data)
        if other is not sha:
            other.update(data)
        size += len(data)

    def chunks() -> Iterator[bytes]:
        for raw in iter_raw(fp, info):
            if inflater is None:
                feed(raw)
            else:
                data = inflater.decompress(raw, CHUNK)
                feed(data)
                while inflater.unconsumed_tail:
                    feed(inflater.decompress(inflater.unconsumed_tail, CHUNK))
            yield raw
        if inflater is not None:
            feed(inflater.flush())

    try:
        writer.add_raw(info, name, chunks(), mode, dt)
    except zlib.error as exc:
        raise RepackError("bad-zip", f"{info.filename}: cannot inflate the member data: {exc}") from exc
    if size != info.file_size:  # the CRC is checked when the output is verified
        raise RepackError("bad-zip", f"{info.filename}: size does not match the zip directory")
    return (
        Hash.of_digest("sha256", sha.digest()).value,
        Hash.of_digest(algo, other.digest()).value,
    )


def repack_wheel(
    wheel: str | Path,
    *,
    name: str,
    tags: str | Sequence[str],
    requires: Sequence[str] = (),
    outdir: str | Path | None = None,
    allow_extension_retag: bool = False,
    overwrite: bool = False,
    dry_run: bool = False,
    epoch: int | None = None,
    limits: Limits | None = None,
    progress: Progress | None = None,
) -> RepackResult:
    """Write ``wheel`` renamed to ``name`` and tagged ``tags``; see the module docstring."""
    src = Path(wheel)
    try:
        validate_project_name(name)
        tagset = expand_tags(tags)
        compress_tags(tagset)
        reqs = [str(Requirement(r)) for r in requires]
    except (ValueError, InvalidRequirement) as exc:
        raise RepackError("usage", f"repack: {exc}") from exc
    if epoch is None:
        epoch = source_date_epoch()
    report, issues = inspect_wheel(src, check_hashes=False, limits=limits)
    blocking = [i for i in issues if i.code not in _REPAIRABLE]
    if blocking:
        raise WheelVerificationError(f"{src.name}: input wheel is not valid, nothing written", blocking)
    wn = parse_wheel_name(src.name)
    old_di, old_data = report.dist_info, wn.data_dir
    new_di = dist_info_dir(name, wn.version)
    new_data = dist_info_dir(name, wn.version, "data")
    if any(t.abi == "none" for t in tagset) and not allow_extension_retag:
        exts = find_extension_modules(report.files)
        if exts:
            raise RepackError(
                "extension-retag",
                f"{src.name}: retag to {compress_tags(tagset)!r} refused: the wheel contains CPython "
                f"extension module(s) {exts[:5]}; pass --allow-extension-retag to override",
            )
    out_name = format_wheel_name(name, wn.version, wn.build, tagset)
    out_dir = Path(outdir) if outdir is not None else src.parent
    target = out_dir / out_name
    members = [m for m in report.files if m != f"{old_di}/RECORD"]
    renamed = {m: _rename(m, old_di, new_di, old_data, new_data) for m in members}
    order = sorted(members, key=lambda m: (renamed[m].startswith(new_di + "/"), renamed[m]))
    plan: dict[str, object] = {
        "name": [report.display_name, name],
        "dist_info": [old_di, new_di],
        "data": [old_data, new_data] if any(m.startswith(old_data + "/") for m in members) else None,
        "tags": sorted(str(t) for t in tagset),
        "build": wn.raw_build,
        "requires_added": reqs,
        "members": len(members) + 1,
        "renamed_members": sum(1 for m in members if renamed[m] != m),
        "rewritten": [f"{new_di}/METADATA", f"{new_di}/WHEEL", f"{new_di}/RECORD"],
        "source_date_epoch": epoch,
    }
    warnings = [i for i in issues if i.code in _REPAIRABLE] + report.warnings
    if dry_run:
        return RepackResult(src, target, False, plan, None, warnings)
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=out_dir, prefix=f".{out_name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(src) as zf, open(src, "rb") as raw:
            job = _Job(report, order, renamed, name, tagset, wn.raw_build, reqs, epoch, progress)
            _write(zf, raw, out, job)
            out.flush()
            os.fsync(out.fileno())
        tmp.chmod(0o666 & ~_umask())
        out_report = verify_wheel(tmp, filename=out_name, limits=limits)
        out_report.path = target
        written = _publish(tmp, target, src, overwrite)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return RepackResult(src, target, written, plan, out_report, warnings)


@dataclass
class _Job:
    report: WheelReport
    order: list[str]
    renamed: dict[str, str]
    name: str
    tagset: frozenset[Tag]
    build: str
    requires: list[str]
    epoch: int | None
    progress: Progress | None


def _edit(member: str, data: bytes, job: _Job) -> bytes:
    try:
        if member.endswith("/METADATA"):
            return add_headers(replace_header(data, "Name", job.name), "Requires-Dist", job.requires)
        return render_wheel_file(data, job.tagset, job.build)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RepackError(
            "metadata-invalid", f"{job.report.path.name}: {member}: cannot edit: {exc}"
        ) from exc


def _write(zf: zipfile.ZipFile, raw: BinaryIO, out: BinaryIO, job: _Job) -> None:
    report, order, renamed, epoch, progress = job.report, job.order, job.renamed, job.epoch, job.progress
    infos = {i.filename: i for i in zf.infolist() if not i.filename.endswith("/")}
    old_di = report.dist_info
    new_di = renamed.get(f"{old_di}/METADATA", "").rsplit("/", 1)[0]
    writer = ZipWriter(out)
    rows: list[RecordEntry] = []
    issues: list[Issue] = []
    total = sum(infos[m].file_size for m in order) or 1
    done = 0
    for member in order:
        info = infos[member]
        new = renamed[member]
        dt = dos_date_time(epoch, info.date_time)
        mode = normalized_mode(info.external_attr)
        if member in (f"{old_di}/METADATA", f"{old_di}/WHEEL"):
            data = _edit(member, zf.read(info), job)
            writer.add_bytes(new, data, 0o644, dt)
            rows.append(RecordEntry(new, Hash.of_bytes(data), len(data)))
        else:
            expected = report.record[member].hash
            sha, digest = _copy_hashed(raw, info, writer, new, mode, dt, expected.name)
            if digest != expected.value:
                issues.append(
                    Issue(
                        "record-hash",
                        report.path.name,
                        member,
                        f"expected {expected} (RECORD), got "
                        f"{expected.name}={digest}; refusing to re-hash untrusted content",
                    )
                )
            rows.append(RecordEntry(new, Hash("sha256", sha), info.file_size))
        done += info.file_size
        if progress:
            progress(done, total)
    if issues:
        raise WheelVerificationError(f"{report.path.name}: input RECORD does not match its content", issues)
    record_name = f"{new_di}/RECORD"
    rows.append(RecordEntry(record_name, None, None))
    record_info = infos[f"{old_di}/RECORD"]
    writer.add_bytes(record_name, serialize_record(rows), 0o644, dos_date_time(epoch, record_info.date_time))
    writer.close()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _publish(tmp: Path, target: Path, src: Path, overwrite: bool) -> bool:
    """Move ``tmp`` to ``target``; False when ``target`` already has these exact bytes."""
    if target.exists():
        if filecmp.cmp(tmp, target, shallow=False):
            return False
        if target.resolve() == src.resolve():
            raise RepackError("output-is-input", f"{target}: refusing to overwrite the input wheel")
        if not overwrite:
            raise RepackError(
                "output-exists", f"{target}: exists with different bytes; remove it or pass --overwrite"
            )
    os.replace(tmp, target)
    return True
