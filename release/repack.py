"""Rename and retag a wheel zip-to-zip in one streaming pass: no unpacking, no recompression.

Every path is derived from ``canonicalize_name(name)`` and ``str(Version)``. The input gets
exactly the checks of ``verify`` (:class:`release.verify.WheelChecker`), so a repack refuses
whatever ``verify`` rejects: the checks that need no member data run before anything is
written; then each member is read, inflated and hashed once while its compressed bytes are
copied to a temporary file next to the target. A member that fails stops the writing (the
remaining ones are still checked, so every issue is reported) and the temporary file is
removed. The output is verified from what the pass already knows (its headers parsed again
with every strict rule, RECORD against the digests just computed), then moved into place with
:func:`os.replace`. An identical existing target is left as is. Memory stays bounded: members
are streamed in 1 MiB chunks; only METADATA, WHEEL and RECORD are held whole.
"""

from __future__ import annotations

import contextlib
import filecmp
import hashlib
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, NoReturn

from packaging.requirements import InvalidRequirement, Requirement
from packaging.tags import Tag

from release.errors import Issue, RepackError, WheelVerificationError
from release.metadata import add_headers, render_wheel_file, replace_header
from release.record import Hash, RecordEntry, serialize_record
from release.verify import Limits, WheelChecker, WheelReport, verify_written
from release.wheelname import (
    compress_tags,
    dist_info_dir,
    expand_tags,
    format_wheel_name,
    parse_wheel_name,
    validate_project_name,
)
from release.zipio import ZipWriter, dos_date_time, normalized_mode
from release.zipread import ZipArchive

__all__ = ["RepackResult", "find_extension_modules", "repack_wheel", "source_date_epoch"]

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
    sha256: str | None = None  # hex digest of the output file, with ``hash_output``

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
    release: bool = False,
    hash_output: bool = False,
    epoch: int | None = None,
    limits: Limits | None = None,
    progress: Progress | None = None,
) -> RepackResult:
    """Write ``wheel`` renamed to ``name`` and tagged ``tags``; see the module docstring.

    ``release`` applies the release rules (no local version) to the input and the output;
    ``hash_output`` also hashes the output file as it is written (:attr:`RepackResult.sha256`).
    """
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
    checker = WheelChecker(src, release=release, limits=limits)
    archive = checker.open()
    if archive is None:
        _refuse(src, checker)
    with archive:
        checker.check_static(archive)
        if checker.issues:
            checker.check_all_members(archive)  # so the refusal lists every issue verify reports
            _refuse(src, checker)
        target = _Target(
            name=name,
            tagset=tagset,
            requires=reqs,
            outdir=outdir,
            allow_extension_retag=allow_extension_retag,
            overwrite=overwrite,
            dry_run=dry_run,
            release=release,
            hash_output=hash_output,
            epoch=epoch,
        )
        return _repack(archive, checker, target, limits=limits, progress=progress)


def _refuse(src: Path, checker: WheelChecker) -> NoReturn:
    raise WheelVerificationError(f"{src.name}: input wheel is not valid, nothing written", checker.issues)


@dataclass(frozen=True)
class _Target:
    name: str
    tagset: frozenset[Tag]
    requires: list[str]
    outdir: str | Path | None
    allow_extension_retag: bool
    overwrite: bool
    dry_run: bool
    release: bool
    hash_output: bool
    epoch: int | None


def _repack(
    archive: ZipArchive,
    checker: WheelChecker,
    to: _Target,
    *,
    limits: Limits | None,
    progress: Progress | None,
) -> RepackResult:
    report, src = checker.report, checker.path
    name, tagset, epoch = to.name, to.tagset, to.epoch
    wn = parse_wheel_name(src.name)
    old_di, old_data = report.dist_info, wn.data_dir
    new_di = dist_info_dir(name, wn.version)
    new_data = dist_info_dir(name, wn.version, "data")
    if any(t.abi == "none" for t in tagset) and not to.allow_extension_retag:
        exts = find_extension_modules(report.files)
        if exts:
            raise RepackError(
                "extension-retag",
                f"{src.name}: retag to {compress_tags(tagset)!r} refused: the wheel contains CPython "
                f"extension module(s) {exts[:5]}; pass --allow-extension-retag to override",
            )
    out_name = format_wheel_name(name, wn.version, wn.build, tagset)
    out_dir = Path(to.outdir) if to.outdir is not None else src.parent
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
        "requires_added": to.requires,
        "members": len(members) + 1,
        "renamed_members": sum(1 for m in members if renamed[m] != m),
        "rewritten": [f"{new_di}/METADATA", f"{new_di}/WHEEL", f"{new_di}/RECORD"],
        "source_date_epoch": epoch,
    }
    job = _Job(checker, order, renamed, name, tagset, wn.raw_build, to.requires, epoch, progress)
    if to.dry_run:  # the same one pass, writing nothing
        _write(archive, None, job)
        if checker.issues:
            _refuse(src, checker)
        return RepackResult(src, target, False, plan, None, report.warnings)
    created: list[Path] = []
    tmp: Path | None = None
    done = False
    try:
        created = _make_dirs(out_dir)
        fd, tmp_name = tempfile.mkstemp(dir=out_dir, prefix=f".{out_name}.", suffix=".tmp")
        tmp = Path(tmp_name)
        with os.fdopen(fd, "wb") as raw:
            out = _HashingFile(raw) if to.hash_output else raw
            facts = _write(archive, out, job)
            raw.flush()
            os.fsync(raw.fileno())
        if checker.issues:
            _refuse(src, checker)
        assert facts is not None
        tmp.chmod(0o666 & ~_umask())
        out_report = verify_written(
            tmp, filename=out_name, texts=facts[0], written=facts[1], release=to.release, limits=limits
        )
        out_report.path = target
        written = _publish(tmp, target, src, to.overwrite)
        done = True
    except OSError as exc:
        raise RepackError("io-error", f"{target}: cannot write the output: {exc}") from exc
    finally:
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        if not done:
            _remove_empty(created)
    sha256 = out.hexdigest() if isinstance(out, _HashingFile) else None
    return RepackResult(src, target, written, plan, out_report, report.warnings, sha256)


@dataclass
class _Job:
    checker: WheelChecker
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
            "metadata-invalid", f"{job.checker.path.name}: {member}: cannot edit: {exc}"
        ) from exc


Facts = tuple[dict[str, bytes], dict[str, tuple[int, int, int, str]]]


def _write(archive: ZipArchive, out: BinaryIO | None, job: _Job) -> Facts | None:
    """The one pass: check each member while copying it (``out=None``: check only).

    Returns what was written (members written from memory; name -> CRC, sizes, sha256), or
    ``None`` once a member failed (the checker holds the issues; writing stopped there).
    """
    checker, order, renamed, epoch, progress = job.checker, job.order, job.renamed, job.epoch, job.progress
    entries = {e.name: e for e in archive.entries if not e.is_dir}
    old_di = checker.report.dist_info
    new_di = renamed[f"{old_di}/METADATA"].rsplit("/", 1)[0]
    writer = ZipWriter(out) if out is not None else None
    rows: list[RecordEntry] = []
    texts: dict[str, bytes] = {}
    written: dict[str, tuple[int, int, int, str]] = {}
    total = sum(entries[m].usize for m in order) or 1
    done = 0
    for member in order:
        entry = entries[member]
        new = renamed[member]
        dt = dos_date_time(epoch, entry.date_time)
        if member in (f"{old_di}/METADATA", f"{old_di}/WHEEL"):
            if checker.check_member(archive, entry):  # read whole by the static checks
                data = _edit(member, checker.texts[member], job)
                texts[new] = data
                rows.append(RecordEntry(new, Hash.of_bytes(data), len(data)))
                if writer is not None and not checker.issues:
                    writer.add_bytes(new, data, 0o644, dt)
        else:
            sink = None
            if writer is not None and not checker.issues:
                sink = writer.start_raw(entry, new, normalized_mode(entry.external_attr), dt)
            if checker.check_member(archive, entry, sink):
                sha256 = checker.report.sha256[member]
                rows.append(RecordEntry(new, Hash("sha256", sha256), entry.usize))
                written[new] = (entry.crc, entry.csize, entry.usize, sha256)
                if sink is not None:
                    sink.done()
        done += entry.usize
        if progress:
            progress(done, total)
    if writer is None or checker.issues:
        return None
    record_name = f"{new_di}/RECORD"
    rows.append(RecordEntry(record_name, None, None))
    record = serialize_record(rows)
    texts[record_name] = record
    writer.add_bytes(record_name, record, 0o644, dos_date_time(epoch, entries[f"{old_di}/RECORD"].date_time))
    for m in writer.members:
        if m.name in texts:
            written[m.name] = (m.crc, m.csize, m.usize, Hash.of_bytes(texts[m.name]).value)
    writer.close()
    return texts, written


class _HashingFile:
    """A write-only file that hashes what goes through it (all :class:`ZipWriter` needs)."""

    def __init__(self, fp: BinaryIO) -> None:
        self._fp = fp
        self._sha = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self._sha.update(data)
        return self._fp.write(data)

    def tell(self) -> int:
        return self._fp.tell()

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


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
