"""Benchmark: ``python -m release repack`` vs ``wheel unpack`` + edit + ``wheel pack``.

Builds a ~1 GiB synthetic wheel (a few large incompressible members and many small
compressible ones) in a temporary directory, renames and retags it with both methods and
records wall time and peak RSS of each command (measured in a fresh child process through
``resource.getrusage(RUSAGE_CHILDREN)``), plus an environment fingerprint.

    python benchmarks/repack.py --out benchmarks/results/repack.json
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from datetime import datetime, timezone
from pathlib import Path

__all__ = ["main"]

REPO = Path(__file__).resolve().parents[1]
NAME, VERSION = "bigpkg", "1.0.dev0"
TARGET_NAME, TARGET_TAG = "bigpkg-cu12", "py3-none-manylinux_2_28_x86_64"
_MEASURE = r"""
import json, resource, subprocess, sys, time
t = time.perf_counter()
rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode
wall = time.perf_counter() - t
print(json.dumps({"rc": rc, "wall_s": wall,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def make_wheel(path: Path, large: int, large_mib: int, small: int, small_kib: int) -> dict[str, int]:
    """Write the synthetic input wheel member by member (constant memory)."""
    di = f"{NAME}-{VERSION}.dist-info"
    rows = []
    text = b"".join(
        b"def f%d(x):\n    return x * %d  # padding padding padding\n" % (i, i) for i in range(400)
    )
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        for i in range(large):
            name = f"{NAME}/lib/libkernels_{i}.so"
            digest, size = hashlib.sha256(), 0
            with zf.open(zipfile.ZipInfo(name, (2024, 1, 1, 0, 0, 0)), "w", force_zip64=True) as fp:
                for _ in range(large_mib):
                    chunk = os.urandom(1 << 20)
                    fp.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
            rows.append(f"{name},sha256={_b64(digest.digest())},{size}")
        for i in range(small):
            name = f"{NAME}/mod_{i // 100}/m{i}.py"
            data = (b"# %d\n" % i + text * (small_kib * 1024 // len(text) + 1))[: small_kib * 1024]
            zf.writestr(zipfile.ZipInfo(name, (2024, 1, 1, 0, 0, 0)), data, compresslevel=6)
            rows.append(f"{name},sha256={_b64(hashlib.sha256(data).digest())},{len(data)}")
        meta = f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n\nA synthetic wheel.\n".encode()
        wheel = b"Wheel-Version: 1.0\nGenerator: bench\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        for member, data in (("METADATA", meta), ("WHEEL", wheel)):
            zf.writestr(f"{di}/{member}", data)
            rows.append(f"{di}/{member},sha256={_b64(hashlib.sha256(data).digest())},{len(data)}")
        rows.append(f"{di}/RECORD,,")
        zf.writestr(f"{di}/RECORD", "\n".join(rows) + "\n")
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
    return {
        "file_bytes": path.stat().st_size,
        "uncompressed_bytes": sum(i.file_size for i in infos),
        "members": len(infos),
        "large_members": large,
        "large_member_mib": large_mib,
        "small_members": small,
        "small_member_kib": small_kib,
    }


def measure(cmd: list[str], cwd: Path) -> dict[str, float]:
    """Run ``cmd`` under a fresh measuring parent; return its wall time and peak RSS."""
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, *cmd], cwd=cwd, capture_output=True, text=True, check=True
    )
    result = json.loads(out.stdout)
    if result["rc"] != 0:
        raise SystemExit(f"command failed ({result['rc']}): {' '.join(cmd)}")
    return result


def run_ours(src: Path, outdir: Path, env_python: str) -> dict[str, float]:
    shutil.rmtree(outdir, ignore_errors=True)
    cmd = [
        env_python,
        "-m",
        "release",
        "repack",
        str(src),
        "--name",
        TARGET_NAME,
        "--tag",
        TARGET_TAG,
        "--outdir",
        str(outdir),
        "--quiet",
    ]
    return measure(cmd, REPO)


def run_baseline(src: Path, work: Path, env_python: str) -> dict[str, float]:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    unpack = measure([env_python, "-m", "wheel", "unpack", "-d", str(work), str(src)], REPO)
    t = time.perf_counter()
    tree = work / f"{NAME}-{VERSION}"
    old_di = tree / f"{NAME}-{VERSION}.dist-info"
    new_di = tree / f"{TARGET_NAME.replace('-', '_')}-{VERSION}.dist-info"
    old_di.rename(new_di)
    meta = (new_di / "METADATA").read_text().replace(f"Name: {NAME}\n", f"Name: {TARGET_NAME}\n", 1)
    (new_di / "METADATA").write_text(meta)
    wheel = (new_di / "WHEEL").read_text().replace("Tag: py3-none-any", f"Tag: {TARGET_TAG}")
    (new_di / "WHEEL").write_text(wheel)
    edit = time.perf_counter() - t
    (work / "out").mkdir()
    pack = measure([env_python, "-m", "wheel", "pack", "-d", str(work / "out"), str(tree)], REPO)
    return {
        "unpack_s": unpack["wall_s"],
        "edit_s": edit,
        "pack_s": pack["wall_s"],
        "wall_s": unpack["wall_s"] + edit + pack["wall_s"],
        "peak_rss_mb": max(unpack["peak_rss_mb"], pack["peak_rss_mb"]),
    }


def fingerprint(env_python: str) -> dict[str, object]:
    def version_of(module: str) -> str:
        code = f"import importlib.metadata as m; print(m.version({module!r}))"
        return subprocess.run([env_python, "-c", code], capture_output=True, text=True).stdout.strip()

    sha = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "git_sha": sha or None,
        "utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "wheel": version_of("wheel"),
        "packaging": version_of("packaging"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="result JSON path")
    parser.add_argument("--large", type=int, default=6, help="number of large incompressible members")
    parser.add_argument("--large-mib", type=int, default=128, help="size of each large member (MiB)")
    parser.add_argument("--small", type=int, default=4000, help="number of small compressible members")
    parser.add_argument("--small-kib", type=int, default=64, help="size of each small member (KiB)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each method")
    parser.add_argument("--tmpdir", type=Path, default=None, help="where the ~4 GiB of scratch files go")
    args = parser.parse_args(argv)
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="thd-bench-repack-", dir=args.tmpdir) as tmp:
        base = Path(tmp)
        src = base / "in" / f"{NAME}-{VERSION}-py3-none-any.whl"
        src.parent.mkdir()
        t = time.perf_counter()
        info = make_wheel(src, args.large, args.large_mib, args.small, args.small_kib)
        info["generate_s"] = time.perf_counter() - t
        print(f"input: {info}", file=sys.stderr)
        ours, baseline = [], []
        for i in range(args.repeat):
            baseline.append(run_baseline(src, base / "baseline", py))
            print(f"baseline run {i}: {baseline[-1]}", file=sys.stderr)
            ours.append(run_ours(src, base / "ours", py))
            print(f"ours run {i}: {ours[-1]}", file=sys.stderr)
        out_ours = next((base / "ours").glob("*.whl"))
        out_base = next((base / "baseline" / "out").glob("*.whl"))
        sys.path.insert(0, str(REPO))
        from release.verify import verify_wheel

        verify_wheel(out_ours)
        both_named = out_ours.name == out_base.name
    ours_wall = statistics.median(r["wall_s"] for r in ours)
    base_wall = statistics.median(r["wall_s"] for r in baseline)
    ours_rss = max(r["peak_rss_mb"] for r in ours)
    result = {
        "benchmark": "wheel rename + retag (repack)",
        "environment": fingerprint(py),
        "input": info,
        "target": {"name": TARGET_NAME, "tag": TARGET_TAG},
        "ours": {
            "command": "python -m release repack (verifies input hashes and the full output)",
            "runs": ours,
            "median_wall_s": ours_wall,
            "peak_rss_mb": ours_rss,
        },
        "baseline": {
            "command": "python -m wheel unpack; rename dist-info, edit METADATA/WHEEL; python -m wheel pack",
            "runs": baseline,
            "median_wall_s": base_wall,
            "peak_rss_mb": max(r["peak_rss_mb"] for r in baseline),
        },
        "same_output_name": both_named,
        "speedup": base_wall / ours_wall,
        "goals": {"speedup_at_least_5x": base_wall / ours_wall >= 5, "peak_rss_below_150mb": ours_rss < 150},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("speedup", "goals")}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
