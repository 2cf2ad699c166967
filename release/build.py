"""Build the sdist and the core wheel with pypa ``build``'s Python API from a staged copy.

The project is copied (git-tracked and untracked-but-not-ignored files; or the whole tree
minus build outputs without git) to a temporary directory, so stale ``build/`` trees never
leak into artifacts and the working tree is never written to. Artifact paths come from the
API's return values. The wheel is built from the sdist when both are requested.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import canonicalize_name

from release.errors import BuildFailed, Issue, WheelVerificationError
from release.metadata import get_first
from release.safety import check_path
from release.verify import WheelReport, verify_wheel
from release.version import VersionInfo, normalize_version, read_version_file
from release.wheelname import escape_name

__all__ = ["BuildResult", "build_project", "check_sdist", "project_name", "stage_source"]

_SKIP = shutil.ignore_patterns(
    ".git",
    ".venv*",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
    "*.whl",
)


@dataclass
class BuildResult:
    """Paths of the built artifacts and the version they carry."""

    version: VersionInfo
    project: str
    wheel: Path
    sdist: Path | None
    wheel_report: WheelReport

    def as_dict(self) -> dict[str, object]:
        return {
            "project": self.project,
            "version": self.version.as_dict(),
            "wheel": str(self.wheel),
            "sdist": str(self.sdist) if self.sdist else None,
        }


def project_name(srcdir: Path) -> str:
    """``[project].name`` from ``pyproject.toml``."""
    try:
        import tomllib
    except ImportError:  # pragma: no cover - Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    path = srcdir / "pyproject.toml"
    try:
        name = tomllib.loads(path.read_text(encoding="utf-8"))["project"]["name"]
    except (OSError, KeyError, ValueError) as exc:
        raise BuildFailed(f"{path}: cannot read [project].name: {exc}", exc) from exc
    return str(name)


def stage_source(srcdir: Path, dest: Path) -> Path:
    """Copy the project's source files into ``dest`` and return it."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=srcdir,
            capture_output=True,
            check=True,
        )
        files = [f for f in out.stdout.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
    if not files:
        shutil.copytree(srcdir, dest, ignore=_SKIP, symlinks=True)
        return dest
    for rel in files:
        src = srcdir / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def _runner(env: Mapping[str, str]) -> Callable[..., None]:
    def run(
        cmd: Sequence[str], cwd: str | None = None, extra_environ: Mapping[str, str] | None = None
    ) -> None:
        merged = {**(extra_environ or {}), **env}
        subprocess.run(
            cmd,
            cwd=cwd,
            env={**os.environ, **merged},
            check=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

    return run


def _build_one(srcdir: Path, dist: str, outdir: Path, isolation: bool, env: Mapping[str, str]) -> Path:
    import build
    import build.env

    try:
        if isolation:
            with build.env.DefaultIsolatedEnv() as ienv:
                builder = build.ProjectBuilder.from_isolated_env(ienv, srcdir, runner=_runner(env))
                ienv.install(builder.build_system_requires)
                ienv.install(builder.get_requires_for_build(dist))
                return Path(builder.build(dist, outdir))
        builder = build.ProjectBuilder(srcdir, python_executable=sys.executable, runner=_runner(env))
        # [build-system].requires first: an old backend may not even be able to answer the hook.
        missing = {m for req in builder.build_system_requires for m in build.check_dependency(req)}
        missing = missing or builder.check_dependencies(dist)
        if missing:
            raise BuildFailed(
                f"build {dist}: build requirements missing from {sys.executable}: "
                f"expected installed, got missing {sorted(' -> '.join(m) for m in missing)} "
                "(run 'make setup-release' or pass --isolation)"
            )
        return Path(builder.build(dist, outdir))
    except build.BuildBackendException as exc:
        output = getattr(exc.exception, "output", b"") or b""
        tail = output.decode("utf-8", "replace")[-3000:]
        raise BuildFailed(f"build {dist}: the backend failed: {exc}\n{tail}", exc) from exc
    except build.BuildException as exc:
        raise BuildFailed(f"build {dist}: {exc}", exc) from exc


def check_sdist(path: Path, name: str, version: str) -> list[Issue]:
    """File name, top directory, PKG-INFO Name/Version and member paths of an sdist."""
    issues: list[Issue] = []
    stem = f"{escape_name(name)}-{version}"
    if path.name != f"{stem}.tar.gz":
        issues.append(Issue("invalid-filename", path.name, "file name", f"expected {stem + '.tar.gz'!r}"))
    try:
        with tarfile.open(path, "r:gz") as tar:
            pkg_info = None
            for member in tar.getmembers():
                why = check_path(member.name)
                if why or (not member.name.startswith(stem + "/") and member.name != stem):
                    issues.append(Issue("unsafe-path", path.name, member.name, f"expected under {stem}/"))
                if member.issym() or member.islnk():
                    issues.append(Issue("symlink-entry", path.name, member.name, "expected a regular file"))
                if member.name == f"{stem}/PKG-INFO":
                    fobj = tar.extractfile(member)
                    pkg_info = fobj.read() if fobj else b""
    except (tarfile.TarError, OSError) as exc:
        return [*issues, Issue("bad-archive", path.name, "archive", f"expected a .tar.gz, got {exc}")]
    if pkg_info is None:
        return [*issues, Issue("structure", path.name, f"{stem}/PKG-INFO", "expected the file, got nothing")]
    meta_name, meta_version = get_first(pkg_info, "Name"), get_first(pkg_info, "Version")
    if meta_name is None or canonicalize_name(meta_name) != canonicalize_name(name):
        issues.append(
            Issue("name-mismatch", path.name, "PKG-INFO: Name", f"expected {name!r}, got {meta_name!r}")
        )
    if meta_version != version:
        issues.append(
            Issue(
                "version-mismatch",
                path.name,
                "PKG-INFO: Version",
                f"expected {version!r}, got {meta_version!r}",
            )
        )
    return issues


def build_project(
    srcdir: str | Path,
    outdir: str | Path,
    *,
    sdist: bool = True,
    isolation: bool = False,
    version: str | None = None,
    epoch: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> BuildResult:
    """Build into a fresh (absent or empty) ``outdir``; check name and normalized version.

    ``version`` replaces ``VERSION.txt`` in the staged copy (dev builds with a local label);
    the real file is never written.
    """
    srcdir, outdir = Path(srcdir).resolve(), Path(outdir).resolve()
    info = normalize_version(version, "--version") if version else read_version_file(srcdir / "VERSION.txt")
    name = project_name(srcdir)
    if outdir.exists() and any(outdir.iterdir()):
        raise BuildFailed(f"{outdir}: output directory is not empty; expected a fresh directory")
    outdir.mkdir(parents=True, exist_ok=True)
    env = {"SOURCE_DATE_EPOCH": str(epoch)} if epoch is not None else {}
    say = progress or (lambda _msg: None)
    with tempfile.TemporaryDirectory(prefix="thd-build-") as tmp:
        stage = stage_source(srcdir, Path(tmp) / "src")
        if version:
            (stage / "VERSION.txt").write_text(info.normalized + "\n", encoding="utf-8")
        wheel_src = stage
        sdist_path = None
        if sdist:
            say("building sdist")
            sdist_path = _build_one(stage, "sdist", outdir, isolation, env)
            issues = check_sdist(sdist_path, name, info.normalized)
            if issues:
                raise WheelVerificationError(f"{sdist_path.name}: sdist does not match the project", issues)
            with tarfile.open(sdist_path, "r:gz") as tar:
                tar.extractall(Path(tmp) / "sdist", filter="data")
            wheel_src = Path(tmp) / "sdist" / sdist_path.name[: -len(".tar.gz")]
        say("building wheel")
        wheel_path = _build_one(wheel_src, "wheel", outdir, isolation, env)
    report = verify_wheel(wheel_path)
    if canonicalize_name(report.name) != canonicalize_name(name) or report.version != info.normalized:
        raise BuildFailed(
            f"{wheel_path.name}: built wheel: expected {canonicalize_name(name)} {info.normalized!r}, "
            f"got {report.name} {report.version!r}"
        )
    return BuildResult(info, name, wheel_path, sdist_path, report)
