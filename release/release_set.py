"""The release set: the sdist, the core wheel, the flavor wheels, sums and manifest.

The core wheel ``thd-kernels`` (code, ``torch``/``triton``/``numpy`` and the ``transformers``
extra, as ``pyproject.toml`` declares them) is what ``pip install thd-kernels`` takes; each
flavor is the same code repacked under its own name and tags with extra requirements, an
alternative to it. Everything is produced in a staging directory next to the output directory
and moved in only after every artifact and the set as a whole passed verification; each
wheel's report comes from the pass that wrote it (build or repack), nothing is read twice.
``overwrite`` replaces the files of a previous release set in the output directory (see
:func:`make_release`).
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

from packaging.utils import canonicalize_name

from release.build import build_project
from release.errors import Issue, ReleaseError, WheelVerificationError
from release.flavors import load_flavors
from release.repack import repack_wheel, source_date_epoch
from release.verify import WheelReport
from release.version import VersionInfo, read_version_file, with_local_label

__all__ = [
    "ReleaseResult",
    "check_release_set",
    "default_epoch",
    "make_dev_wheel",
    "make_release",
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


def check_release_set(
    reports: Sequence[WheelReport], sdist_version: str | None, alternatives: Sequence[str]
) -> list[Issue]:
    """One version string everywhere and no file owned by two co-installable wheels.

    ``alternatives`` are the distributions of which one is installed (the core and its flavors:
    they ship the same files by design).
    """
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
    either = {canonicalize_name(n) for n in alternatives}
    for i, a in enumerate(reports):
        for b in reports[i + 1 :]:
            if {canonicalize_name(a.name), canonicalize_name(b.name)} <= either:
                continue
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
    overwrite: bool = False,
    say: Say | None = None,
) -> ReleaseResult:
    """Build, repack, verify and publish the whole release set into an empty ``outdir``.

    With ``overwrite`` the output directory may hold a previous release set: only files named
    like release artifacts (``*.whl``, ``*.tar.gz``, ``SHA256SUMS``, ``release.json``) are
    replaced or removed, only after the new set passed every check; anything else makes it
    refuse, and nothing outside ``outdir`` is touched.
    """
    srcdir, outdir = Path(srcdir).resolve(), Path(outdir).resolve()
    say = say or (lambda _m: None)
    info = read_version_file(srcdir / "VERSION.txt")
    info.require_release()
    table = load_flavors(flavors) if flavors else load_flavors()
    stale = _previous_release(outdir, overwrite)
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
        shutil.copy2(built.wheel, final / built.wheel.name)
        core = built.wheel_report  # release rules: the version was checked public above
        core.path = final / built.wheel.name
        reports = [core]
        digests: dict[str, str] = {}  # file name -> sha256, from the repack that wrote it
        for flavor in table.flavors:
            say(f"repacking {flavor.name}")
            res = repack_wheel(
                built.wheel,
                name=flavor.name,
                tags=flavor.tags,
                requires=flavor.requires,
                outdir=final,
                release=True,
                hash_output=True,
                epoch=epoch,
            )
            assert res.report is not None and res.sha256 is not None
            reports.append(res.report)
            digests[res.output.name] = res.sha256
        alternatives = [built.project, *(f.name for f in table.flavors)]
        issues = check_release_set(reports, built.version.normalized, alternatives)
        if issues:
            raise WheelVerificationError("release set checks failed", issues)
        artifacts = _describe(final, built.sdist.name, reports, built.project, digests)
        sums = "".join(f"{a['sha256']}  {a['file']}\n" for a in artifacts)
        (final / "SHA256SUMS").write_text(sums, encoding="utf-8")
        manifest = {
            "schema": 2,
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
        new = {p.name for p in final.iterdir()}
        for path in sorted(final.iterdir()):
            os.replace(path, outdir / path.name)
        for path in stale:
            if path.name not in new:
                path.unlink(missing_ok=True)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    for a in artifacts:
        a["path"] = str(outdir / str(a["file"]))
    return ReleaseResult(outdir, info, artifacts, outdir / "release.json", warnings)


_ARTIFACT_NAMES = ("SHA256SUMS", "release.json")
_ARTIFACT_SUFFIXES = (".whl", ".tar.gz")


def _previous_release(outdir: Path, overwrite: bool) -> list[Path]:
    """The files of a previous release set that ``overwrite`` may replace; refuse anything else."""
    if not outdir.exists():
        return []
    if not outdir.is_dir():
        raise ReleaseError(f"{outdir}: expected an output directory, got a file")
    present = sorted(outdir.iterdir())
    if not present:
        return []
    if not overwrite:
        raise ReleaseError(
            f"{outdir}: output directory is not empty; expected an empty or new directory\n"
            "run 'make clean' (removes dist/) first, or pass --overwrite (make release OVERWRITE=1) "
            "to replace a previous release set"
        )
    foreign = [
        p.name
        for p in present
        if not p.is_file()
        or p.is_symlink()
        or not (p.name in _ARTIFACT_NAMES or p.name.endswith(_ARTIFACT_SUFFIXES))
    ]
    if foreign:
        raise ReleaseError(
            f"{outdir}: --overwrite replaces only release artifacts (*.whl, *.tar.gz, SHA256SUMS, "
            f"release.json); expected nothing else, got {foreign[:5]}"
        )
    return present


def _describe(
    final: Path, sdist: str, reports: list[WheelReport], project: str, digests: dict[str, str]
) -> list[dict[str, object]]:
    core = canonicalize_name(project)
    out: list[dict[str, object]] = [{"file": sdist, "kind": "sdist"}]
    for r in reports:
        kind = "wheel" if canonicalize_name(r.name) == core else "flavor"
        out.append({"file": r.path.name, "kind": kind, "name": r.name, "version": r.version, "tags": r.tags})
    for a in out:
        path = final / str(a["file"])
        a["sha256"] = digests.get(path.name) or _sha256(path)
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
    return info, res.report
