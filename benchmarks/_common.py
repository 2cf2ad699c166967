"""Shared benchmark plumbing: timing, FLOP counting, environment fingerprint, JSON output.

Every ``benchmarks/bench_*.py`` script writes one JSON document::

    {"benchmark": name, "env": env_fingerprint(), "config": {...},
     "records": [make_record(...), ...], ...script-specific summaries...}

A record is one (provider, mode, shape) measurement; a failed or unavailable provider is a
record with ``status`` ``"error"``/``"unavailable"`` and an ``error`` text, never an exception.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "MODE_FLOP_FACTORS",
    "attention_flops",
    "bench_back_to_back",
    "bench_ms",
    "command_line",
    "cuda_missing",
    "document_lengths",
    "env_fingerprint",
    "error_text",
    "host_time_us",
    "make_record",
    "offsets",
    "offsets_tensor",
    "package_version",
    "sync",
    "visible_pairs",
    "write_json",
]

# Backward = 2.5x forward (5 matmuls against 2), so forward+backward = 3.5x (attention-anchors §2.1).
MODE_FLOP_FACTORS: dict[str, float] = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
QUANTILES = (0.5, 0.2, 0.8)
# Settings that change what is measured (THD_AUTOTUNE=0 pins one config per kernel).
_ENV_VARS = ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")  # recorded besides every THD_* setting


def cuda_missing(script: str, device: str, needs: str = "a CUDA GPU") -> bool:
    """Whether a ``--device cuda`` run has no GPU (then says so on stderr: the script exits 1)."""
    if device == "cuda" and not torch.cuda.is_available():
        print(f"{script}: needs {needs} (or --device cpu for a smoke test)", file=sys.stderr)
        return True
    return False


def add_autograd_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--autograd-threads on|off``: whether CUDA backwards run on autograd's device thread (its
    default) or on the calling thread (``torch.autograd.set_multithreading_enabled(False)``)."""
    parser.add_argument(
        "--autograd-threads",
        choices=("on", "off"),
        default="on",
        help="off: every backward on the calling thread (torch.autograd.set_multithreading_enabled(False)), "
        "every provider alike",
    )


def autograd_threads(setting: str) -> contextlib.AbstractContextManager[None]:
    """The block's autograd multithreading as ``--autograd-threads`` says (in this thread)."""
    return torch.autograd.set_multithreading_enabled(setting == "on")  # type: ignore[return-value]


def autograd_multithreading() -> bool:
    """Whether backwards called from this thread now run on autograd's device threads."""
    public = getattr(torch.autograd, "is_multithreading_enabled", None)
    return bool(public() if public is not None else torch._C._is_multithreading_enabled())


def document_lengths(total: int, lo: int, hi: int, seed: int) -> list[int]:
    """Uniform random lengths in ``[lo, hi]`` filling exactly ``total`` tokens (the last one cut)."""
    rng = random.Random(seed)
    lengths: list[int] = []
    used = 0
    while used < total:
        n = min(rng.randint(lo, hi), total - used)
        lengths.append(n)
        used += n
    return lengths


def offsets(lengths: Iterable[int]) -> list[int]:
    """``[0, l0, l0 + l1, ...]``: the cumulative offsets of ``lengths``."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def offsets_tensor(lengths: Iterable[int], device: torch.device | str) -> torch.Tensor:
    """:func:`offsets` as an int32 tensor on ``device`` (``cu_seqlens`` / ``cu_seqlens_padded``)."""
    return torch.tensor(offsets(lengths), dtype=torch.int32, device=device)


def sync(device: torch.device | str | None = None) -> None:
    """Wait for the GPU: ``device`` when it is a CUDA device, any GPU when ``None``; no-op on CPU."""
    if device is None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    elif torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def visible_pairs(len_q: int, len_kv: int, *, causal: bool, window_left: int | None = None) -> float:
    """(query, key) pairs one sequence computes, in the FlashAttention counting convention.

    Full: ``Lq * Lk``. Causal: half of it (``L^2 / 2`` for self-attention, the diagonal not
    counted separately). Causal with a left window ``W`` (query i sees keys ``i - W .. i``):
    the causal triangle minus the triangle the window cuts off, ``L^2/2 - (L - W)^2/2`` when
    ``L > W`` (self-attention only).
    """
    area = float(len_q) * float(len_kv)
    if not causal:
        return area
    if window_left is None or window_left < 0 or len_q != len_kv or len_q <= window_left:
        return area / 2.0
    return (float(len_q) ** 2 - float(len_q - window_left) ** 2) / 2.0


def attention_flops(
    lens_q: Iterable[int],
    lens_kv: Iterable[int],
    heads_q: int,
    head_dim: int,
    *,
    head_dim_v: int | None = None,
    causal: bool,
    mode: str = "fwd",
    window_left: int | None = None,
) -> float:
    """FLOPs of varlen attention over real tokens only, FlashAttention convention.

    Forward: ``2 * Hq * (D + Dv) * sum(Lq_b * Lk_b)`` (= ``4 * H * D * sum(L^2)`` for
    self-attention with ``Dv = D``), halved when causal (see :func:`visible_pairs` for a left
    window); counted by query heads under GQA. ``mode`` scales it by :data:`MODE_FLOP_FACTORS`.
    """
    dim_v = head_dim if head_dim_v is None else head_dim_v
    area = sum(
        visible_pairs(lq, lk, causal=causal, window_left=window_left)
        for lq, lk in zip(lens_q, lens_kv, strict=True)
    )
    fwd = 2.0 * heads_q * (head_dim + dim_v) * area
    return fwd * MODE_FLOP_FACTORS[mode]


def bench_ms(
    fn: Callable[[], object],
    *,
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
    grad_to_none: Sequence[torch.Tensor] | None = None,
) -> dict[str, float]:
    """Median / p20 / p80 wall time of ``fn`` in milliseconds.

    On CUDA this is ``triton.testing.do_bench`` (CUDA events, L2 flush between calls); without
    a GPU a host ``perf_counter`` loop stands in, so scripts can be smoke-tested on a CPU.
    """
    if torch.cuda.is_available():
        import triton.testing

        median, p20, p80 = triton.testing.do_bench(
            fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none, quantiles=list(QUANTILES)
        )
        return {"median_ms": float(median), "p20_ms": float(p20), "p80_ms": float(p80)}
    times: list[float] = []
    deadline = time.perf_counter() + rep_ms / 1e3
    fn()  # warm-up
    while len(times) < 3 or time.perf_counter() < deadline:
        if grad_to_none is not None:
            for t in grad_to_none:
                t.grad = None
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    cuts = statistics.quantiles(times, n=10, method="inclusive")
    return {"median_ms": statistics.median(times), "p20_ms": cuts[1], "p80_ms": cuts[7]}


def bench_back_to_back(
    fn: Callable[[], object],
    *,
    rep_ms: float = 100.0,
    trials: int = 5,
    warmup_calls: int = 3,
    max_calls: int = 2000,
) -> dict[str, float]:
    """Milliseconds per call of ``fn`` called back to back between one pair of CUDA events.

    After ``warmup_calls`` calls (compiles, autotuning, allocator warm-up) one timed call
    estimates the cost; each of ``trials`` trials then times ``calls`` consecutive calls
    (about ``rep_ms / trials`` of device time) between two events with no synchronization or
    cache flush in between, as a training step issues them. Returns the median, min and max
    over trials of the per-call time, and the number of calls per trial. Without a GPU a
    ``perf_counter`` loop stands in (smoke tests only).
    """
    for _ in range(warmup_calls):
        fn()
    if not torch.cuda.is_available():
        start_s = time.perf_counter()
        fn()
        est_ms = max((time.perf_counter() - start_s) * 1e3, 1e-3)
        calls = int(max(1, min(max_calls, round(rep_ms / trials / est_ms))))
        per_call = []
        for _ in range(trials):
            start_s = time.perf_counter()
            for _ in range(calls):
                fn()
            per_call.append((time.perf_counter() - start_s) * 1e3 / calls)
        return _trial_stats(per_call, calls, trials)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    est_ms = max(start.elapsed_time(end), 1e-3)
    calls = int(max(1, min(max_calls, round(rep_ms / trials / est_ms))))
    per_call = []
    for _ in range(trials):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / calls)
    return _trial_stats(per_call, calls, trials)


def _trial_stats(per_call: list[float], calls: int, trials: int) -> dict[str, float]:
    return {
        "median_ms": statistics.median(per_call),
        "min_ms": min(per_call),
        "max_ms": max(per_call),
        "calls_per_trial": calls,
        "trials": trials,
    }


def host_time_us(fn: Callable[[], object], *, calls: int = 500, warmup_calls: int = 50) -> dict[str, float]:
    """Wall-clock microseconds per call over ``calls`` back-to-back calls, one sync at the end.

    Meant for a problem so small that the host (Python, dispatch, launches) is the bottleneck.
    ``device_us`` is the per-call time between CUDA events around the same loop. ``issue_us`` is
    the host's time per call to issue the loop, before the final sync: close to ``wall_us`` when
    the host bounded the loop, well below it when the device did (the launch queue absorbs the
    calls and the sync waits for the device to drain it).
    """
    for _ in range(warmup_calls):
        fn()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    if cuda:
        end.record()
        torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) * 1e6 / calls
    result = {"wall_us": wall_us, "issue_us": (issued - t0) * 1e6 / calls, "calls": calls}
    if cuda:
        result["device_us"] = start.elapsed_time(end) * 1e3 / calls
    return result


def make_record(
    *,
    op: str,
    provider: str,
    mode: str,
    shape: dict[str, Any],
    flops: float | None = None,
    timing: dict[str, float] | None = None,
    status: str = "ok",
    error: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """One JSON record; ``tflops`` is derived from ``flops`` and the median time."""
    record: dict[str, Any] = {"op": op, "provider": provider, "mode": mode, "shape": shape, "status": status}
    if timing is not None:
        record.update(timing)
        if flops is not None and timing["median_ms"] > 0:
            record["tflops"] = flops / (timing["median_ms"] * 1e-3) / 1e12
    if flops is not None:
        record["flops"] = flops
    if error is not None:
        record["error"] = error
    record.update(extra)
    return record


def error_text(exc: BaseException, limit: int = 500) -> str:
    """``Type: message`` of an exception, first line kept short for the JSON."""
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _git_sha() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{sha}-dirty" if dirty else sha


def package_version(*names: str) -> str | None:
    """Installed version of the first distribution in ``names`` that is found, else None."""
    from importlib import metadata

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def command_line(argv: Sequence[str] | None = None, script: str = "") -> str:
    """The command that started this process, shell-quoted, with the settings that change it; or,
    for a ``main(argv)`` called in-process, ``script`` and ``argv`` shell-quoted."""
    if argv is not None:
        return shlex.join([script, *argv])
    names = sorted(k for k in os.environ if k.startswith("THD_")) + [k for k in _ENV_VARS if k in os.environ]
    env = " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in names)
    argv = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    return f"{env} {argv}".strip()


def env_fingerprint() -> dict[str, Any]:
    """Facts needed to compare two result files: device, versions, git sha, UTC time."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "device_count": torch.cuda.device_count() if cuda else 0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "git_sha": _git_sha(),
        "env_vars": {k: os.environ[k] for k in _ENV_VARS if k in os.environ},
        "utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _finite(value: Any) -> Any:
    """JSON-safe copy: non-finite floats become the strings ``"nan"``, ``"inf"``, ``"-inf"``."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` atomically (temp file in the same directory, then ``os.replace``)."""
    payload = _finite(payload)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(payload, fh, indent=1, allow_nan=False, default=str)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
