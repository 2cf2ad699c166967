"""Command line: ``python -m release {version,build,repack,verify,release,wheel}``.

From the repository root ``python -m release``; from anywhere ``python PATH/TO/release`` (this
file puts the repository on ``sys.path``), and ``--project`` defaults to that repository.
Exit status 0 on success, 1 on a :class:`ReleaseError` (one ``ERROR:`` line and indented
issues on stderr), 2 on usage errors (argparse, or an invalid ``--name``/``--tag``/``--requires``).
``--json`` prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

if not __package__:  # run as ``python PATH/TO/release``: make ``import release`` find this package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from release.errors import Issue, ReleaseError
from release.progress import Progress

_REPO = Path(__file__).resolve().parents[1]
_DEFAULT_PROJECT = _REPO if (_REPO / "pyproject.toml").is_file() else Path(".")

__all__ = ["build_parser", "main"]


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    common.add_argument("--quiet", "-q", action="store_true", help="no progress or warnings on stderr")
    project = argparse.ArgumentParser(add_help=False)
    project.add_argument(
        "--project",
        type=Path,
        default=_DEFAULT_PROJECT,
        metavar="DIR",
        help=f"project root with pyproject.toml and VERSION.txt (default: {_DEFAULT_PROJECT})",
    )
    isolation = argparse.ArgumentParser(add_help=False)
    isolation.add_argument(
        "--isolation",
        action="store_true",
        help="build in an isolated environment (default: this interpreter)",
    )

    parser = argparse.ArgumentParser(
        prog=prog or "python -m release",
        description="thd-kernels release tool: normalized versions, zip-to-zip repack, strict wheel checks. "
        "Exit status: 0 ok, 1 failure (an ERROR: line on stderr), 2 usage error.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, parents: list[argparse.ArgumentParser], summary: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=parents, help=summary, description=summary)

    p = add("version", [common, project], "print the normalized version of VERSION.txt")
    p.add_argument("--release", action="store_true", help="refuse local versions ('+label')")
    p.add_argument("--file", type=Path, metavar="PATH", help="version file (default: PROJECT/VERSION.txt)")

    p = add("build", [common, project, isolation], "build the sdist and the core wheel from a staged copy")
    p.add_argument(
        "--outdir",
        type=Path,
        default=Path("dist"),
        metavar="DIR",
        help="fresh output directory (default: dist)",
    )
    p.add_argument("--no-sdist", action="store_true", help="build the wheel only")

    p = add("repack", [common], "rename and retag a wheel zip-to-zip (checked like verify, one pass)")
    p.add_argument("wheel", type=Path, metavar="WHEEL", help="the input wheel (never modified)")
    p.add_argument("--name", required=True, help="new distribution name, e.g. thd-kernels-cu12")
    p.add_argument(
        "--tag",
        action="append",
        required=True,
        metavar="TAGS",
        help="compressed tag set, e.g. py3-none-manylinux_2_28_x86_64 (repeatable)",
    )
    p.add_argument(
        "--requires",
        action="append",
        default=[],
        metavar="REQ",
        help="Requires-Dist line to add, e.g. 'nvidia-cuda-runtime-cu12>=12.4,<13' (repeatable)",
    )
    p.add_argument("--outdir", type=Path, metavar="DIR", help="output directory (default: the input's)")
    p.add_argument(
        "--allow-extension-retag",
        action="store_true",
        help="allow py3-none tags on a wheel with CPython extension modules",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a different existing output")
    p.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")

    p = add("verify", [common], "check wheels; print OK per good wheel, report every issue of the others")
    p.add_argument("wheels", type=Path, nargs="+", metavar="WHEEL", help="wheel file(s) to check")
    p.add_argument("--release", action="store_true", help="also refuse local versions")
    p.add_argument("--max-size", type=int, metavar="BYTES", help="uncompressed size limit (default: 16 GiB)")
    p.add_argument(
        "--max-ratio", type=float, metavar="R", help="per-member compression ratio limit (default: 200)"
    )

    p = add("release", [common, project, isolation], "build the verified release set")
    p.add_argument(
        "--outdir",
        type=Path,
        default=Path("dist"),
        metavar="DIR",
        help="empty output directory (default: dist)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a previous release set in DIR (only *.whl, *.tar.gz, SHA256SUMS, release.json; "
        "after the new set passed every check)",
    )
    p.add_argument(
        "--flavors", type=Path, metavar="FILE", help="flavor table (default: release/flavors.json)"
    )

    p = add("wheel", [common, project, isolation], "dev wheel of one flavor, with a local version label")
    p.add_argument("--outdir", type=Path, required=True, metavar="DIR", help="output directory")
    p.add_argument("--local", metavar="LABEL", help="local version label, e.g. g1a2b3c4")
    p.add_argument("--flavor", metavar="NAME", help="flavor ('extra' in flavors.json; default: its default)")
    return parser


def _cmd_version(args: argparse.Namespace, progress: Progress) -> tuple[dict[str, object], str]:
    from release.version import read_version_file

    info = read_version_file(args.file or args.project / "VERSION.txt")
    if args.release:
        info.require_release()
    return info.as_dict(), info.normalized


def _cmd_build(args: argparse.Namespace, progress: Progress) -> tuple[dict[str, object], str]:
    from release.build import build_project

    res = build_project(
        args.project, args.outdir, sdist=not args.no_sdist, isolation=args.isolation, progress=progress.step
    )
    return res.as_dict(), "\n".join(str(p) for p in (res.sdist, res.wheel) if p)


def _cmd_repack(args: argparse.Namespace, progress: Progress) -> tuple[dict[str, object], str]:
    from release.repack import repack_wheel

    res = repack_wheel(
        args.wheel,
        name=args.name,
        tags=args.tag,
        requires=args.requires,
        outdir=args.outdir,
        allow_extension_retag=args.allow_extension_retag,
        overwrite=args.overwrite,
        dry_run=args.dry_run,
        progress=progress.bytes,
    )
    _warn(args, res.warnings)
    if args.dry_run:
        lines = [f"would write {res.output}"] + [f"  {k}: {v}" for k, v in res.plan.items()]
        return res.as_dict(), "\n".join(lines)
    return res.as_dict(), f"{res.output}{'' if res.written else ' (unchanged)'}"


def _cmd_verify(args: argparse.Namespace, progress: Progress) -> tuple[dict[str, object], str]:
    from release.errors import WheelVerificationError
    from release.verify import Limits, inspect_wheel

    limits = Limits()
    if args.max_size is not None or args.max_ratio is not None:
        limits = Limits(
            max_total_size=args.max_size or limits.max_total_size,
            max_ratio=args.max_ratio or limits.max_ratio,
        )
    results, issues = [], []
    for wheel in args.wheels:
        progress.step(f"verifying {wheel.name}")
        report, found = inspect_wheel(wheel, release=args.release, limits=limits)
        _warn(args, report.warnings)
        results.append({**report.as_dict(), "ok": not found, "issues": [i.as_dict() for i in found]})
        issues += found
        if not found and not args.json:
            print(f"OK {wheel}", flush=True)
    if issues:
        bad = sum(1 for r in results if not r["ok"])
        raise WheelVerificationError(f"verify: {bad} of {len(results)} wheel(s) failed", issues)
    return {"wheels": results}, ""


def _cmd_release(args: argparse.Namespace, progress: Progress) -> tuple[dict[str, object], str]:
    from release.release_set import make_release

    res = make_release(
        args.project,
        args.outdir,
        isolation=args.isolation,
        flavors=args.flavors,
        overwrite=args.overwrite,
        say=progress.step,
    )
    if not args.quiet:
        for warning in res.warnings:
            print(f"WARNING: {warning}", file=sys.stderr)
    lines = [f"release {res.version.normalized} -> {res.outdir}"] + [f"  {a['file']}" for a in res.artifacts]
    return res.as_dict(), "\n".join(lines)


def _cmd_wheel(args: argparse.Namespace, progress: Progress) -> tuple[dict[str, object], str]:
    from release.release_set import make_dev_wheel

    info, report = make_dev_wheel(
        args.project,
        args.outdir,
        local=args.local,
        flavor=args.flavor,
        isolation=args.isolation,
        say=progress.step,
    )
    return {"version": info.as_dict(), "wheel": report.as_dict()}, str(report.path)


def _warn(args: argparse.Namespace, warnings: Sequence[Issue]) -> None:
    if not args.quiet:
        for warning in warnings:
            print(f"WARNING: {warning}", file=sys.stderr)


_COMMANDS = {
    "version": _cmd_version,
    "build": _cmd_build,
    "repack": _cmd_repack,
    "verify": _cmd_verify,
    "release": _cmd_release,
    "wheel": _cmd_wheel,
}


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Run one command; return the exit status (0 ok, 1 release error, 2 usage error)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    progress = Progress(quiet=args.quiet)
    try:
        payload, text = _COMMANDS[args.command](args, progress)
    except ReleaseError as exc:
        message = str(exc).splitlines() or [type(exc).__name__]
        print(f"ERROR: {message[0]}", file=sys.stderr)
        for line in message[1:]:
            print(f"    {line}", file=sys.stderr)
        for issue in exc.issues:
            print(f"    {issue}", file=sys.stderr)
        if args.json:
            error = {"code": exc.code, "message": str(exc), "issues": [i.as_dict() for i in exc.issues]}
            print(json.dumps({"ok": False, "command": args.command, "error": error}, indent=2))
        return 2 if exc.code == "usage" else 1
    if args.json:
        print(json.dumps({"ok": True, "command": args.command, **payload}, indent=2))
    elif text:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
