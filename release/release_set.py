"""The release set: sdist, flavor wheels, the ``thd-kernels`` metapackage, sums and manifest.

Everything is produced in a staging directory next to the output directory and moved in
only after every artifact and the set as a whole passed verification.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.tags import parse_tag
from packaging.utils import canonicalize_name
from packaging.version import Version

from release.build import build_project
from release.errors import Issue, ReleaseError, WheelVerificationError
from release.flavors import FlavorTable, load_flavors
from release.metadata import get_all, get_first
from release.record import Hash, RecordEntry, serialize_record
from release.repack import repack_wheel, source_date_epoch
from release.verify import WheelReport, verify_wheel
from release.version import VersionInfo, read_version_file, with_local_label
from release.wheelname import dist_info_dir, format_wheel_name
from release.zipio import ZipWriter, dos_date_time

__all__ = [
    "ReleaseResult",
    "check_release_set",
    "default_epoch",
    "make_dev_wheel",
    "make_release",
    "write_metapackage",
]

Say = Callable[[str], None]


@dataclass
class ReleaseResult:
    outdir: Path
    version: VersionInfo
    artifacts: list[dict[str, object]]
    manifest: Path | None
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {
            "outdir": str(self.outdir),
            "version": self.version.as_dict(),
            "artifacts": self.artifacts,
            "manifest": str(self.manifest) if self.manifest else None,
            "warnings": self.warnings,
        }


def default_epoch(srcdir: Path) -> int:
    """``SOURCE_DATE_EPOCH``, else the last commit time, else 1980-01-01."""
    epoch = source_date_epoch()
    if epoch is not None:
        return epoch
    with contextlib.suppress(OSError, subprocess.CalledProcessError, ValueError):
        out = subprocess.run(
            ["git", "log", "-1", "--format=%ct"], cwd=srcdir, capture_output=True, check=True
        )
        return int(out.stdout.strip())
    return 315532800


def _git_state(srcdir: Path) -> dict[str, object]:
    """``{"commit": sha or None, "dirty": bool or None}`` (uncommitted or untracked files?)."""
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=srcdir, capture_output=True, check=True)
        status = subprocess.run(
            ["git", "status", "--porcelain"],
            cwd=srcdir,
            capture_output=True,
            check=True,
        )
        return {"commit": sha.stdout.decode().strip() or None, "dirty": bool(status.stdout.strip())}
    return {"commit": None, "dirty": None}


def write_metapackage(outdir: Path, table: FlavorTable, version: Version, epoch: int | None) -> Path:
    """Write the code-free metapackage wheel whose extras pin each flavor ``==<version>``."""
    name = table.metapackage
    di = dist_info_dir(name, version)
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {name}",
        f"Version: {version}",
        f"Summary: {table.summary}",
        "Requires-Python: >=3.10",
    ]
    for flavor in table.flavors:
        lines.append(f"Provides-Extra: {flavor.extra}")
        lines.append(f'Requires-Dist: {flavor.name}=={version}; extra == "{flavor.extra}"')
    lines.append("Description-Content-Type: text/markdown")
    extras = ", ".join(f"`{table.metapackage}[{f.extra}]`" for f in table.flavors)
    body = f"# {name}\n\nMetapackage without code. Install one flavor: {extras}.\n"
    metadata = ("\n".join(lines) + "\n\n" + body).encode("utf-8")
    wheel = b"Wheel-Version: 1.0\nGenerator: thd-release\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    path = outdir / format_wheel_name(name, version, (), parse_tag("py3-none-any"))
    dt = dos_date_time(epoch)
    rows = []
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fp:
        writer = ZipWriter(fp)
        for member, data in (("METADATA", metadata), ("WHEEL", wheel)):
            writer.add_bytes(f"{di}/{member}", data, 0o644, dt)
            rows.append(RecordEntry(f"{di}/{member}", Hash.of_bytes(data), len(data)))
        rows.append(RecordEntry(f"{di}/RECORD", None, None))
        writer.add_bytes(f"{di}/RECORD", serialize_record(rows), 0o644, dt)
        writer.close()
    os.replace(tmp, path)
    return path


def check_release_set(
    reports: Sequence[WheelReport], sdist_version: str | None, table: FlavorTable
) -> list[Issue]:
    """One version string everywhere, pins resolve inside the set, no shared files."""
    issues: list[Issue] = []
    versions = {r.path.name: r.version for r in reports}
    if sdist_version is not None:
        versions["sdist"] = sdist_version
    if len(set(versions.values())) > 1:
        issues.append(
            Issue(
                "version-string-mismatch",
                "release set",
                "Version",
                f"expected one version string, got {versions}",
            )
        )
    by_name = {canonicalize_name(r.name): r for r in reports}
    meta = by_name.get(canonicalize_name(table.metapackage))
    if meta is None:
        issues.append(Issue("structure", "release set", table.metapackage, "expected the metapackage wheel"))
    else:
        import zipfile

        with zipfile.ZipFile(meta.path) as zf:
            metadata = zf.read(f"{meta.dist_info}/METADATA")
        for text in get_all(metadata, "Requires-Dist"):
            req = Requirement(text)
            target = by_name.get(canonicalize_name(req.name))
            specs = list(req.specifier)
            pinned = specs[0].version if len(specs) == 1 and specs[0].operator == "==" else None
            if target is None:
                issues.append(
                    Issue(
                        "pin-unresolved",
                        meta.path.name,
                        f"Requires-Dist {text!r}",
                        f"expected a wheel named {req.name} in the set, got none",
                    )
                )
            elif pinned != meta.version or target.version != pinned:
                issues.append(
                    Issue(
                        "pin-mismatch",
                        meta.path.name,
                        f"Requires-Dist {text!r}",
                        f"expected =={meta.version}, the set has {target.version!r}",
                    )
                )
        if get_first(metadata, "Version") != meta.version:
            issues.append(
                Issue("version-mismatch", meta.path.name, "METADATA Version", "expected the file name's")
            )
    flavors = {canonicalize_name(f.name) for f in table.flavors}
    for i, a in enumerate(reports):
        for b in reports[i + 1 :]:
            if {canonicalize_name(a.name), canonicalize_name(b.name)} <= flavors:
                continue  # flavors are alternatives (one extra each), never installed together
            shared = sorted(set(a.files) & set(b.files))
            if shared:
                issues.append(
                    Issue(
                        "shared-file",
                        f"{a.path.name} + {b.path.name}",
                        shared[0],
                        f"expected no file owned by two co-installable wheels, got {len(shared)}",
                    )
                )
    return issues


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fp:
        while chunk := fp.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def make_release(
    srcdir: str | Path,
    outdir: str | Path,
    *,
    isolation: bool = False,
    flavors: str | Path | None = None,
    say: Say | None = None,
) -> ReleaseResult:
    """Build, repack, verify and publish the whole release set into an empty ``outdir``."""
    srcdir, outdir = Path(srcdir).resolve(), Path(outdir).resolve()
    say = say or (lambda _m: None)
    info = read_version_file(srcdir / "VERSION.txt")
    info.require_release()
    table = load_flavors(flavors) if flavors else load_flavors()
    if outdir.exists() and any(outdir.iterdir()):
        raise ReleaseError(f"{outdir}: output directory is not empty; expected an empty or new directory")
    epoch = default_epoch(srcdir)
    git = _git_state(srcdir)
    warnings = []
    if git["dirty"]:
        warnings.append(f"{srcdir}: uncommitted changes or untracked files; they are part of this release")
    if info.version.epoch:
        warnings.append(f"{info.source}: version {info.normalized!r} has an epoch; indexes discourage epochs")
    outdir.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".release-", dir=outdir.parent))
    try:
        built = build_project(
            srcdir, stage / "build", sdist=True, isolation=isolation, epoch=epoch, progress=say
        )
        final = stage / "final"
        final.mkdir()
        assert built.sdist is not None
        shutil.copy2(built.sdist, final / built.sdist.name)
        reports = []
        for flavor in table.flavors:
            say(f"repacking {flavor.name}")
            res = repack_wheel(
                built.wheel,
                name=flavor.name,
                tags=flavor.tags,
                requires=flavor.requires,
                outdir=final,
                epoch=epoch,
            )
            reports.append(verify_wheel(res.output, release=True))
        say(f"writing metapackage {table.metapackage}")
        meta = write_metapackage(final, table, info.version, epoch)
        reports.append(verify_wheel(meta, release=True))
        issues = check_release_set(reports, built.version.normalized, table)
        if issues:
            raise WheelVerificationError("release set checks failed", issues)
        artifacts = _describe(final, built.sdist.name, reports, table)
        sums = "".join(f"{a['sha256']}  {a['file']}\n" for a in artifacts)
        (final / "SHA256SUMS").write_text(sums, encoding="utf-8")
        manifest = {
            "schema": 1,
            "project": built.project,
            "version": info.as_dict(),
            "source_date_epoch": epoch,
            "git": git,
            "flavors": [
                {"extra": f.extra, "name": f.name, "tags": f.tags, "requires": list(f.requires)}
                for f in table.flavors
            ],
            "artifacts": artifacts,
            "checks": {"verified": len(artifacts), "release_set": "passed"},
        }
        (final / "release.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        outdir.mkdir(parents=True, exist_ok=True)
        for path in sorted(final.iterdir()):
            os.replace(path, outdir / path.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    for a in artifacts:
        a["path"] = str(outdir / str(a["file"]))
    return ReleaseResult(outdir, info, artifacts, outdir / "release.json", warnings)


def _describe(
    final: Path, sdist: str, reports: list[WheelReport], table: FlavorTable
) -> list[dict[str, object]]:
    meta = canonicalize_name(table.metapackage)
    out: list[dict[str, object]] = [{"file": sdist, "kind": "sdist"}]
    for r in reports:
        kind = "metapackage" if canonicalize_name(r.name) == meta else "flavor"
        out.append({"file": r.path.name, "kind": kind, "name": r.name, "version": r.version, "tags": r.tags})
    for a in out:
        path = final / str(a["file"])
        a["sha256"] = _sha256(path)
        a["size"] = path.stat().st_size
    return sorted(out, key=lambda a: str(a["file"]))


def make_dev_wheel(
    srcdir: str | Path,
    outdir: str | Path,
    *,
    local: str | None = None,
    flavor: str | None = None,
    isolation: bool = False,
    overwrite: bool = True,
    say: Say | None = None,
) -> tuple[VersionInfo, WheelReport]:
    """Build the default (or given) flavor as a dev wheel, optionally with ``+local``; verified."""
    srcdir = Path(srcdir).resolve()
    info = read_version_file(srcdir / "VERSION.txt")
    if local:
        info = with_local_label(info, local)
    table = load_flavors()
    chosen = table.get(flavor or table.default)
    epoch = source_date_epoch()
    with tempfile.TemporaryDirectory(prefix="thd-wheel-") as tmp:
        built = build_project(
            srcdir,
            Path(tmp) / "b",
            sdist=False,
            isolation=isolation,
            version=info.normalized,
            epoch=epoch,
            progress=say,
        )
        if say:
            say(f"repacking {chosen.name}")
        res = repack_wheel(
            built.wheel,
            name=chosen.name,
            tags=chosen.tags,
            requires=chosen.requires,
            outdir=outdir,
            overwrite=overwrite,
            epoch=epoch,
        )
    assert res.report is not None
    return info, verify_wheel(res.output)
