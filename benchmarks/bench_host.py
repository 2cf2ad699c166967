"""Host time per eager attention call on a tiny problem: thd against varlen_attn and FA4.

2 documents of 64 tokens, bf16, 16 heads, head dim 128, causal: the kernels take a few
microseconds, so a loop of calls issued back to back is bound by the host (Python, dispatch,
allocation, launches). Per provider and mode (``fwd`` under ``no_grad``; ``fwd_bwd``: forward
and ``torch.autograd.grad``) the record holds ``wall_us`` (``time.perf_counter`` over the loop,
one sync at its end) and ``device_us`` (CUDA events around the same loop; close to ``wall_us``
when the device bounded the loop), the median over ``--rounds`` rounds in which the providers
take turns, all in one process. thd's records name the kernel family that ran.

    python benchmarks/bench_host.py --out benchmarks/results/host-time.json
    python benchmarks/bench_host.py --device cpu --quick --out /tmp/host.json   # smoke test

Providers: ``thd``; ``varlen_attn`` (``torch.nn.attention.varlen.varlen_attn``, when this torch
has it); ``fa4`` (``flash_attn.cute.flash_attn_varlen_func``, when it imports); ``elementwise``
(``q * k + v``: not attention, the floor any autograd'd call pays). Missing ones get a record with
``status: unavailable``. ``--autograd-threads off`` runs every backward on the calling thread
instead of autograd's device thread. Goals (issue 22): thd's ``wall_us`` at most half
varlen_attn's, forward and forward+backward.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from _common import (
    add_autograd_threads_argument,
    autograd_multithreading,
    autograd_threads,
    command_line,
    env_fingerprint,
    error_text,
    host_time_us,
    make_record,
    package_version,
    write_json,
)
from attention_measure import timed_fn
from torch import Tensor

import thd
from thd.ops.attention import kernel_choice

Attn = Callable[[Tensor, Tensor, Tensor], Tensor]
GOAL = 0.5  # thd wall_us / varlen_attn wall_us, at most
MODES = ("fwd", "fwd_bwd")


class Problem:
    """The tiny packed batch every provider runs."""

    def __init__(
        self, device: str, heads: int, head_dim: int, docs: int, length: int, dtype: torch.dtype
    ) -> None:
        gen = torch.Generator(device=device).manual_seed(0)
        rows = docs * length
        self.q, self.k, self.v, self.do = (
            torch.randn(rows, heads, head_dim, device=device, dtype=dtype, generator=gen) for _ in range(4)
        )
        self.cu = torch.arange(0, rows + 1, length, dtype=torch.int32, device=device)
        self.max_len = length
        self.shape = {
            "docs": docs,
            "length": length,
            "heads": heads,
            "head_dim": head_dim,
            "dtype": str(dtype),
        }


def thd_provider(p: Problem) -> Attn:
    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = thd.attention(q, k, v, p.cu, p.cu, max_seqlen_q=p.max_len, max_seqlen_kv=p.max_len, causal=True)
        return out  # type: ignore[return-value]

    return call


def varlen_provider(p: Problem) -> Attn:
    from torch.nn.attention.varlen import varlen_attn

    # Causal is window_size=(-1, 0) since torch 2.10; the first release had is_causal.
    causal = (
        {"window_size": (-1, 0)}
        if "window_size" in inspect.signature(varlen_attn).parameters
        else {"is_causal": True}
    )

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return varlen_attn(q, k, v, p.cu, p.cu, p.max_len, p.max_len, **causal)

    return call


def fa4_provider(p: Problem) -> Attn:
    from flash_attn.cute import flash_attn_varlen_func

    kwargs = {
        "cu_seqlens_q": p.cu,
        "cu_seqlens_k": p.cu,
        "max_seqlen_q": p.max_len,
        "max_seqlen_k": p.max_len,
    }

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        result = flash_attn_varlen_func(q, k, v, causal=True, **kwargs)
        return result[0] if isinstance(result, tuple) else result

    return call


def elementwise_provider(p: Problem) -> Attn:
    """Not attention: ``q * k + v``, two elementwise kernels forward and backward. Its
    forward+backward is the least any autograd'd call costs on this host (the engine's turn
    included), a floor to read the attention providers' times against."""

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return q * k + v

    return call


PROVIDERS: dict[str, Callable[[Problem], Attn]] = {
    "thd": thd_provider,
    "varlen_attn": varlen_provider,
    "fa4": fa4_provider,
    "elementwise": elementwise_provider,
}


def measure(p: Problem, providers: Sequence[str], calls: int, rounds: int) -> list[dict[str, Any]]:
    """Records per (provider, mode): medians over ``rounds`` rounds, providers taking turns."""
    ready: dict[tuple[str, str], Callable[[], object]] = {}
    records: list[dict[str, Any]] = []
    for provider in providers:
        for mode in MODES:
            base = {"op": "host_time", "provider": provider, "mode": mode, "shape": p.shape}
            try:
                fn = timed_fn(PROVIDERS[provider](p), p, mode)  # p: q, k, v, do as it needs
                fn()  # compiles, or shows that the provider cannot run here
            except (ImportError, AttributeError) as exc:
                records.append(make_record(**base, status="unavailable", error=error_text(exc)))
                continue
            except Exception as exc:
                records.append(make_record(**base, status="error", error=error_text(exc)))
                continue
            ready[(provider, mode)] = fn
    rounds_of: dict[tuple[str, str], list[dict[str, float]]] = {key: [] for key in ready}
    for _ in range(rounds):
        for key, fn in ready.items():
            rounds_of[key].append(host_time_us(fn, calls=calls, warmup_calls=max(5, calls // 10)))
    for (provider, mode), timings in rounds_of.items():
        extra: dict[str, Any] = {"autograd_multithreading": autograd_multithreading()}
        if provider == "thd":
            for phase in ("forward", "backward") if mode == "fwd_bwd" else ("forward",):
                choice = kernel_choice(phase)
                extra[f"{phase}_family"] = None if choice is None else choice.family
        summary = {key: statistics.median(t[key] for t in timings) for key in timings[0] if key != "calls"}
        records.append(
            make_record(
                op="host_time", provider=provider, mode=mode, shape=p.shape, status="ok",
                calls=calls, rounds=rounds, round_wall_us=[t["wall_us"] for t in timings], **summary, **extra,
            )
        )  # fmt: skip
    return records


def ratios(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """thd's wall time per call over each peer's, per mode (< 1: thd cheaper), against the goal."""
    wall = {(r["provider"], r["mode"]): r["wall_us"] for r in records if r.get("status") == "ok"}
    rows = []
    for mode in MODES:
        for peer in ("varlen_attn", "fa4"):
            if ("thd", mode) in wall and (peer, mode) in wall:
                ratio = wall[("thd", mode)] / wall[(peer, mode)]
                row: dict[str, Any] = {"mode": mode, "peer": peer, "thd/peer wall": ratio}
                if peer == "varlen_attn":
                    row["meets_goal"] = ratio <= GOAL
                rows.append(row)
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke test: no kernels)")
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    parser.add_argument("--calls", type=int, default=500, help="calls per timed loop")
    parser.add_argument("--rounds", type=int, default=5, help="timed loops per (provider, mode)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--commit", default=None, help="commit the run is for (default: git HEAD)")
    parser.add_argument("--quick", action="store_true", help="20 calls, 1 round")
    add_autograd_threads_argument(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.calls, args.rounds = 20, 1
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    p = Problem(args.device, args.heads, args.head_dim, docs=2, length=64, dtype=dtype)
    with autograd_threads(args.autograd_threads):
        records = measure(p, args.providers, args.calls, args.rounds)
    env = env_fingerprint()
    env["fa4"] = package_version("flash-attn-4", "flash_attn_4", "flash-attn-cute")
    payload = {
        "benchmark": "host_time",
        "command": command_line(argv, "benchmarks/bench_host.py") if argv is not None else command_line(),
        "commit": args.commit or env["git_sha"],
        "env": env,
        "config": {**vars(args), "dtype": str(dtype)},
        "timing_definition": (
            "per-call us: wall_us = perf_counter over `calls` calls issued back to back, one sync at the "
            "end; issue_us = the same clock up to the end of the loop, before that sync (close to wall_us "
            "when the host bounded the loop); device_us = CUDA events around the same loop; median over "
            "`rounds` rounds, providers taking turns"
        ),
        "goal": f"thd wall_us <= {GOAL} x varlen_attn wall_us, fwd and fwd_bwd",
        "records": records,
        "ratios": ratios(records),
    }
    write_json(args.out, payload)
    for r in records:
        ok = r.get("status") == "ok"
        us = f"{r['wall_us']:8.1f} us (issue {r['issue_us']:.1f} us)" if ok else r.get("status")
        print(f"host time {r['provider']:<12} {r['mode']:<8} {us}", file=sys.stderr)
    for row in payload["ratios"]:
        print(f"thd/{row['peer']} {row['mode']}: {row['thd/peer wall']:.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
