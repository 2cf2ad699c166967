"""Benchmark: packed causal documents, ``thd.attention`` against the attention users would pick.

Providers, all fed the same THD tensors ``[T, H, D]`` (bf16) and ``cu_seqlens`` (int32):

- ``thd``: ``thd.attention(..., causal=True)`` with ``max_seqlen`` given;
- ``varlen_attn``: ``torch.nn.attention.varlen.varlen_attn`` (causal: ``window_size=(-1, 0)``);
- ``flex``: compiled ``flex_attention`` on the ``[1, H, T, D]`` view with a document-causal
  ``BlockMask`` built once per shape, outside the timed region.

Modes ``fwd`` (no autograd) and ``fwd_bwd`` (forward then ``backward(do)``). TFLOP/s count real
tokens only: ``4 * H * D * sum(L^2) / 2`` forward, 3.5x that for forward+backward. A provider
that fails records its error; the run goes on.

    python benchmarks/bench_attention.py --out benchmarks/results/attention.json
"""

from __future__ import annotations

import argparse
import inspect
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from _common import attention_flops, bench_ms, env_fingerprint, error_text, make_record, write_json
from torch import Tensor

Attn = Callable[[Tensor, Tensor, Tensor], Tensor]

MIXES: dict[str, tuple[int, int]] = {"64-1024": (64, 1024), "256-4096": (256, 4096), "512-8192": (512, 8192)}
PROVIDERS = ("thd", "varlen_attn", "flex")
MODES = ("fwd", "fwd_bwd")
# Issue 4's goals: thd's speedup over each peer, per mode.
GOALS = {
    ("varlen_attn", "fwd"): 1.3,
    ("varlen_attn", "fwd_bwd"): 1.15,
    ("flex", "fwd"): 1.5,
    ("flex", "fwd_bwd"): 1.5,
}


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


@dataclass
class Problem:
    """One shape: packed documents and their bf16 q, k, v, do."""

    mix: str
    lengths: list[int]
    heads: int
    head_dim: int
    q: Tensor
    k: Tensor
    v: Tensor
    do: Tensor
    cu: Tensor

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    @property
    def shape(self) -> dict[str, Any]:
        return {
            "tokens": sum(self.lengths),
            "heads": self.heads,
            "head_dim": self.head_dim,
            "mix": self.mix,
            "docs": len(self.lengths),
            "max_doclen": self.max_len,
            "dtype": str(self.q.dtype).removeprefix("torch."),
            "causal": True,
        }

    @property
    def label(self) -> str:
        return f"T{sum(self.lengths)}-H{self.heads}-D{self.head_dim}-docs{self.mix}"


def make_problem(tokens: int, heads: int, head_dim: int, mix: str, seed: int, device: str) -> Problem:
    lengths = document_lengths(tokens, *MIXES[mix], seed=seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v, do = (
        torch.randn(tokens, heads, head_dim, device=device, generator=gen, dtype=torch.bfloat16)
        for _ in range(4)
    )
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    cu = torch.tensor(offsets, dtype=torch.int32, device=device)
    return Problem(mix, lengths, heads, head_dim, q, k, v, do, cu)


def thd_provider(p: Problem) -> Attn:
    import thd

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = thd.attention(q, k, v, p.cu, p.cu, max_seqlen_q=p.max_len, max_seqlen_kv=p.max_len, causal=True)
        assert isinstance(out, Tensor)
        return out

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


@cache
def _compiled_flex() -> Callable[..., Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(flex_attention, dynamic=False)


@cache
def _document_mask(tokens: int, device: str) -> tuple[Tensor, Callable[..., Tensor]]:
    """One document-id buffer and one ``mask_mod`` per token count.

    Shapes of the same size reuse both (the ids are copied in), so the compiled flex_attention
    sees the same mask function and is not recompiled for every document mix.
    """
    doc = torch.zeros(tokens, dtype=torch.int32, device=device)

    def document_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    return doc, document_causal


def flex_provider(p: Problem) -> Attn:
    from torch.nn.attention.flex_attention import create_block_mask

    device = p.q.device
    tokens = sum(p.lengths)
    doc, document_causal = _document_mask(tokens, str(device))
    lengths = torch.tensor(p.lengths, device=device)
    doc.copy_(
        torch.repeat_interleave(torch.arange(len(p.lengths), device=device, dtype=torch.int32), lengths)
    )
    block_mask = create_block_mask(document_causal, 1, None, tokens, tokens, device=str(device))
    flex = _compiled_flex()

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        def view(x: Tensor) -> Tensor:
            return x.transpose(0, 1).unsqueeze(0)  # [T, H, D] -> [1, H, T, D], no copy

        return flex(view(q), view(k), view(v), block_mask=block_mask)[0].transpose(0, 1)

    return call


FACTORIES: dict[str, Callable[[Problem], Attn]] = {
    "thd": thd_provider,
    "varlen_attn": varlen_provider,
    "flex": flex_provider,
}


def _timed_fn(call: Attn, p: Problem, mode: str) -> tuple[Callable[[], object], list[Tensor] | None]:
    if mode == "fwd":

        def fwd() -> object:
            with torch.no_grad():
                return call(p.q, p.k, p.v)

        return fwd, None
    leaves = [t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v)]

    def fwd_bwd() -> object:
        call(*leaves).backward(p.do)
        return None

    return fwd_bwd, leaves


def measure_problem(
    p: Problem, providers: Sequence[str], modes: Sequence[str], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """All (provider, mode) records of one shape; errors become records."""
    records: list[dict[str, Any]] = []
    reference_out: Tensor | None = None
    for provider in providers:
        base = {"op": "attention", "provider": provider, "shape": p.shape}
        try:
            call = FACTORIES[provider](p)
        except (ImportError, AttributeError) as exc:
            records += [
                make_record(**base, mode=m, status="unavailable", error=error_text(exc)) for m in modes
            ]
            continue
        except Exception as exc:
            records += [make_record(**base, mode=m, status="error", error=error_text(exc)) for m in modes]
            continue
        extra: dict[str, Any] = {}
        try:  # warm-up (compiles, autotunes) and a cross-check of outputs, never an assertion
            with torch.no_grad():
                out = call(p.q, p.k, p.v).float()
            if reference_out is None:
                reference_out = out
            else:
                extra["max_abs_diff_vs_first"] = float((out - reference_out).abs().max())
        except Exception as exc:
            records += [make_record(**base, mode=m, status="error", error=error_text(exc)) for m in modes]
            continue
        for mode in modes:
            flops = attention_flops(p.lengths, p.lengths, p.heads, p.head_dim, causal=True, mode=mode)
            try:
                fn, grads = _timed_fn(call, p, mode)
                timing = bench_ms(fn, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, grad_to_none=grads)
                records.append(make_record(**base, mode=mode, flops=flops, timing=timing, **extra))
            except Exception as exc:
                records.append(
                    make_record(**base, mode=mode, flops=flops, status="error", error=error_text(exc))
                )
            finally:
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    return records


def speedups(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per shape and mode: thd's speedup over each peer (peer median ms / thd median ms)."""
    times: dict[tuple[str, str], dict[str, float]] = {}
    for r in records:
        if r["status"] == "ok":
            key = (_label(r["shape"]), r["mode"])
            times.setdefault(key, {})[r["provider"]] = r["median_ms"]
    rows = []
    for (label, mode), by_provider in times.items():
        row: dict[str, Any] = {"shape": label, "mode": mode}
        for peer in ("varlen_attn", "flex"):
            if "thd" in by_provider and peer in by_provider:
                ratio = by_provider[peer] / by_provider["thd"]
                row[f"thd/{peer}"] = ratio
                row[f"thd/{peer}_meets_goal"] = ratio >= GOALS[(peer, mode)]
        rows.append(row)
    return rows


def _label(shape: dict[str, Any]) -> str:
    return f"T{shape['tokens']}-H{shape['heads']}-D{shape['head_dim']}-docs{shape['mix']}"


def print_summary(records: list[dict[str, Any]], ratios: list[dict[str, Any]]) -> None:
    print(f"{'shape':<32} {'mode':<8} {'provider':<12} {'median ms':>10} {'TFLOP/s':>8}  status")
    for r in records:
        ms = f"{r['median_ms']:.3f}" if "median_ms" in r else "-"
        tf = f"{r['tflops']:.1f}" if "tflops" in r else "-"
        print(f"{_label(r['shape']):<32} {r['mode']:<8} {r['provider']:<12} {ms:>10} {tf:>8}  {r['status']}")
    for row in ratios:
        parts = [f"{k}={v:.2f}" for k, v in row.items() if k.startswith("thd/") and isinstance(v, float)]
        if parts:
            print(f"{row['shape']:<32} {row['mode']:<8} speedup {'  '.join(parts)}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--mixes", nargs="+", choices=list(MIXES), default=list(MIXES))
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-ms", type=float, default=25.0)
    parser.add_argument("--rep-ms", type=float, default=100.0)
    parser.add_argument(
        "--budget-s", type=float, default=900.0, help="stop starting new shapes after this many seconds"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.monotonic()
    records: list[dict[str, Any]] = []
    skipped: list[str] = []
    for head_dim in args.head_dims:
        for tokens in args.tokens:
            for i, mix in enumerate(args.mixes):
                p = make_problem(tokens, args.heads, head_dim, mix, args.seed + i, device)
                if time.monotonic() - started > args.budget_s:
                    skipped.append(p.label)
                    continue
                print(f"[bench_attention] {p.label} ({len(p.lengths)} docs)", file=sys.stderr, flush=True)
                records += measure_problem(p, args.providers, args.modes, args)
    ratios = speedups(records)
    payload = {
        "benchmark": "attention",
        "env": env_fingerprint(),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "ratio_definition": "thd/<peer> = peer median ms / thd median ms (= TFLOP/s ratio; > 1: thd faster)",
        "goals": {f"thd/{peer} {mode}": goal for (peer, mode), goal in GOALS.items()},
        "records": records,
        "ratios": ratios,
        "skipped_for_budget": skipped,
        "wall_s": round(time.monotonic() - started, 1),
    }
    write_json(args.out, payload)
    print_summary(records, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
