"""Timing of the attention benchmark: per shape every (provider, mode), the dense matmul peak and
the host time per eager call; every failure becomes a record, never an exception.

Modes ``fwd`` (no autograd) and ``fwd_bwd`` (forward, then ``torch.autograd.grad`` of q, k, v with
a fixed output gradient). Each time is per call, calls issued back to back between one pair of
CUDA events (no cache flush, no sync in between), median of the trials. A provider's ``THD_*``
settings (:attr:`Provider.env`) are set around each of its measurements and restored after.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from _common import attention_flops, bench_back_to_back, error_text, host_time_us, make_record, sync
from attention_providers import (
    FACTORIES,
    PADDED_PROVIDERS,
    VARIANT_PROVIDERS,
    Attn,
    LayoutSpec,
    Problem,
    Provider,
    Unsupported,
    is_thd,
    kernel_family_ran,
)
from torch import Tensor

__all__ = ["HOST_PROVIDERS", "Settings", "combine_rounds", "dense_matmul", "host_overhead", "measure_problem"]

HOST_PROVIDERS = ("thd-tl", "thd-gluon", "thd", "fa4", "cudnn", "varlen_attn")


@dataclass(frozen=True)
class Settings:
    """How long and how often to time (from the command line)."""

    modes: tuple[str, ...] = ("fwd", "fwd_bwd")
    rep_ms: float = 100.0
    trials: int = 5
    rounds: int = 1
    host_calls: int = 500
    host_head_dim: int = 128
    seed: int = 0


@contextmanager
def environment(overrides: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``overrides`` inside the block, as it was after it."""
    saved = {name: os.environ.get(name) for name in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def timed_fn(call: Attn, p: Problem, mode: str) -> Callable[[], object]:
    """The zero-argument function one measurement of ``mode`` calls back to back."""
    if mode == "fwd":

        def fwd() -> object:
            with torch.no_grad():
                return call(p.q, p.k, p.v)

        return fwd
    leaves = [t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v)]

    def fwd_bwd() -> object:
        return torch.autograd.grad(call(*leaves), leaves, p.do)

    return fwd_bwd


def _providers_for(p: Problem, providers: Sequence[str]) -> list[str]:
    if p.variant.name != "causal":
        return [x for x in providers if x in VARIANT_PROVIDERS]
    if p.padded:
        return [x for x in providers if x in PADDED_PROVIDERS]
    return list(providers)


def _family(provider: Provider, name: str, mode: str) -> dict[str, str]:
    """thd providers: the kernel family asked for (``THD_KERNELS``, ``auto`` when unset) and, where
    thd reports it, the implementation that ran the measurement just taken."""
    if not is_thd(name):
        return {}
    ran = {
        "kernel_family_requested": provider.env.get("THD_KERNELS", "auto"),
        "kernel_family": kernel_family_ran("forward"),
        "kernel_family_backward": kernel_family_ran("backward") if mode != "fwd" else None,
    }
    return {k: v for k, v in ran.items() if v is not None}


def _status_of(provider: str, exc: Exception) -> str:
    """``unavailable`` for what a provider does not offer (a forced thd family that refuses the
    call included), else ``error``."""
    if isinstance(exc, (ImportError, AttributeError, Unsupported)):
        return "unavailable"
    return "unavailable" if is_thd(provider) and "THD_KERNELS" in str(exc) else "error"


@dataclass
class _Ready:
    """A provider that passed its warm-up, with what its records carry besides the timing."""

    base: dict[str, Any]
    provider: Provider
    extra: dict[str, Any]


def _prepare(p: Problem, providers: Sequence[str], modes: Sequence[str]) -> tuple[list[_Ready], list[dict]]:
    """Build and warm up each provider (compiles, autotunes) and cross-check its output on real
    rows against the first one's (recorded, never asserted); failures become records."""
    ready: list[_Ready] = []
    records: list[dict[str, Any]] = []
    first: tuple[str, Tensor] | None = None
    for name in _providers_for(p, providers):
        base = {"op": "attention", "provider": name, "shape": p.shape}
        try:
            provider = FACTORIES[name](p)
            extra: dict[str, Any] = {}
            started = time.monotonic()
            with environment(provider.env), torch.no_grad():
                out = provider.call(p.q, p.k, p.v)[p.real_rows].float()
            sync()
            extra["first_call_s"] = round(time.monotonic() - started, 2)
            if first is None:
                first = (name, out)
            else:
                extra[f"max_abs_diff_vs_{first[0]}"] = float((out - first[1]).abs().max())
        except Exception as exc:
            records += [
                make_record(**base, mode=m, status=_status_of(name, exc), error=error_text(exc))
                for m in modes
            ]
            continue
        ready.append(_Ready(base, provider, extra))
    return ready, records


def measure_problem(p: Problem, providers: Sequence[str], settings: Settings) -> list[dict[str, Any]]:
    """All (provider, mode) records of one shape. With ``rounds > 1`` every (provider, mode) is
    timed once per round, the providers taking turns, and the record holds the median over rounds
    (slow drifts of the GPU's clock then hit every provider alike)."""
    ready, records = _prepare(p, providers, settings.modes)
    timings: dict[tuple[str, str], list[dict[str, float]]] = {}
    errors: dict[tuple[str, str], Exception] = {}
    families: dict[tuple[str, str], dict[str, str]] = {}
    for _ in range(settings.rounds):
        for item in ready:
            for mode in settings.modes:
                key = (item.base["provider"], mode)
                if key in errors:
                    continue
                try:
                    with environment(item.provider.env):
                        fn = timed_fn(item.provider.call, p, mode)
                        timing = bench_back_to_back(fn, rep_ms=settings.rep_ms, trials=settings.trials)
                    timings.setdefault(key, []).append(timing)
                    families[key] = _family(item.provider, key[0], mode)
                except Exception as exc:
                    errors[key] = exc
                finally:
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
    for item in ready:
        for mode in settings.modes:
            key = (item.base["provider"], mode)
            flops = attention_flops(
                p.lengths, p.lengths, p.heads, p.head_dim, causal=True, mode=mode,
                window_left=p.variant.window_left,
            )  # fmt: skip
            if key in errors:
                status = _status_of(key[0], errors[key])
                error = error_text(errors[key])
                records.append(
                    make_record(**item.base, mode=mode, flops=flops, status=status, error=error, **item.extra)
                )
            else:
                timing = combine_rounds(timings[key])
                extra = {**item.extra, **families[key]}
                records.append(make_record(**item.base, mode=mode, flops=flops, timing=timing, **extra))
    return records


def combine_rounds(rounds: Sequence[dict[str, float]]) -> dict[str, Any]:
    """One timing from the per-round timings of :func:`bench_back_to_back`: the median of the
    round medians, the extremes over all trials, and every round's median."""
    if len(rounds) == 1:
        return dict(rounds[0])
    return {
        "median_ms": statistics.median(r["median_ms"] for r in rounds),
        "min_ms": min(r["min_ms"] for r in rounds),
        "max_ms": max(r["max_ms"] for r in rounds),
        "calls_per_trial": rounds[0]["calls_per_trial"],
        "trials": sum(r["trials"] for r in rounds),
        "round_median_ms": [r["median_ms"] for r in rounds],
    }


def dense_matmul(n: int, settings: Settings, device: str) -> dict[str, Any]:
    """bf16 ``[n, n] @ [n, n]`` TFLOP/s, timed like the attention calls."""
    base = {"op": "matmul", "provider": "torch.matmul", "mode": "fwd", "shape": {"n": n, "dtype": "bfloat16"}}
    try:
        a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
        c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
        timing = bench_back_to_back(
            lambda: torch.matmul(a, b, out=c), rep_ms=settings.rep_ms, trials=settings.trials
        )
        return make_record(**base, flops=2.0 * n**3, timing=timing)
    except Exception as exc:
        return make_record(**base, status="error", error=error_text(exc))


def _tiny_problem(settings: Settings, device: str) -> Problem:
    """2 documents of 64 tokens, 2 heads: a problem the host, not the GPU, bounds."""
    gen = torch.Generator(device=device).manual_seed(settings.seed)
    q, k, v, do = (
        torch.randn(128, 2, settings.host_head_dim, device=device, generator=gen, dtype=torch.bfloat16)
        for _ in range(4)
    )
    cu = torch.tensor([0, 64, 128], dtype=torch.int32, device=device)
    return Problem(
        spec=LayoutSpec(128, "64-1024"), lengths=[64, 64], heads=2, head_dim=settings.host_head_dim,
        q=q, k=k, v=v, do=do, cu=cu, cu_slots=cu, seqused=cu.diff(),
        real_rows=torch.ones(128, dtype=torch.bool, device=device),
    )  # fmt: skip


def host_overhead(providers: Sequence[str], settings: Settings, device: str) -> list[dict[str, Any]]:
    """Wall time per eager call on a tiny problem (:func:`_tiny_problem`): host bound."""
    p = _tiny_problem(settings, device)
    shape = {"tokens": 128, "docs": 2, "heads": 2, "head_dim": settings.host_head_dim, "causal": True}
    records = []
    for name in [x for x in providers if x in HOST_PROVIDERS]:
        for mode in settings.modes:
            base = {"op": "host_time", "provider": name, "mode": mode, "shape": shape}
            try:
                provider = FACTORIES[name](p)
                with environment(provider.env):
                    timing = host_time_us(timed_fn(provider.call, p, mode), calls=settings.host_calls)
                records.append(make_record(**base, **timing, **_family(provider, name, mode)))
            except Exception as exc:
                records.append(make_record(**base, status=_status_of(name, exc), error=error_text(exc)))
    return records
