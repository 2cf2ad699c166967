"""Rename and retag a wheel zip-to-zip: no unpacking, no recompression of unchanged members.

Every path is derived from ``canonicalize_name(name)`` and ``str(Version)``. The input passes
the same full verification as ``verify`` (strict zip structure, every member inflated to its
size and CRC and checked against RECORD, METADATA and WHEEL included) before anything is
written; only the WHEEL tag checks are waived, since the repack rewrites them. The output is
written to a temporary file next to the target, verified in full, and only then moved into
place with :func:`os.replace`. An identical existing target is left as is.
"""

from __future__ import annotations

import contextlib
import filecmp
import os
import re
import tempfile
from collections.abc import Callable, Sequence
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
from release.zipio import ZipWriter, dos_date_time, normalized_mode
from release.zipread import ZipArchive, ZipFormatError

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
    report, issues = inspect_wheel(src, limits=limits)
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
    job = _Job(report, order, renamed, name, tagset, wn.raw_build, reqs, epoch, progress)
    created: list[Path] = []
    tmp: Path | None = None
    done = False
    try:
        created = _make_dirs(out_dir)
        fd, tmp_name = tempfile.mkstemp(dir=out_dir, prefix=f".{out_name}.", suffix=".tmp")
        tmp = Path(tmp_name)
        max_entries = (limits or Limits()).max_members
        with os.fdopen(fd, "wb") as out, ZipArchive.open(src, max_entries=max_entries) as archive:
            _write(archive, out, job)
            out.flush()
            os.fsync(out.fileno())
        tmp.chmod(0o666 & ~_umask())
        out_report = verify_wheel(tmp, filename=out_name, limits=limits)
        out_report.path = target
        written = _publish(tmp, target, src, overwrite)
        done = True
    except ZipFormatError as exc:  # the input changed after it was verified
        raise RepackError(exc.code, f"{src.name}: {exc.code}: {exc}; nothing written") from exc
    except OSError as exc:
        raise RepackError("io-error", f"{target}: cannot write the output: {exc}") from exc
    finally:
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        if not done:
            _remove_empty(created)
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


def _write(archive: ZipArchive, out: BinaryIO, job: _Job) -> None:
    """Copy the verified members; the new RECORD takes their digests from the verification."""
    report, order, renamed, epoch, progress = job.report, job.order, job.renamed, job.epoch, job.progress
    entries = {e.name: e for e in archive.entries if not e.is_dir}
    old_di = report.dist_info
    new_di = renamed.get(f"{old_di}/METADATA", "").rsplit("/", 1)[0]
    writer = ZipWriter(out)
    rows: list[RecordEntry] = []
    total = sum(entries[m].usize for m in order) or 1
    done = 0
    for member in order:
        entry = entries[member]
        new = renamed[member]
        dt = dos_date_time(epoch, entry.date_time)
        sha256 = report.sha256[member]
        if member in (f"{old_di}/METADATA", f"{old_di}/WHEEL"):
            data = archive.read(entry, entry.usize)
            if Hash.of_bytes(data).value != sha256:
                raise ZipFormatError("bad-zip", member, "content changed after it was verified")
            data = _edit(member, data, job)
            writer.add_bytes(new, data, 0o644, dt)
            rows.append(RecordEntry(new, Hash.of_bytes(data), len(data)))
        else:  # a changed input is caught when the output is verified against these digests
            writer.add_raw(entry, new, archive.iter_raw(entry), normalized_mode(entry.external_attr), dt)
            rows.append(RecordEntry(new, Hash("sha256", sha256), entry.usize))
        done += entry.usize
        if progress:
            progress(done, total)
    record_name = f"{new_di}/RECORD"
    rows.append(RecordEntry(record_name, None, None))
    record_entry = entries[f"{old_di}/RECORD"]
    writer.add_bytes(record_name, serialize_record(rows), 0o644, dos_date_time(epoch, record_entry.date_time))
    writer.close()


def _make_dirs(path: Path) -> list[Path]:
    """``mkdir -p``; return the directories it created, outermost first."""
    missing = [p for p in (path, *path.parents) if not p.exists()][::-1]
    path.mkdir(parents=True, exist_ok=True)
    return missing


def _remove_empty(created: list[Path]) -> None:
    for path in reversed(created):
        with contextlib.suppress(OSError):
            path.rmdir()


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
