"""Run every ``benchmarks/bench_*.py`` script (``make bench``) and print a short summary.

Each script runs in its own process as ``bench_<name>.py --out <out>/<name>.json``.
``bench_ring.py`` needs two GPUs and is skipped below that; it is started through ``torchrun``
on every visible GPU unless it spawns its own ranks (``mp.spawn``/``start_processes``). A
failing script is reported and the others still run; the exit status is 1 if any failed.

    python benchmarks/run_all.py --out benchmarks/results [--only attention ring] [--quick]

``--quick`` is passed on to the scripts that take it (a smoke run of each).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Scripts that need several GPUs: name -> minimum device count.
MULTI_GPU = {"ring": 2}


def _device_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _uses_torchrun(script: Path) -> bool:
    """Ring-style scripts either spawn their own ranks (mp.spawn) or expect torchrun's env."""
    source = script.read_text()
    spawns_itself = "mp.spawn" in source or "multiprocessing.spawn" in source or "start_processes" in source
    return not spawns_itself


def _takes_quick(script: Path) -> bool:
    return '"--quick"' in script.read_text()


def command_for(script: Path, out: Path, devices: int, quick: bool = False) -> list[str]:
    name = script.stem.removeprefix("bench_")
    base = [str(script), "--out", str(out)] + (["--quick"] if quick and _takes_quick(script) else [])
    if name in MULTI_GPU and _uses_torchrun(script):
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={devices}",
            *base,
        ]
    return [sys.executable, *base]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT / "src"), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def run_script(script: Path, out: Path, devices: int, timeout: float, quick: bool = False) -> dict[str, Any]:
    """Run one script; returns ``{"name", "status", "seconds", ...}``."""
    name = script.stem.removeprefix("bench_")
    need = MULTI_GPU.get(name, 0)
    if devices < need:
        return {"name": name, "status": "skipped", "reason": f"needs {need} GPUs, found {devices}"}
    cmd = command_for(script, out, devices, quick)
    print(f"[run_all] {' '.join(cmd)}", flush=True)
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"name": name, "status": "timeout", "seconds": round(time.monotonic() - started, 1)}
    seconds = round(time.monotonic() - started, 1)
    if proc.returncode != 0:
        return {"name": name, "status": f"failed (exit {proc.returncode})", "seconds": seconds}
    if not out.is_file():
        return {"name": name, "status": "failed (no JSON written)", "seconds": seconds}
    return {"name": name, "status": "ok", "seconds": seconds}


def _shape_text(shape: Any) -> str:
    if isinstance(shape, dict):
        return " ".join(f"{k}={v}" for k, v in shape.items() if k not in ("dtype", "causal"))
    return str(shape)


def summarize(out: Path) -> list[str]:
    """A few lines per result file: one per ok record (provider, mode, shape, ms, TFLOP/s)."""
    try:
        payload = json.loads(out.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return [f"  (cannot read {out.name}: {exc})"]
    lines = []
    records = payload.get("records", []) if isinstance(payload, dict) else []
    for r in records:
        if not isinstance(r, dict):
            continue
        ms = r.get("median_ms")
        tflops = r.get("tflops")
        host_us = r.get("wall_us")
        if isinstance(ms, int | float):
            timing = f"{ms:9.3f} ms"
        elif isinstance(host_us, int | float):
            timing = f"{host_us:6.0f} us/call (host)"
        else:
            timing = f"{r.get('status', '?'):>12}"
        rate = f"{tflops:7.1f} TFLOP/s" if isinstance(tflops, int | float) else ""
        what = f"{r.get('provider', '?')}/{r.get('mode', '?')}"
        lines.append(f"  {what:<22} {timing} {rate:<16} {_shape_text(r.get('shape', ''))}")
    for row in payload.get("ratios", []) if isinstance(payload, dict) else []:
        parts = [f"{k}={v:.2f}" for k, v in row.items() if "/" in k and isinstance(v, float)]
        if parts:
            lines.append(f"  speedup {row.get('mode', '')}: {' '.join(parts)}  [{row.get('shape', '')}]")
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Run all benchmarks/bench_*.py scripts.")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="directory for <name>.json")
    parser.add_argument("--only", nargs="+", help="names to run (e.g. attention ring); default all")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per script")
    parser.add_argument("--quick", action="store_true", help="smoke runs (scripts that take --quick)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    scripts = sorted(HERE.glob("bench_*.py"))
    if args.only:
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in args.only]
    devices = _device_count()
    results = []
    for script in scripts:
        out = args.out / f"{script.stem.removeprefix('bench_')}.json"
        results.append((run_script(script, out, devices, args.timeout, args.quick), out))
    print("\n== benchmark summary ==")
    for result, out in results:
        took = f" in {result['seconds']} s" if "seconds" in result else ""
        reason = f" ({result['reason']})" if "reason" in result else ""
        print(f"{result['name']}: {result['status']}{took}{reason}")
        if result["status"] == "ok":
            print("\n".join(summarize(out)))
    if not scripts:
        print("no benchmarks/bench_*.py scripts found")
    failed = [r for r, _ in results if r["status"] not in ("ok", "skipped")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
