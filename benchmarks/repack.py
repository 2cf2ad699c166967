"""Benchmark: ``python -m release repack`` of a real wheel vs ``wheel unpack`` + edit + ``wheel pack``.

The input is the real ``transformer_engine_cu12`` 2.20.2 wheel (729 MB file, 695 MiB of
compressed members, one 981 MiB shared library), fetched once into the git-ignored
``benchmarks/.wheels/`` with::

    python -m pip download --no-deps --only-binary :all: transformer-engine-cu12==2.20.2 -d benchmarks/.wheels

Measured, each command in a fresh child process (wall time, and peak RSS through
``resource.getrusage(RUSAGE_CHILDREN)``), the runs of all methods interleaved and repeated:

* ``repack``: rename to ``transformer-engine-renamed`` (the whole check of ``verify`` on the
  input, one streaming pass, the output verified from what the pass knows);
* ``baseline``: ``wheel unpack``, rename the dist-info and edit ``Name`` in METADATA, ``wheel pack``;
* ``floor``: one read + inflate + sha256 pass over every member with the standard library's
  ``zipfile`` (which also checks each CRC), single-threaded, writing nothing;
* ``floor_isal``: the same pass with ISA-L's inflater (``isal``, what repack uses when it is
  installed) and a CRC per member, when ``isal`` is installed;
* ``repack_zlib``: the repack command with ``RELEASE_INFLATE=zlib`` (the standard library's
  inflater).

Peak RSS of ``repack`` is also measured on a small synthetic wheel (~2 MiB) to show it does not
grow with the wheel. The machine is shared, so the load average is recorded before every run
and the medians are compared.

    python benchmarks/repack.py --out benchmarks/results/repack.json
"""

from __future__ import annotations

import argparse
import filecmp
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
import zlib
from datetime import datetime, timezone
from pathlib import Path

__all__ = ["main"]

REPO = Path(__file__).resolve().parents[1]
DEFAULT_WHEEL = (
    REPO / "benchmarks" / ".wheels" / "transformer_engine_cu12-2.20.2-py3-none-manylinux_2_28_x86_64.whl"
)
TARGET_NAME = "transformer-engine-renamed"
_MEASURE = r"""
import json, resource, subprocess, sys, time
t = time.perf_counter()
rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode
wall = time.perf_counter() - t
use = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"rc": rc, "wall_s": wall, "cpu_s": use.ru_utime + use.ru_stime,
                  "peak_rss_mb": use.ru_maxrss / 1024}))
"""
_FLOOR = r"""
import hashlib, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as zf:
    for info in zf.infolist():
        digest = hashlib.sha256()
        with zf.open(info) as fp:
            while chunk := fp.read(1 << 20):
                digest.update(chunk)
"""


_FLOOR_ISAL = r"""
import hashlib, struct, sys, zipfile, zlib
from isal import isal_zlib
with zipfile.ZipFile(sys.argv[1]) as zf, open(sys.argv[1], "rb") as fp:
    for info in zf.infolist():
        fp.seek(info.header_offset)
        name_len, extra_len = struct.unpack("<HH", fp.read(30)[26:30])
        fp.seek(info.header_offset + 30 + name_len + extra_len)
        inflater = isal_zlib.decompressobj(-15) if info.compress_type == zipfile.ZIP_DEFLATED else None
        digest, crc, left = hashlib.sha256(), 0, info.compress_size
        while left:
            raw = fp.read(min(left, 1 << 20))
            left -= len(raw)
            while raw or inflater is not None:
                piece = raw if inflater is None else inflater.decompress(raw, 1 << 20)
                raw = b"" if inflater is None else inflater.unconsumed_tail
                digest.update(piece)
                crc = zlib.crc32(piece, crc)
                if inflater is None or inflater.eof or (not piece and not raw):
                    break
        assert crc == info.CRC, info.filename
"""


def isal_version() -> str | None:
    try:
        import importlib.metadata

        return importlib.metadata.version("isal")
    except Exception:
        return None


def measure(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> dict[str, float]:
    """Run ``cmd`` under a fresh measuring parent; return its wall time and peak RSS."""
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, *cmd],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
        env=None if env is None else {**os.environ, **env},
    )
    result = json.loads(out.stdout)
    if result["rc"] != 0:
        raise SystemExit(f"command failed ({result['rc']}): {' '.join(cmd)}")
    return result


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_repack(src: Path, outdir: Path, inflater: str | None = None) -> dict[str, object]:
    """The repack command (``inflater``: ``RELEASE_INFLATE`` for it; default: the fastest)."""
    shutil.rmtree(outdir, ignore_errors=True)
    wn = src.name.split("-")
    cmd = [sys.executable, "-m", "release", "repack", str(src), "--name", TARGET_NAME]
    cmd += ["--tag", "-".join(wn[-3:])[: -len(".whl")], "--outdir", str(outdir), "--quiet"]
    env = None if inflater is None else {"RELEASE_INFLATE": inflater}
    return {"load_before": load(), **measure(cmd, REPO, env)}


def run_baseline(src: Path, work: Path) -> dict[str, object]:
    """``wheel unpack`` + edit + ``wheel pack`` (what TE's build_wheels.sh does)."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    before = load()
    unpack = measure([sys.executable, "-m", "wheel", "unpack", "-d", str(work), str(src)], REPO)
    t = time.perf_counter()
    (tree,) = work.iterdir()
    (old_di,) = tree.glob("*.dist-info")
    version = old_di.name[: -len(".dist-info")].split("-")[1]
    new_di = tree / f"{TARGET_NAME.replace('-', '_')}-{version}.dist-info"
    old_di.rename(new_di)
    lines = (new_di / "METADATA").read_text(encoding="utf-8").split("\n")
    name_line = next(i for i, line in enumerate(lines) if line.startswith("Name: "))
    lines[name_line] = f"Name: {TARGET_NAME}"
    (new_di / "METADATA").write_text("\n".join(lines), encoding="utf-8")
    edit = time.perf_counter() - t
    (work / "out").mkdir()
    pack = measure([sys.executable, "-m", "wheel", "pack", "-d", str(work / "out"), str(tree)], REPO)
    return {
        "load_before": before,
        "unpack_s": unpack["wall_s"],
        "edit_s": edit,
        "pack_s": pack["wall_s"],
        "wall_s": unpack["wall_s"] + edit + pack["wall_s"],
        "cpu_s": unpack["cpu_s"] + edit + pack["cpu_s"],
        "peak_rss_mb": max(unpack["peak_rss_mb"], pack["peak_rss_mb"]),
    }


def run_floor(src: Path, script: str = _FLOOR) -> dict[str, object]:
    return {"load_before": load(), **measure([sys.executable, "-c", script, str(src)], REPO)}


def make_small_wheel(path: Path) -> Path:
    """A ~2 MiB wheel (one 1.5 MiB incompressible member and a few small ones)."""
    import base64
    import hashlib

    def row(name: str, data: bytes) -> str:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        return f"{name},sha256={digest},{len(data)}"

    di = "smallpkg-1.0.dist-info"
    members = [("smallpkg/lib.so", os.urandom(3 << 19))]
    members += [(f"smallpkg/m{i}.py", b"x = %d\n" % i * 200) for i in range(20)]
    members += [
        (f"{di}/METADATA", b"Metadata-Version: 2.1\nName: smallpkg\nVersion: 1.0\n"),
        (f"{di}/WHEEL", b"Wheel-Version: 1.0\nGenerator: bench\nRoot-Is-Purelib: false\nTag: py3-none-any\n"),
    ]
    record = "\n".join([*(row(n, d) for n, d in members), f"{di}/RECORD,,"]) + "\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in [*members, (f"{di}/RECORD", record.encode())]:
            zf.writestr(zipfile.ZipInfo(name, (2024, 1, 1, 0, 0, 0)), data)
    return path


def describe(path: Path) -> dict[str, object]:
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
    largest = max(infos, key=lambda i: i.compress_size)
    return {
        "file": path.name,
        "file_bytes": path.stat().st_size,
        "members": len(infos),
        "compressed_mib": round(sum(i.compress_size for i in infos) / 2**20, 1),
        "uncompressed_mib": round(sum(i.file_size for i in infos) / 2**20, 1),
        "largest_member": {
            "name": largest.filename,
            "compressed_mib": round(largest.compress_size / 2**20, 1),
            "uncompressed_mib": round(largest.file_size / 2**20, 1),
        },
    }


def fingerprint() -> dict[str, object]:
    def version_of(module: str) -> str:
        code = f"import importlib.metadata as m; print(m.version({module!r}))"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor(),
    )  # fmt: skip
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "git_sha": git("rev-parse", "HEAD") or None,
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "wheel": version_of("wheel"),
        "packaging": version_of("packaging"),
        "zlib": zlib.ZLIB_RUNTIME_VERSION,
        "isal": isal_version(),
        "note": "2 cores, possibly shared with other agents: load_before is os.getloadavg() before each run",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="result JSON path")
    parser.add_argument(
        "--wheel", type=Path, default=DEFAULT_WHEEL, help="input wheel (default: the TE wheel)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs of each method (default: 3)")
    parser.add_argument("--tmpdir", type=Path, default=None, help="scratch space (~3 GiB)")
    args = parser.parse_args(argv)
    if not args.wheel.is_file():
        raise SystemExit(
            f"{args.wheel}: no such file; fetch it with: python -m pip download --no-deps "
            "--only-binary :all: transformer-engine-cu12==2.20.2 -d benchmarks/.wheels"
        )
    methods = ["floor", "repack", "baseline", "repack_small", "repack_zlib"]
    if isal_version() is not None:
        methods.append("floor_isal")
    runs: dict[str, list[dict[str, object]]] = {m: [] for m in methods}
    with tempfile.TemporaryDirectory(prefix="thd-bench-repack-", dir=args.tmpdir) as tmp:
        base = Path(tmp)
        small = make_small_wheel(base / "smallpkg-1.0-py3-none-any.whl")
        for i in range(args.repeat):
            for method, run in (
                ("floor", lambda: run_floor(args.wheel)),
                ("floor_isal", lambda: run_floor(args.wheel, _FLOOR_ISAL)),
                ("repack", lambda: run_repack(args.wheel, base / "ours")),
                ("repack_zlib", lambda: run_repack(args.wheel, base / "ours_zlib", inflater="zlib")),
                ("baseline", lambda: run_baseline(args.wheel, base / "baseline")),
                ("repack_small", lambda: run_repack(small, base / "small")),
            ):
                if method not in runs:
                    continue
                runs[method].append(run())
                print(f"run {i} {method}: {runs[method][-1]}", file=sys.stderr, flush=True)
        sys.path.insert(0, str(REPO))
        from release.verify import verify_wheel

        (out_ours,) = (base / "ours").glob("*.whl")
        (out_zlib,) = (base / "ours_zlib").glob("*.whl")
        (out_base,) = (base / "baseline" / "out").glob("*.whl")
        verify_wheel(out_ours)
        if not filecmp.cmp(out_ours, out_zlib, shallow=False):
            raise SystemExit("repack wrote different bytes with isal's and zlib's inflaters")
        same_name = out_ours.name == out_base.name
        input_info, output_bytes = describe(args.wheel), out_ours.stat().st_size
    median = {m: statistics.median(float(r["wall_s"]) for r in rs) for m, rs in runs.items()}
    median_cpu = {m: statistics.median(float(r["cpu_s"]) for r in rs) for m, rs in runs.items()}
    rss = {m: max(float(r["peak_rss_mb"]) for r in rs) for m, rs in runs.items()}
    speedup = median["baseline"] / median["repack"]
    fastest_floor = min(median[m] for m in ("floor", "floor_isal") if m in median)
    of_floor = median["repack"] / fastest_floor
    result = {
        "benchmark": "wheel rename (repack) of the real transformer_engine_cu12 2.20.2 wheel",
        "command": " ".join(
            ["python", "benchmarks/repack.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "environment": fingerprint(),
        "input": input_info,
        "output_bytes": output_bytes,
        "same_output_name_as_baseline": same_name,
        "methods": {
            "repack": f"python -m release repack WHEEL --name {TARGET_NAME} --tag <same tags> (one pass)",
            "baseline": "python -m wheel unpack; rename the dist-info, edit METADATA Name; "
            "python -m wheel pack",
            "floor": "one read + inflate + sha256 pass over every member (zipfile, one thread, no output)",
            "floor_isal": "the floor's pass with isal's inflater and a CRC per member (one thread)",
            "repack_zlib": "the repack command with RELEASE_INFLATE=zlib",
            "inflater": "repack uses isal's inflater when isal is installed (release/inflate.py)",
            "repack_small": "the repack command on a ~2 MiB synthetic wheel (peak RSS vs wheel size)",
        },
        "runs": runs,
        "median_wall_s": median,
        "median_cpu_s": median_cpu,
        "peak_rss_mb": rss,
        "speedup_vs_baseline": speedup,
        "repack_over_floor": of_floor,
        "repack_over_floor_note": "against the faster of floor and floor_isal",
        "repack_zlib_speedup_vs_baseline": median["baseline"] / median["repack_zlib"],
        "cpu_speedup_vs_baseline": median_cpu["baseline"] / median_cpu["repack"],
        "cpu_repack_over_floor": median_cpu["repack"] / median_cpu["floor"],
        "floor_speedup_vs_baseline": median["baseline"] / median["floor"],
        "floor_isal_speedup_vs_baseline": (
            median["baseline"] / median["floor_isal"] if "floor_isal" in median else None
        ),
        "goals": {
            "speedup_at_least_15x": speedup >= 15,
            "within_2x_of_floor": of_floor <= 2,
            "rss_flat_in_wheel_size": rss["repack"] <= 1.5 * rss["repack_small"],
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    keys = (
        "median_wall_s",
        "median_cpu_s",
        "peak_rss_mb",
        "speedup_vs_baseline",
        "repack_over_floor",
        "goals",
    )
    print(json.dumps({k: result[k] for k in keys}, indent=1), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
