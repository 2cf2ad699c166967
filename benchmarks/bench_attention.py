"""Benchmark: packed causal documents, ``thd.attention`` against the attention users would pick.

Providers, all fed the same THD tensors ``[T, H, D]`` (bf16) and int32 offsets:

- ``thd``: ``thd.attention(..., causal=True)`` with ``max_seqlen`` given; padded slots through
  ``cu_seqlens_*_padded``;
- ``fa4``: FlashAttention-4 (``flash_attn.cute.flash_attn_varlen_func``, CuTe DSL); padded
  slots as ``cu_seqlens_* = slot offsets`` plus ``seqused_* = real lengths``. Optional: a
  missing install is recorded as ``unavailable``;
- ``varlen_attn``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2; causal is
  ``window_size=(-1, 0)``), packed layouts only;
- ``flex``: compiled ``flex_attention`` on the ``[1, H, T, D]`` view with a document-causal
  ``BlockMask`` built once per shape, outside the timed region; packed layouts only.

Modes ``fwd`` (no autograd) and ``fwd_bwd`` (forward, then ``torch.autograd.grad`` of q, k, v
with a fixed output gradient). Each time is per call, calls issued back to back between one
pair of CUDA events (no cache flush, no sync in between), median of 5 trials. TFLOP/s count
real tokens only: ``2 * H * (D + Dv) * sum(visible pairs)`` forward with causal pairs counted
as ``L^2 / 2``, forward+backward 3.5x that. In the same run: the dense bf16 matmul
(8192^3) TFLOP/s, which every record is also reported as a fraction of, and the host time
per eager call on a tiny problem (2 documents of 64 tokens, 2 heads). ``--variants`` adds a
left window of 4096 (on the 32k/512-8192 documents and on one 32k document), softcap 50 and
attention sinks, thd against FA4, each skipped while ``thd.attention`` lacks the keyword.
A provider that fails records its error; the run goes on.

    python benchmarks/bench_attention.py --out benchmarks/results/attention.json
    python benchmarks/bench_attention.py --quick --out /tmp/attention-smoke.json
    python benchmarks/bench_attention.py --table benchmarks/results/attention.json  # README tables
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import torch
from _common import (
    MODE_FLOP_FACTORS,
    attention_flops,
    bench_back_to_back,
    command_line,
    env_fingerprint,
    error_text,
    host_time_us,
    make_record,
    package_version,
    write_json,
)
from torch import Tensor

Attn = Callable[[Tensor, Tensor, Tensor], Tensor]

MIXES: dict[str, tuple[int, int]] = {"64-1024": (64, 1024), "256-4096": (256, 4096), "512-8192": (512, 8192)}
# TOKENS:MIX[:SLOT] -- SLOT > 1 rounds every document's slot up to a multiple of SLOT rows
# (same documents and real tokens as the packed layout of that mix).
DEFAULT_LAYOUTS = (
    "16384:64-1024",
    "16384:256-4096",
    "32768:512-8192",
    "32768:512-8192:64",
    "32768:512-8192:128",
)
QUICK_LAYOUTS = ("4096:64-1024", "4096:64-1024:64")
ONE_DOCUMENT = "one-document"  # the "mix" of a variant run on a single document
PROVIDERS = ("thd", "fa4", "varlen_attn", "flex")
PADDED_PROVIDERS = ("thd", "fa4")  # the peers without a padded-slot interface are not run there
VARIANT_PROVIDERS = ("thd", "fa4")
MODES = ("fwd", "fwd_bwd")
PEERS = ("fa4", "varlen_attn", "flex")
# Goals, as thd's speedup (peer ms / thd ms) per mode: issue 10 (FlashAttention-4) and issue 4.
GOALS = {
    ("fa4", "fwd"): 0.9,
    ("fa4", "fwd_bwd"): 0.85,
    ("varlen_attn", "fwd"): 1.3,
    ("varlen_attn", "fwd_bwd"): 1.15,
    ("flex", "fwd"): 1.5,
    ("flex", "fwd_bwd"): 1.5,
}
PADDED_GOAL = 0.95  # padded-slot TFLOP/s at least 0.95x the packed layout's (issue 10)
FLOP_DEFINITION = (
    "real tokens only; forward = 2 * H * (D + Dv) * sum over documents of visible (query, key) pairs, "
    "causal pairs counted as L^2/2 (with a left window W: L^2/2 - (L-W)^2/2 when L > W); "
    f"fwd_bwd = {MODE_FLOP_FACTORS['fwd_bwd']}x forward; dense matmul = 2 * N^3"
)
TIMING_DEFINITION = (
    "per-call ms: calls issued back to back between one pair of CUDA events (no sync, no L2 flush in "
    "between), median over trials; fwd runs under no_grad, fwd_bwd is forward + torch.autograd.grad; "
    "with rounds > 1 the providers of a shape take turns, one timing each per round, and the median "
    "over rounds is reported"
)


@dataclass(frozen=True)
class LayoutSpec:
    tokens: int
    mix: str
    slot: int = 1

    @classmethod
    def parse(cls, text: str) -> LayoutSpec:
        parts = text.split(":")
        if len(parts) not in (2, 3) or parts[1] not in MIXES:
            raise argparse.ArgumentTypeError(
                f"expected TOKENS:MIX[:SLOT] with MIX in {list(MIXES)}, got {text!r}"
            )
        slot = int(parts[2]) if len(parts) == 3 else 1
        return cls(int(parts[0]), parts[1], max(slot, 1))

    @property
    def text(self) -> str:
        return f"{self.tokens}:{self.mix}" + (f":{self.slot}" if self.slot > 1 else "")


@dataclass(frozen=True)
class Variant:
    """Options beyond causal masking; every provider gets the same ones."""

    name: str = "causal"
    window_left: int | None = None
    softcap: float = 0.0
    sinks: bool = False
    one_document: bool = False

    def thd_kwargs(self) -> list[str]:
        """``thd.attention`` keywords this variant needs."""
        return (
            (["window_size"] if self.window_left is not None else [])
            + (["softcap"] if self.softcap else [])
            + (["sinks"] if self.sinks else [])
        )


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


def _offsets(lengths: Sequence[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


@dataclass
class Problem:
    """One shape: documents in slots, bf16 q, k, v, do over all rows, and the offsets."""

    spec: LayoutSpec
    lengths: list[int]
    heads: int
    head_dim: int
    q: Tensor
    k: Tensor
    v: Tensor
    do: Tensor
    cu: Tensor  # int32 [B+1] real offsets
    cu_slots: Tensor  # int32 [B+1] slot offsets (== cu when packed)
    seqused: Tensor  # int32 [B] real lengths
    real_rows: Tensor  # bool [rows]
    variant: Variant = field(default_factory=Variant)
    sinks: Tensor | None = None  # fp32 [H], values exactly representable in bf16

    @property
    def padded(self) -> bool:
        return self.spec.slot > 1

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    @property
    def rows(self) -> int:
        return self.q.shape[0]

    @property
    def shape(self) -> dict[str, Any]:
        shape = {
            "tokens": sum(self.lengths),
            "rows": self.rows,
            "heads": self.heads,
            "head_dim": self.head_dim,
            "mix": ONE_DOCUMENT if self.variant.one_document else self.spec.mix,
            "slot_multiple": self.spec.slot,
            "docs": len(self.lengths),
            "max_doclen": self.max_len,
            "dtype": str(self.q.dtype).removeprefix("torch."),
            "causal": True,
            "variant": self.variant.name,
        }
        if self.variant.window_left is not None:
            shape["window_size"] = [self.variant.window_left, 0]
        if self.variant.softcap:
            shape["softcap"] = self.variant.softcap
        if self.variant.sinks:
            shape["sinks"] = True
        return shape

    @property
    def label(self) -> str:
        return _label(self.shape)


def _label(shape: dict[str, Any]) -> str:
    docs = shape["mix"] if shape["mix"] == ONE_DOCUMENT else f"docs{shape['mix']}"
    text = f"T{shape['tokens']}-H{shape['heads']}-D{shape['head_dim']}-{docs}"
    if shape.get("slot_multiple", 1) > 1:
        text += f"-slots{shape['slot_multiple']}"
    if shape.get("variant", "causal") != "causal":
        text += f"-{shape['variant']}"
    return text


def make_problem(
    spec: LayoutSpec, heads: int, head_dim: int, seed: int, device: str, variant: Variant | None = None
) -> Problem:
    variant = variant or Variant()
    lo, hi = MIXES[spec.mix]
    lengths = [spec.tokens] if variant.one_document else document_lengths(spec.tokens, lo, hi, seed)
    slots = [n + (-n % spec.slot) for n in lengths]
    rows = sum(slots)
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v, do = (
        torch.randn(rows, heads, head_dim, device=device, generator=gen, dtype=torch.bfloat16)
        for _ in range(4)
    )
    cu_list, slot_list = _offsets(lengths), _offsets(slots)
    real = torch.zeros(rows, dtype=torch.bool)
    for start, n in zip(slot_list, lengths, strict=False):
        real[start : start + n] = True
    sinks = None
    if variant.sinks:
        sinks = torch.randn(heads, device=device, generator=gen).to(torch.bfloat16).float()

    def i32(values: Sequence[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return Problem(
        spec=spec,
        lengths=lengths,
        heads=heads,
        head_dim=head_dim,
        q=q,
        k=k,
        v=v,
        do=do,
        cu=i32(cu_list),
        cu_slots=i32(slot_list),
        seqused=i32(lengths),
        real_rows=real.to(device),
        variant=variant,
        sinks=sinks,
    )


class Unsupported(Exception):
    """This provider does not offer what the shape needs: recorded as ``unavailable``."""


def thd_provider(p: Problem) -> Attn:
    import thd

    params = inspect.signature(thd.attention).parameters
    missing = [name for name in p.variant.thd_kwargs() if name not in params]
    if missing:
        raise Unsupported(f"thd.attention has no {', '.join(missing)} parameter yet")
    kwargs: dict[str, Any] = {"max_seqlen_q": p.max_len, "max_seqlen_kv": p.max_len, "causal": True}
    if p.padded:
        kwargs.update(cu_seqlens_q_padded=p.cu_slots, cu_seqlens_kv_padded=p.cu_slots)
    if p.variant.window_left is not None:
        kwargs["window_size"] = (p.variant.window_left, 0)
    if p.variant.softcap:
        kwargs["softcap"] = p.variant.softcap
    if p.variant.sinks:
        kwargs["sinks"] = p.sinks

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = thd.attention(q, k, v, p.cu, p.cu, **kwargs)
        assert isinstance(out, Tensor)
        return out

    return call


@cache
def _fa4_varlen() -> Callable[..., Any]:
    from flash_attn.cute import flash_attn_varlen_func

    return flash_attn_varlen_func


def fa4_version() -> str | None:
    version = package_version("flash-attn-4", "flash_attn_4", "flash-attn-cute")
    if version is None:
        try:
            import flash_attn

            version = getattr(flash_attn, "__version__", None)
        except Exception:
            version = None
    return version


def fa4_provider(p: Problem) -> Attn:
    try:
        fa4 = _fa4_varlen()
    except Exception as exc:  # not installed, or its CUDA/DSL stack does not load
        raise ImportError(f"flash_attn.cute: {error_text(exc)}") from exc
    kwargs: dict[str, Any] = {
        "cu_seqlens_q": p.cu_slots,
        "cu_seqlens_k": p.cu_slots,
        "max_seqlen_q": p.max_len,
        "max_seqlen_k": p.max_len,
        "causal": True,
    }
    if p.padded:
        kwargs.update(seqused_q=p.seqused, seqused_k=p.seqused)
    if p.variant.window_left is not None:
        kwargs["window_size"] = (p.variant.window_left, 0)
    if p.variant.softcap:
        kwargs["softcap"] = p.variant.softcap
    if p.variant.sinks:
        assert p.sinks is not None
        kwargs["learnable_sink"] = p.sinks.to(torch.bfloat16)  # FA4 takes bf16 sinks

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        result = fa4(q, k, v, **kwargs)
        return result[0] if isinstance(result, tuple) else result

    return call


def varlen_provider(p: Problem) -> Attn:
    from torch.nn.attention.varlen import varlen_attn

    if p.padded or p.variant.name != "causal":
        raise Unsupported("varlen_attn: packed causal layouts only in this benchmark")
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

    if p.padded or p.variant.name != "causal":
        raise Unsupported("flex: packed causal layouts only in this benchmark")
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
    "fa4": fa4_provider,
    "varlen_attn": varlen_provider,
    "flex": flex_provider,
}


def _timed_fn(call: Attn, p: Problem, mode: str) -> Callable[[], object]:
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


def measure_problem(p: Problem, providers: Sequence[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """All (provider, mode) records of one shape; errors become records. With ``--rounds R`` every
    (provider, mode) is timed once per round, the providers taking turns, and the record holds
    the median over rounds (slow drifts of the GPU's clock then hit every provider alike)."""
    records: list[dict[str, Any]] = []
    ready: list[tuple[dict[str, Any], Attn, dict[str, Any]]] = []
    first: tuple[str, Tensor] | None = None
    for provider in _providers_for(p, providers):
        base = {"op": "attention", "provider": provider, "shape": p.shape}
        try:
            call = FACTORIES[provider](p)
        except (ImportError, AttributeError, Unsupported) as exc:
            records += [
                make_record(**base, mode=m, status="unavailable", error=error_text(exc)) for m in args.modes
            ]
            continue
        except Exception as exc:
            records += [
                make_record(**base, mode=m, status="error", error=error_text(exc)) for m in args.modes
            ]
            continue
        extra: dict[str, Any] = {}
        try:  # warm-up (compiles, autotunes) and a cross-check of outputs on real rows, never an assertion
            started = time.monotonic()
            with torch.no_grad():
                out = call(p.q, p.k, p.v)[p.real_rows].float()
            _sync()
            extra["first_call_s"] = round(time.monotonic() - started, 2)
            if first is None:
                first = (provider, out)
            else:
                extra[f"max_abs_diff_vs_{first[0]}"] = float((out - first[1]).abs().max())
        except Exception as exc:
            records += [
                make_record(**base, mode=m, status="error", error=error_text(exc)) for m in args.modes
            ]
            continue
        ready.append((base, call, extra))
    timings: dict[tuple[str, str], list[dict[str, float]]] = {}
    errors: dict[tuple[str, str], Exception] = {}
    for _ in range(args.rounds):
        for base, call, _extra in ready:
            for mode in args.modes:
                key = (base["provider"], mode)
                if key in errors:
                    continue
                try:
                    timing = bench_back_to_back(
                        _timed_fn(call, p, mode), rep_ms=args.rep_ms, trials=args.trials
                    )
                    timings.setdefault(key, []).append(timing)
                except Exception as exc:
                    errors[key] = exc
                finally:
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
    for base, _call, extra in ready:
        for mode in args.modes:
            key = (base["provider"], mode)
            flops = attention_flops(
                p.lengths,
                p.lengths,
                p.heads,
                p.head_dim,
                causal=True,
                mode=mode,
                window_left=p.variant.window_left,
            )
            if key in errors:
                records.append(
                    make_record(
                        **base, mode=mode, flops=flops, status="error", error=error_text(errors[key]), **extra
                    )
                )
            else:
                records.append(
                    make_record(**base, mode=mode, flops=flops, timing=combine_rounds(timings[key]), **extra)
                )
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


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def dense_matmul(n: int, args: argparse.Namespace, device: str) -> dict[str, Any]:
    """bf16 ``[n, n] @ [n, n]`` TFLOP/s, timed like the attention calls."""
    try:
        a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
        c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
        timing = bench_back_to_back(lambda: torch.matmul(a, b, out=c), rep_ms=args.rep_ms, trials=args.trials)
        flops = 2.0 * n**3
        return make_record(
            op="matmul", provider="torch.matmul", mode="fwd", shape={"n": n, "dtype": "bfloat16"},
            flops=flops, timing=timing,
        )  # fmt: skip
    except Exception as exc:
        return make_record(
            op="matmul", provider="torch.matmul", mode="fwd", shape={"n": n, "dtype": "bfloat16"},
            status="error", error=error_text(exc),
        )  # fmt: skip


def host_overhead(providers: Sequence[str], args: argparse.Namespace, device: str) -> list[dict[str, Any]]:
    """Wall time per eager call on a tiny problem (2 documents of 64 tokens, 2 heads): host bound."""
    spec = LayoutSpec(128, "64-1024")
    lengths = [64, 64]
    gen = torch.Generator(device=device).manual_seed(args.seed)
    q, k, v, do = (
        torch.randn(128, 2, args.host_head_dim, device=device, generator=gen, dtype=torch.bfloat16)
        for _ in range(4)
    )
    cu = torch.tensor([0, 64, 128], dtype=torch.int32, device=device)
    p = Problem(
        spec=spec, lengths=lengths, heads=2, head_dim=args.host_head_dim, q=q, k=k, v=v, do=do, cu=cu,
        cu_slots=cu, seqused=cu.diff(), real_rows=torch.ones(128, dtype=torch.bool, device=device),
    )  # fmt: skip
    shape = {"tokens": 128, "docs": 2, "heads": 2, "head_dim": args.host_head_dim, "causal": True}
    records = []
    for provider in [x for x in providers if x in ("thd", "fa4", "varlen_attn")]:
        for mode in args.modes:
            base = {"op": "host_time", "provider": provider, "mode": mode, "shape": shape}
            try:
                call = FACTORIES[provider](p)
            except (ImportError, AttributeError, Unsupported) as exc:
                records.append(make_record(**base, status="unavailable", error=error_text(exc)))
                continue
            try:
                timing = host_time_us(_timed_fn(call, p, mode), calls=args.host_calls)
                records.append(make_record(**base, **timing))
            except Exception as exc:
                records.append(make_record(**base, status="error", error=error_text(exc)))
    return records


def _ok(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("status") == "ok" and r.get("op") == "attention"]


def speedups(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per shape and mode: thd's speedup over each peer (peer ms / thd ms, = TFLOP/s ratio)."""
    times: dict[tuple[str, str], dict[str, float]] = {}
    for r in _ok(records):
        times.setdefault((_label(r["shape"]), r["mode"]), {})[r["provider"]] = r["median_ms"]
    rows = []
    for (label, mode), by_provider in times.items():
        row: dict[str, Any] = {"shape": label, "mode": mode}
        for peer in PEERS:
            if "thd" in by_provider and peer in by_provider:
                ratio = by_provider[peer] / by_provider["thd"]
                row[f"thd/{peer}"] = ratio
                row[f"thd/{peer}_meets_goal"] = ratio >= GOALS[(peer, mode)]
        rows.append(row)
    return rows


def padding_costs(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Padded-slot TFLOP/s over the packed layout's (same documents), per provider and mode."""
    packed: dict[tuple[Any, ...], float] = {}
    for r in _ok(records):
        s = r["shape"]
        if s.get("slot_multiple", 1) == 1 and s.get("variant", "causal") == "causal":
            packed[(s["tokens"], s["mix"], s["head_dim"], r["provider"], r["mode"])] = r["median_ms"]
    rows = []
    for r in _ok(records):
        s = r["shape"]
        key = (s["tokens"], s["mix"], s["head_dim"], r["provider"], r["mode"])
        if s.get("slot_multiple", 1) > 1 and key in packed:
            ratio = packed[key] / r["median_ms"]
            rows.append({
                "shape": _label(s), "provider": r["provider"], "mode": r["mode"],
                "padded/packed": ratio, "meets_goal": ratio >= PADDED_GOAL,
            })  # fmt: skip
    return rows


def host_summary(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """thd's host time per call against each peer's (peer us / thd us; > 1: thd cheaper)."""
    by: dict[str, dict[str, float]] = {}
    for r in records:
        if r.get("op") == "host_time" and r.get("status") == "ok":
            by.setdefault(r["mode"], {})[r["provider"]] = r["wall_us"]
    rows = []
    for mode, us in by.items():
        row: dict[str, Any] = {"mode": mode, **{f"{k}_us": v for k, v in us.items()}}
        for peer in ("fa4", "varlen_attn"):
            if "thd" in us and peer in us:
                row[f"thd/{peer}"] = us[peer] / us["thd"]
        if "thd" in us and "varlen_attn" in us:
            row["thd_meets_goal"] = us["thd"] <= us["varlen_attn"]
        rows.append(row)
    return rows


def print_summary(payload: dict[str, Any]) -> None:
    dense = payload.get("dense_matmul_tflops")
    if dense:
        print(f"dense bf16 matmul: {dense:.0f} TFLOP/s")
    print(f"{'shape':<44} {'mode':<8} {'provider':<12} {'ms':>9} {'TFLOP/s':>8} {'/dense':>7}  status")
    for r in payload["records"]:
        if r.get("op") != "attention":
            continue
        ms = f"{r['median_ms']:.3f}" if "median_ms" in r else "-"
        tf = f"{r['tflops']:.1f}" if "tflops" in r else "-"
        frac = f"{r['fraction_of_dense']:.2f}" if "fraction_of_dense" in r else "-"
        status = r["status"] + (f" ({r['error'][:80]})" if "error" in r else "")
        print(
            f"{_label(r['shape']):<44} {r['mode']:<8} {r['provider']:<12} {ms:>9} {tf:>8} {frac:>7}  {status}"
        )
    for row in payload["ratios"]:
        parts = [f"{k}={v:.2f}" for k, v in row.items() if k.startswith("thd/") and isinstance(v, float)]
        if parts:
            print(f"{row['shape']:<44} {row['mode']:<8} speedup {'  '.join(parts)}")
    for row in payload["padding"]:
        ratio = row["padded/packed"]
        print(f"{row['shape']:<44} {row['mode']:<8} {row['provider']:<12} padded/packed {ratio:.2f}")
    for r in payload["records"]:
        if r.get("op") == "host_time":
            us = f"{r['wall_us']:.0f} us/call" if "wall_us" in r else r["status"]
            print(f"host time {r['provider']:<12} {r['mode']:<8} {us}")


# --- README tables from a result file -------------------------------------------------------

_EN_DASH = "\u2013"  # document-length ranges in the README tables
_NAMES = {"thd": "thd", "fa4": "FA4", "varlen_attn": "varlen_attn", "flex": "flex"}
_MODE_NAMES = {"fwd": "fwd", "fwd_bwd": "fwd+bwd"}


def _tokens_text(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def _layout_text(shape: dict[str, Any]) -> str:
    if shape["mix"] == ONE_DOCUMENT:
        return f"one document of {_tokens_text(shape['tokens'])}"
    text = f"{_tokens_text(shape['tokens'])} / {shape['mix'].replace('-', _EN_DASH)}"
    if shape.get("slot_multiple", 1) > 1:
        text += f", slots rounded up to {shape['slot_multiple']} rows"
    return text


def _fmt(value: float | None, digits: int = 0) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def markdown_tables(payload: dict[str, Any]) -> str:
    """The README performance tables (markdown) of one result file."""
    env = payload.get("env", {})
    dense = payload.get("dense_matmul_tflops")
    ok = _ok(payload.get("records", []))
    tf: dict[tuple[str, str, str], float] = {}
    ms: dict[tuple[str, str, str], float] = {}
    shapes: dict[str, dict[str, Any]] = {}
    for r in ok:
        label = _label(r["shape"])
        shapes.setdefault(label, r["shape"])
        tf[(label, r["provider"], r["mode"])] = r["tflops"]
        ms[(label, r["provider"], r["mode"])] = r["median_ms"]
    providers = [p for p in PROVIDERS if any(k[1] == p for k in tf)]
    commit = payload.get("commit", env.get("git_sha", "?"))
    versions = (
        f"torch {env.get('torch', '?')}, Triton {env.get('triton', '?')}, FA4 {env.get('fa4') or 'absent'}"
    )
    lines = [
        f"Measured on {env.get('device', '?')} ({versions}; code at `{commit}`), "
        "bf16, causal packed documents, TFLOP/s on real tokens (fwd+bwd counted as 3.5x fwd), "
        + (
            "calls back to back between one pair of CUDA events"
            if "timing_definition" in payload
            else "triton.testing.do_bench (L2 flush between calls)"
        )
        + (
            f" (median of {rounds} rounds, the providers taking turns)"
            if (rounds := payload.get("config", {}).get("rounds", 1)) > 1
            else ""
        )
        + (f"; dense bf16 matmul in the same run: {dense:.0f} TFLOP/s." if dense else "."),
    ]
    ratio_peers = [p for p in ("fa4", "varlen_attn") if p in providers]
    for head_dim in sorted({s["head_dim"] for s in shapes.values()}, reverse=True):
        labels = [
            lab
            for lab, s in shapes.items()
            if s["head_dim"] == head_dim and s.get("variant", "causal") == "causal"
        ]
        if not labels:
            continue
        heads = shapes[labels[0]]["heads"]
        cols = [f"{_NAMES[p]} {_MODE_NAMES[m]}" for m in MODES for p in providers]
        cols += [f"thd/{_NAMES[p]} {_MODE_NAMES[m]}" for p in ratio_peers for m in MODES]
        cols += [f"thd {_MODE_NAMES[m]} / dense" for m in MODES] if dense else []
        lines += ["", f"head_dim {head_dim}, {heads} heads:", ""]
        lines.append("| tokens / document lengths | " + " | ".join(cols) + " |")
        lines.append("|---" * (len(cols) + 1) + "|")
        for lab in labels:
            cells = [_fmt(tf.get((lab, p, m))) for m in MODES for p in providers]
            for p in ratio_peers:
                for m in MODES:
                    thd_ms, peer_ms = ms.get((lab, "thd", m)), ms.get((lab, p, m))
                    cells.append(_fmt(peer_ms / thd_ms if thd_ms and peer_ms else None, 2))
            if dense:
                cells += [
                    _fmt(tf[(lab, "thd", m)] / dense if (lab, "thd", m) in tf else None, 2) for m in MODES
                ]
            lines.append(f"| {_layout_text(shapes[lab])} | " + " | ".join(cells) + " |")
    host = [r for r in payload.get("records", []) if r.get("op") == "host_time"]
    if host:
        names = [p for p in ("thd", "fa4", "varlen_attn") if any(r["provider"] == p for r in host)]
        shape = host[0]["shape"]
        lines += [
            "",
            "Host time per eager call, µs (wall clock over back-to-back calls, "
            f"{shape['docs']} documents of {shape['tokens'] // shape['docs']} tokens, "
            f"{shape['heads']} heads, head_dim {shape['head_dim']}):",
            "",
            "| mode | " + " | ".join(_NAMES[p] for p in names) + " |",
            "|---" * (len(names) + 1) + "|",
        ]
        for mode in MODES:
            by = {r["provider"]: r.get("wall_us") for r in host if r["mode"] == mode}
            lines.append(f"| {_MODE_NAMES[mode]} | " + " | ".join(_fmt(by.get(p)) for p in names) + " |")
    variants = [lab for lab, s in shapes.items() if s.get("variant", "causal") != "causal"]
    if variants:
        cols = [f"{_NAMES[p]} {_MODE_NAMES[m]}" for m in MODES for p in VARIANT_PROVIDERS]
        cols += [f"thd/FA4 {_MODE_NAMES[m]}" for m in MODES]
        lines += ["", "Variants (thd and FA4 with the same settings), TFLOP/s on visible pairs:", ""]
        lines.append("| variant | shape | " + " | ".join(cols) + " |")
        lines.append("|---" * (len(cols) + 2) + "|")
        for lab in variants:
            s = shapes[lab]
            cells = [_fmt(tf.get((lab, p, m))) for m in MODES for p in VARIANT_PROVIDERS]
            for m in MODES:
                thd_ms, fa4_ms = ms.get((lab, "thd", m)), ms.get((lab, "fa4", m))
                cells.append(_fmt(fa4_ms / thd_ms if thd_ms and fa4_ms else None, 2))
            where = f"{_layout_text(s)}, D {s['head_dim']}"
            lines.append(f"| {s['variant']} | {where} | " + " | ".join(cells) + " |")
    skipped = payload.get("variants_skipped") or []
    if skipped:
        lines += [
            "",
            "Variants not measured: " + "; ".join(f"{v['variant']} ({v['reason']})" for v in skipped),
        ]
    return "\n".join(lines)


# --- main -----------------------------------------------------------------------------------


def variant_problems(args: argparse.Namespace) -> list[tuple[Variant, LayoutSpec]]:
    tokens, window = args.variant_tokens, args.window
    docs = LayoutSpec(tokens, "512-8192")
    return [
        (Variant(f"window{window}", window_left=window), docs),
        (Variant(f"window{window}", window_left=window, one_document=True), docs),
        (Variant("softcap50", softcap=50.0), docs),
        (Variant("sinks", sinks=True), docs),
    ]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run on the GPU machine with PYTHONPATH=src:. (FA4 on PYTHONPATH too, when installed).",
    )
    parser.add_argument("--out", help="JSON file to write (required unless --table)")
    parser.add_argument("--table", metavar="JSON", help="print the README tables of a result file and exit")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 4k tokens, head_dim 128, short timings"
    )
    parser.add_argument(
        "--layouts",
        nargs="+",
        type=LayoutSpec.parse,
        default=None,
        help=f"TOKENS:MIX[:SLOT] (default: {' '.join(DEFAULT_LAYOUTS)})",
    )
    parser.add_argument("--head-dims", type=int, nargs="+", default=None, help="default: 128 64")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--variants", action="store_true", help="also window / softcap / sinks, thd vs FA4")
    parser.add_argument("--variant-tokens", type=int, default=None, help="default 32768 (4096 with --quick)")
    parser.add_argument(
        "--window", type=int, default=None, help="left window (default 4096; 1024 with --quick)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rep-ms", type=float, default=None, help="device ms per measurement (default 100)")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument(
        "--rounds", type=int, default=1, help="time every provider once per round, taking turns; median"
    )
    parser.add_argument("--dense-n", type=int, default=None, help="dense matmul size (default 8192)")
    parser.add_argument("--host-calls", type=int, default=None, help="calls per host-time measurement (500)")
    parser.add_argument("--host-head-dim", type=int, default=128)
    parser.add_argument("--commit", default=None, help="the code's commit (default: git rev-parse HEAD)")
    parser.add_argument(
        "--budget-s", type=float, default=None, help="stop starting new shapes after this many seconds (270)"
    )
    args = parser.parse_args(argv)
    if args.table is None and args.out is None:
        parser.error("--out is required (or --table JSON)")
    quick = args.quick
    defaults = {
        "layouts": [LayoutSpec.parse(t) for t in (QUICK_LAYOUTS if quick else DEFAULT_LAYOUTS)],
        "head_dims": [128] if quick else [128, 64],
        "variant_tokens": 4096 if quick else 32768,
        "window": 1024 if quick else 4096,
        "rep_ms": 20.0 if quick else 100.0,
        "dense_n": 4096 if quick else 8192,
        "host_calls": 50 if quick else 500,
        "budget_s": 120.0 if quick else 270.0,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if quick:
        args.trials = min(args.trials, 3)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table is not None:
        print(markdown_tables(json.loads(Path(args.table).read_text())))
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.monotonic()
    env = env_fingerprint()
    env["fa4"] = fa4_version()
    env["cutlass_dsl"] = package_version("nvidia-cutlass-dsl")
    commit = args.commit or env["git_sha"]
    print(f"[bench_attention] dense matmul {args.dense_n}^3", file=sys.stderr, flush=True)
    dense = dense_matmul(args.dense_n, args, device)
    print("[bench_attention] host time per call", file=sys.stderr, flush=True)
    records: list[dict[str, Any]] = [dense, *host_overhead(args.providers, args, device)]
    skipped: list[str] = []
    work: list[tuple[int, LayoutSpec, Variant]] = [
        (d, spec, Variant()) for d in args.head_dims for spec in args.layouts
    ]
    variants_skipped: list[dict[str, str]] = []
    if args.variants:
        import thd

        params = inspect.signature(thd.attention).parameters
        for variant, spec in variant_problems(args):
            missing = [k for k in variant.thd_kwargs() if k not in params]
            if missing:
                variants_skipped.append(
                    {
                        "variant": f"{variant.name} on {ONE_DOCUMENT if variant.one_document else spec.text}",
                        "reason": f"thd.attention has no {', '.join(missing)} parameter yet",
                    }
                )
                continue
            work += [(d, spec, variant) for d in args.head_dims]
    for head_dim, spec, variant in work:
        seed = args.seed + list(MIXES).index(spec.mix)
        if time.monotonic() - started > args.budget_s:
            where = ONE_DOCUMENT if variant.one_document else spec.text
            skipped.append(f"D{head_dim} {where} {variant.name}")
            continue
        p = make_problem(spec, args.heads, head_dim, seed, device, variant)
        print(f"[bench_attention] {p.label} ({len(p.lengths)} docs)", file=sys.stderr, flush=True)
        records += measure_problem(p, args.providers, args)
        del p
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    dense_tflops = dense.get("tflops")
    if dense_tflops:
        for r in _ok(records):
            r["fraction_of_dense"] = r["tflops"] / dense_tflops
    payload = {
        "benchmark": "attention",
        "command": command_line(),
        "commit": commit,
        "env": env,
        "config": {
            **{k: v for k, v in vars(args).items() if k not in ("out", "table")},
            "layouts": [spec.text for spec in args.layouts],
        },
        "flop_definition": FLOP_DEFINITION,
        "timing_definition": TIMING_DEFINITION,
        "ratio_definition": "thd/<peer> = peer median ms / thd median ms (= TFLOP/s ratio; > 1: thd faster)",
        "goals": {
            **{f"thd/{peer} {mode}": goal for (peer, mode), goal in GOALS.items()},
            "padded/packed": PADDED_GOAL,
            "host time": "thd wall_us <= varlen_attn wall_us",
        },
        "dense_matmul_tflops": dense_tflops,
        "records": records,
        "ratios": speedups(records),
        "padding": padding_costs(records),
        "host": host_summary(records),
        "variants_skipped": variants_skipped,
        "skipped_for_budget": skipped,
        "wall_s": round(time.monotonic() - started, 1),
    }
    write_json(args.out, payload)
    print_summary(payload)
    print(f"[bench_attention] wrote {args.out} in {payload['wall_s']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
