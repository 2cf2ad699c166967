"""Context-parallel ring attention on several GPUs: efficiency per transport and host time per call.

Issue 12: with the process group users create by default, ``dist.init_process_group("nccl")``,
how much of the single-GPU throughput does the ring keep, with the transport the library picks
itself (``THD_CP_TRANSPORT=auto``) and with each transport forced (``nccl``: the group as given,
``nccl-high-priority``: a derived high-priority communicator, ``symm-mem``: copy-engine pulls)?

For each per-GPU token count and K/V head count, every rank times (CUDA events, fixed iteration
counts so that the ranks stay in lockstep, max over ranks):

- ``single``: ``thd.attention`` on one GPU with ``tokens`` packed causal documents;
- ``ring[<transport>]``: ``thd.cp.ring_attention`` at ``cp`` ranks on ``cp * tokens`` documents of
  the same mix, with ``THD_CP_TRANSPORT=<transport>`` (the record names the transport it
  resolved to and why);
- ``ring_no_overlap[auto]`` (``--no-overlap``): each exchange waited on before the step's compute.

FLOPs count real tokens only (``4 * H * D * sum(L^2) / 2`` causal forward, backward 2.5x). The
ring's per-GPU TFLOP/s is ``flops(global batch) / (time * cp)``; its CP efficiency is that
divided by the single-GPU TFLOP/s. Layouts: ``padded`` (arbitrary lengths, slots rounded up to
``2 * cp``: the exact per-rank-count path) and ``aligned`` (lengths themselves multiples of
``2 * cp``: the ``cu // cp`` fast path).

Host time: a tiny problem (a few hundred tokens, so the GPU is never the bottleneck) called
``--host-calls`` times back to back; ``host_us`` is the host wall clock per call until the last
call is queued, ``wall_us`` until the GPU has finished them (max over ranks).

The group is created the way users do (``--group default``: plain ``init_process_group("nccl")``,
no options); ``--group bound`` adds ``device_id`` (the library then derives by ``split_group``)
and ``--group high-priority`` creates it with high-priority streams itself (the old benchmark's
setup). ``NCCL_NVLS_ENABLE=0`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` are set for the ranks.

Host profile (``--host-profile``, no GPU needed): the ring's own Python cost per call on ``--cp``
gloo ranks (CPU), the tiny host-time problem at 2 heads x 16 dims. ``orchestration``: the
expensive parts stubbed (attention launches return preallocated results and write nothing, the
exchanges post nothing, the plan-table launch returns the table of the first call, the padding
cleanup does nothing) on the path a CUDA call with ``max_seqlen_*`` takes (no host reads or
validation, Triton kernels); what remains is the orchestration (checks, transport lookup, plan,
per-step tables and records, allocations, autograd). ``cpu``: nothing stubbed (gloo, torch
reference attention, validated path). Per call: best of 3 rounds of ``--host-calls`` calls, max
over ranks, plus what one call issues (attention / plan-table / padding-cleanup launches,
exchanges, aten ops). ``--host-profile-top K`` prints rank 0's cProfile (K rows).

Launch plainly (``python benchmarks/bench_ring.py --out f.json``: starts ``--cp`` ranks itself
with ``torch.multiprocessing``, mp.spawn) or with torchrun. Rank 0 writes one JSON with the
command, the commit (``--commit``, else git), GPU, versions, transports, records and summaries.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import (
    attention_flops,
    command_line,
    cuda_missing,
    document_lengths,
    env_fingerprint,
    error_text,
    make_record,
    offsets_tensor,
    sync,
    write_json,
)
from torch import Tensor

MIXES: dict[str, tuple[int, int]] = {"1024-8192": (1024, 8192), "4096-32768": (4096, 32768)}
LAYOUTS = ("padded", "aligned")
MODES = ("fwd", "fwd_bwd")
TRANSPORTS = ("auto", "nccl", "nccl-high-priority", "symm-mem")
GROUPS = ("default", "bound", "high-priority")
RANK_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
HOST_GOAL_US = {"fwd": 300.0}


def goal(mode: str, heads: int, kv_heads: int) -> float | None:
    """Issue 12: MHA forward 0.85, forward+backward 0.9; GQA forward+backward 0.95."""
    if kv_heads == heads:
        return {"fwd": 0.85, "fwd_bwd": 0.9}[mode]
    return 0.95 if mode == "fwd_bwd" else None


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _rank_max(values: Sequence[float], device: torch.device, op: Any = None) -> list[float]:
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op or dist.ReduceOp.MAX)
    return [float(x) for x in t.tolist()]


def _time_ms(fn: Callable[[], object], warmup: int, iters: int, device: torch.device) -> dict[str, float]:
    """Mean ms per call over ``iters`` calls after ``warmup``, max over ranks (all ranks call it).

    CUDA events on GPUs; a host clock on CPUs (the ``--device cpu`` smoke mode).
    """
    for _ in range(warmup):
        fn()
    sync(device)
    dist.barrier()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        elapsed = start.elapsed_time(end)
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        elapsed = (time.perf_counter() - t0) * 1e3
    hi = _rank_max([elapsed / iters], device)[0]
    lo = _rank_max([elapsed / iters], device, dist.ReduceOp.MIN)[0]
    return {"median_ms": hi, "min_rank_ms": lo}


def _host_us(fn: Callable[[], object], warmup: int, calls: int, device: torch.device) -> dict[str, float]:
    """Host wall clock per call while queuing ``calls`` calls, and until the GPU is done (max over ranks)."""
    for _ in range(warmup):
        fn()
    sync(device)
    dist.barrier()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    sync(device)
    t2 = time.perf_counter()
    host, wall = _rank_max([(t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6], device)
    return {"host_us": host, "wall_us": wall}


def _randn(rows: int, heads: int, dim: int, seed: int, device: torch.device) -> Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.randn(rows, heads, dim, device=device, dtype=dtype, generator=gen)


def _callables(
    attn: Callable[[Tensor, Tensor, Tensor], Tensor],
    rows: int,
    heads: int,
    kv_heads: int,
    dim: int,
    seed: int,
    device: torch.device,
) -> dict[str, Callable[[], object]]:
    q, do = _randn(rows, heads, dim, seed, device), _randn(rows, heads, dim, seed + 3, device)
    k, v = (_randn(rows, kv_heads, dim, seed + i, device) for i in (1, 2))
    return mode_calls(attn, (q, k, v, do))


def mode_calls(
    attn: Callable[[Tensor, Tensor, Tensor], Tensor], tensors: Sequence[Tensor]
) -> dict[str, Callable[[], object]]:
    """Forward (no autograd) and forward+backward (gradients of q, k, v) of ``attn`` on
    ``tensors = (q, k, v, dout)``."""
    q, k, v, do = tensors
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def fwd() -> object:
        with torch.no_grad():
            return attn(q, k, v)

    def fwd_bwd() -> object:
        return torch.autograd.grad(attn(qg, kg, vg), (qg, kg, vg), do)

    return {"fwd": fwd, "fwd_bwd": fwd_bwd}


class _Transport:
    """``THD_CP_TRANSPORT`` set for a block (the same on every rank), and what it resolved to."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> _Transport:
        self.before = os.environ.get("THD_CP_TRANSPORT")
        os.environ["THD_CP_TRANSPORT"] = self.name
        return self

    def __exit__(self, *exc: object) -> None:
        if self.before is None:
            os.environ.pop("THD_CP_TRANSPORT", None)
        else:
            os.environ["THD_CP_TRANSPORT"] = self.before

    @staticmethod
    def resolved(like: Tensor) -> dict[str, str]:
        from thd.cp.transport import ring_comm

        comm = ring_comm(dist.group.WORLD, like)  # cached by the ring call just made
        return {"transport": comm.transport, "reason": comm.reason}


def _measure(
    provider: str,
    calls: dict[str, Callable[[], object]],
    flops: Callable[[str], float],
    shape: dict[str, Any],
    args: argparse.Namespace,
    extra: Callable[[], dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    records = []
    for mode in args.modes:
        try:
            timing = _time_ms(calls[mode], args.warmup, args.iters, torch.device(args.device_now))
            more = extra() if extra is not None else {}
            records.append(make_record(op="ring_attention", provider=provider, mode=mode, shape=shape,
                                       flops=flops(mode), timing=timing, **more))  # fmt: skip
        except Exception as exc:  # recorded, never raised: the other providers still run
            records.append(make_record(op="ring_attention", provider=provider, mode=mode, shape=shape,
                                       status="error", error=error_text(exc)))  # fmt: skip
    return records


def run_shape(
    tokens: int, kv_heads: int, mix: str, layout: str, cp: int, rank: int, args: argparse.Namespace,
    transports: Sequence[str], single_too: bool = True,
) -> list[dict]:  # fmt: skip
    import thd
    from thd.cp import ring_attention

    heads, dim, m = args.heads, args.head_dim, 2 * cp
    lo, hi = MIXES[mix]
    device = torch.device(args.device_now)
    # Single GPU: `tokens` packed documents.
    local = document_lengths(tokens, lo, hi, args.seed)
    cu1 = offsets_tensor(local, device)
    max1 = max(local)
    single = lambda q, k, v: thd.attention(
        q, k, v, cu1, cu1, max_seqlen_q=max1, max_seqlen_kv=max1, causal=True
    )
    shape = {"tokens_per_gpu": tokens, "cp": cp, "heads": heads, "kv_heads": kv_heads, "head_dim": dim,
             "mix": mix, "layout": layout, "dtype": "bfloat16" if device.type == "cuda" else "float32",
             "causal": True}  # fmt: skip
    records = []
    if single_too:
        records = _measure(
            "single",
            _callables(single, tokens, heads, kv_heads, dim, 1, device),
            lambda mode: attention_flops(local, local, heads, dim, causal=True, mode=mode),
            {**shape, "docs": len(local), "max_doclen": max1},
            args,
        )
    # Ring: cp * tokens packed documents of the same mix, every slot a multiple of 2*cp.
    lens = document_lengths(cp * tokens, lo, hi, args.seed + 1)
    if layout == "aligned":
        lens = [_round_up(n, m) for n in lens]
    slots = [_round_up(n, m) for n in lens]
    cu, cup = offsets_tensor(lens, device), offsets_tensor(slots, device)
    longest, pad = max(lens), lens != slots
    rows = sum(slots)
    ring_shape = {**shape, "docs": len(lens), "max_doclen": longest, "global_rows": rows, "padding": pad}
    global_flops = lambda mode: attention_flops(lens, lens, heads, dim, causal=True, mode=mode)
    runs = [(f"ring[{t}]", t, True) for t in transports]
    if args.no_overlap and single_too:
        runs.append(("ring_no_overlap[auto]", "auto", False))
    for provider, transport, overlap in runs:
        ring = lambda q, k, v, overlap=overlap: ring_attention(
            q, k, v, cu, cu, cup, cup, causal=True, pad_between_seqs=pad,
            max_seqlen_q=longest, max_seqlen_kv=longest, _overlap=overlap,
        )  # fmt: skip
        calls = _callables(ring, rows // cp, heads, kv_heads, dim, 10 + rank, device)
        probe = torch.empty(0, device=device)
        with _Transport(transport):
            extra = lambda t=transport, p=probe: {"requested": t, **_Transport.resolved(p)}
            recs = _measure(provider, calls, lambda mode: global_flops(mode) / cp, ring_shape, args, extra)
        records.extend(recs)
    if args.window and single_too:
        records.extend(_window_records(args.window, rows // cp, cu, cup, lens, pad, ring_shape, rank, args))
    return records


def _window_records(
    left: int, rows: int, cu: Tensor, cup: Tensor, lens: list[int], pad: bool,
    shape: dict[str, Any], rank: int, args: argparse.Namespace,
) -> list[dict[str, Any]]:  # fmt: skip
    """The same ring with ``window_size=(left, 0)`` (``auto`` transport): time, TFLOP/s on visible
    pairs, and the share of the windowed schedule's launches the ring skipped (no visible pair)."""
    from thd.cp import ring as ring_mod
    from thd.cp import ring_attention

    # max_seqlen not given: the ring reads the lengths (one host read) and skips every pair that
    # no window reaches; with them given it skips only pairs ruled out whatever the lengths are.
    ring = lambda q, k, v: ring_attention(
        q, k, v, cu, cu, cup, cup, causal=True, window_size=(left, 0), pad_between_seqs=pad,
    )  # fmt: skip
    calls = _callables(
        ring, rows, args.heads, shape["kv_heads"], args.head_dim, 10 + rank, torch.device(args.device_now)
    )
    before = dict(ring_mod.window_counts)

    def extra() -> dict[str, Any]:
        counts = {
            k: ring_mod.window_counts[k] - before.get(k, 0) for k in ("calls", "pairs", "launches", "skipped")
        }
        share = counts["skipped"] / counts["pairs"] if counts["pairs"] else 0.0
        return {"requested": "auto", "window_left": left, "window_counts": counts, "skipped_share": share}

    flops = lambda mode: attention_flops(
        lens, lens, args.heads, args.head_dim, causal=True, mode=mode, window_left=left
    ) / shape["cp"]  # fmt: skip
    with _Transport("auto"):
        return _measure(f"ring_window{left}[auto]", calls, flops, {**shape, "window_left": left}, args, extra)


def window_summary(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per shape and mode: the windowed ring's time against the causal ring's (``ring[auto]``)."""
    plain = {
        (_shape_key(r), r["mode"]): r for r in records if r["provider"] == "ring[auto]" and "median_ms" in r
    }
    out = []
    for r in records:
        if not r["provider"].startswith("ring_window") or "median_ms" not in r:
            continue
        base = plain.get((_shape_key(r), r["mode"]))
        base_ms = base["median_ms"] if base else None
        out.append({
            "tokens_per_gpu": r["shape"]["tokens_per_gpu"], "kv_heads": r["shape"]["kv_heads"],
            "mode": r["mode"], "window_left": r["window_left"], "ring_ms": base_ms,
            "window_ring_ms": r["median_ms"], "time_saved": 1 - r["median_ms"] / base_ms if base_ms else None,
            "skipped_share": r["skipped_share"], "window_counts": r["window_counts"],
        })  # fmt: skip
    return out


def _shape_key(record: dict[str, Any]) -> tuple:
    """(tokens per GPU, K/V heads, mix, layout) of a record."""
    s = record["shape"]
    return s["tokens_per_gpu"], s["kv_heads"], s["mix"], s["layout"]


def host_times(cp: int, rank: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Host time per call on a tiny problem: single-GPU ``thd.attention`` and the ring per transport."""
    import thd
    from thd.cp import ring_attention

    device = torch.device(args.device_now)
    heads, dim, m = args.heads, args.head_dim, 2 * cp
    lens = [300, 97, 11 * m]  # padded slots: the exact per-rank-count path
    slots = [_round_up(n, m) for n in lens]
    cu, cup = offsets_tensor(lens, device), offsets_tensor(slots, device)
    rows, longest = sum(slots), max(lens)
    local = document_lengths(rows // cp, 64, 256, args.seed)
    cu1 = offsets_tensor(local, device)
    single = lambda q, k, v: thd.attention(
        q, k, v, cu1, cu1, max_seqlen_q=max(local), max_seqlen_kv=max(local), causal=True
    )
    ring = lambda q, k, v: ring_attention(
        q, k, v, cu, cu, cup, cup, causal=True, pad_between_seqs=True, max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )  # fmt: skip
    out = []
    runs = [("single", None, single, sum(local))] + [
        (f"ring[{t}]", t, ring, rows // cp) for t in sorted(args.transports, key=lambda t: t == "symm-mem")
    ]
    for provider, transport, attn, n in runs:
        calls = _callables(attn, n, heads, heads, dim, 20 + rank, device)
        for mode in args.modes:
            row: dict[str, Any] = {
                "provider": provider,
                "mode": mode,
                "tokens_per_gpu": n,
                "calls": args.host_calls,
            }
            try:
                if transport is None:
                    row.update(_host_us(calls[mode], 5, args.host_calls, device))
                else:
                    with _Transport(transport):
                        row.update(_host_us(calls[mode], 5, args.host_calls, device))
                        row.update(requested=transport, **_Transport.resolved(torch.empty(0, device=device)))
                if mode in HOST_GOAL_US and provider != "single":
                    row["goal_us"] = HOST_GOAL_US[mode]
                    row["meets_goal"] = row["host_us"] <= HOST_GOAL_US[mode]
            except Exception as exc:
                row.update(status="error", error=error_text(exc))
            out.append(row)
    return out


class _Counts:
    """What one ring call issues, counted through the stubs of :func:`_stub_ring`."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        self.values[name] = self.values.get(name, 0) + n


def _stub_ring(counts: _Counts) -> None:
    """Replace the ring's expensive parts by stubs that count their calls (see ``--host-profile``)."""
    import thd.cp.ring as ring
    import thd.ops.ring_plan
    import thd.padding
    from thd.cp.comm import Pending, RingComm

    results: dict[tuple, Any] = {}

    def forward(q, k, v, layout, options, sinks=None, accumulate=None):  # type: ignore[no-untyped-def]
        counts.add("attention_launches")
        if accumulate is not None:
            return accumulate
        key = ("fwd", q.shape, v.shape, q.dtype)
        if key not in results:
            out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
            results[key] = (out, q.new_zeros(q.shape[1], q.shape[0], dtype=torch.float32))
        return results[key]

    def backward(do, q, k, v, out, lse, layout, options, sinks=None):  # type: ignore[no-untyped-def]
        counts.add("attention_launches", 3)  # preprocess, dK/dV, dQ
        key = ("bwd", q.shape, k.shape, v.shape, q.dtype)
        if key not in results:
            results[key] = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None)
        return results[key]

    real_tables = thd.ops.ring_plan.ring_plan_tables

    def tables(cu: Tensor, cup: Tensor, cp: int, *, exact: bool) -> Tensor:
        counts.add("plan_table_launches")
        key = ("tables", id(cu), id(cup), cp, exact)
        if key not in results:
            results[key] = (cu, cup, real_tables(cu, cup, cp, exact=exact))
        return results[key][2]

    def zero_padding_(x: Tensor, *args: object, **kwargs: object) -> Tensor:
        counts.add("padding_cleanup_launches")
        return x

    def start(self: RingComm, ops: Sequence[object]) -> Pending:
        counts.add("exchanges")
        return Pending()

    from types import SimpleNamespace

    from thd.ops.attention.dispatch import FAMILIES

    def stub_backward(do, q, k, v, out, lse, layout, options, sinks=None, accumulate=None):  # type: ignore[no-untyped-def]
        grads = backward(do, q, k, v, out, lse, layout, options, sinks)
        return grads if accumulate is None else (*accumulate, grads[3])

    yes = lambda *args: True
    stub = SimpleNamespace(
        forward=forward, backward=stub_backward, supports_forward=yes, supports_backward=yes
    )
    FAMILIES.register("tl", stub)  # the ring's attention calls reach the stubs as the tl family
    os.environ["THD_ATTENTION_BACKEND"] = "triton"
    os.environ["THD_KERNELS"] = "tl"
    thd.ops.ring_plan.ring_plan_tables = tables
    thd.padding.zero_padding_ = zero_padding_
    RingComm.start = start  # type: ignore[method-assign]
    ring._host_reads_allowed = lambda *a: False  # a CUDA call with max_seqlen_*: no host reads


def _count_aten(fn: Callable[[], object]) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def host_profile(cp: int, rank: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--host-profile``: the ring's Python cost per call on CPU (see the module docstring)."""
    import cProfile
    import io
    import pstats

    from thd.cp import ring_attention

    device = torch.device("cpu")
    torch.set_num_threads(1)  # one core per rank: no oversubscription
    heads, dim, m = 2, 16, 2 * cp
    lens = [300, 97, 11 * m]  # the host-time problem: padded slots, the exact per-rank-count path
    slots = [_round_up(n, m) for n in lens]
    cu, cup = offsets_tensor(lens, device), offsets_tensor(slots, device)
    rows, longest = sum(slots), max(lens)
    ring = lambda q, k, v: ring_attention(
        q, k, v, cu, cu, cup, cup, causal=True, pad_between_seqs=True, max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )  # fmt: skip
    calls = _callables(ring, rows // cp, heads, heads, dim, 30 + rank, device)
    counts = _Counts()
    stubbed = args.host_profile == "orchestration"
    if stubbed:
        _stub_ring(counts)
    n_calls = args.host_calls if stubbed else max(5, args.host_calls // 50)
    out = []
    for mode in args.modes:
        fn = calls[mode]
        for _ in range(10):
            fn()
        counts.values.clear()
        fn()
        issued = dict(counts.values) if stubbed else {}
        best = float("inf")
        profile = cProfile.Profile() if args.host_profile_top and rank == 0 else None
        for _ in range(3):
            dist.barrier()
            if profile is not None:
                profile.enable()
            t0 = time.perf_counter()
            for _ in range(n_calls):
                fn()
            best = min(best, (time.perf_counter() - t0) / n_calls * 1e6)
            if profile is not None:
                profile.disable()
        issued["aten_ops"] = _count_aten(fn)  # after the timing: a dispatch mode leaves state behind
        us = _rank_max([best], device)[0]
        row = {"variant": args.host_profile, "mode": mode, "cp": cp, "tokens_per_gpu": rows // cp,
               "heads": heads, "head_dim": dim, "calls": n_calls, "us_per_call": us,
               "per_call": issued}  # fmt: skip
        out.append(row)
        if rank == 0:
            print(row, file=sys.stderr, flush=True)
            if profile is not None:
                text = io.StringIO()
                stats = pstats.Stats(profile, stream=text).sort_stats("tottime")
                stats.print_stats(args.host_profile_top)
                print(text.getvalue(), file=sys.stderr, flush=True)
    return out


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """CP efficiency per (tokens, kv heads, mix, layout, provider, mode): ring TFLOP/s per GPU / single."""

    def key(r: dict[str, Any]) -> tuple:
        return *_shape_key(r), r["mode"]

    single = {key(r): r.get("tflops") for r in records if r["provider"] == "single"}
    out = []
    for r in records:
        if r["provider"] == "single" or r["provider"].startswith("ring_window") or "tflops" not in r:
            continue
        s = r["shape"]
        base = single.get(key(r))
        eff = r["tflops"] / base if base else None
        target = goal(r["mode"], s["heads"], s["kv_heads"])
        out.append({
            "tokens_per_gpu": s["tokens_per_gpu"], "heads": s["heads"], "kv_heads": s["kv_heads"],
            "mix": s["mix"], "layout": s["layout"], "cp": s["cp"], "provider": r["provider"],
            "transport": r.get("transport"), "mode": r["mode"], "ring_ms": r["median_ms"],
            "ring_tflops_per_gpu": r["tflops"], "single_tflops": base, "cp_efficiency": eff, "goal": target,
            "meets_goal": None if eff is None or target is None else eff >= target,
        })  # fmt: skip
    return out


def _nccl_version() -> str:
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


class _LogLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _payload(
    args: argparse.Namespace, world: int, log_lines: list[str], records: list[dict[str, Any]],
    host: list[dict[str, Any]], complete: bool,
) -> dict[str, Any]:  # fmt: skip
    env = env_fingerprint()
    config = {k: v for k, v in vars(args).items() if k not in ("out", "device_now", "command", "commit")}
    return {
        "benchmark": "ring", "complete": complete, "command": args.command,
        "commit": args.commit or env["git_sha"], "env": env,
        "nccl": _nccl_version() if args.device == "cuda" else None,
        "rank_env": {k: os.environ.get(k) for k in (*RANK_ENV, "THD_CP_TRANSPORT", "THD_AUTOTUNE")},
        "config": {**config, "cp": world}, "transport_log": list(log_lines), "records": records,
        "summary": summarize(records), "window": window_summary(records), "host_time": host,
    }  # fmt: skip


def worker(rank: int, world: int, args: argparse.Namespace, init_method: str | None) -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    for name, value in RANK_ENV.items():
        os.environ.setdefault(name, value)
    logs = _LogLines()
    logging.getLogger("thd.cp").addHandler(logs)
    logging.getLogger("thd.cp").setLevel(logging.INFO)
    if rank == 0:  # the transport choices on stderr (thd.cp logs at INFO, propagated here)
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
    init: dict[str, Any] = {"init_method": init_method or "env://", "rank": rank, "world_size": world}
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        args.device_now = f"cuda:{local_rank}"
        if args.group == "bound":
            init["device_id"] = torch.device("cuda", local_rank)
        elif args.group == "high-priority":
            init["pg_options"] = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
        dist.init_process_group("nccl", **init)  # "default": exactly what users write
    else:  # smoke mode: gloo, attention through the torch reference
        os.environ["THD_ATTENTION_BACKEND"] = "reference"
        args.device_now = "cpu"
        dist.init_process_group("gloo", **init)
    try:
        records: list[dict[str, Any]] = []
        host: list[dict[str, Any]] = []
        if args.host_profile:
            host = host_profile(world, rank, args)
            if rank == 0:
                write_json(args.out, _payload(args, world, logs.lines, records, host, True))
                print(f"wrote {args.out}", file=sys.stderr)
            return

        def dump(complete: bool) -> None:  # rank 0, after every shape: a cut-short run keeps its data
            if rank == 0:
                write_json(args.out, _payload(args, world, logs.lines, records, host, complete))

        # symm-mem last, in a pass of its own: a transport that fails badly cannot cost the others.
        passes = [([t for t in args.transports if t != "symm-mem"], True)]
        if "symm-mem" in args.transports:
            passes.append((["symm-mem"], False))
        for transports, single_too in passes:
            for tokens in args.tokens:
                for kv_heads in args.kv_heads:
                    for mix in args.mixes:
                        for layout in args.layouts:
                            records.extend(run_shape(tokens, kv_heads, mix, layout, world, rank, args,
                                                     transports, single_too))  # fmt: skip
                            dump(False)
                            if rank == 0:
                                print(f"done {transports} tokens={tokens} kv_heads={kv_heads} mix={mix} "
                                      f"layout={layout}", file=sys.stderr, flush=True)  # fmt: skip
        host = host_times(world, rank, args) if args.host_calls > 0 else []
        dump(True)
        if rank == 0:
            for row in summarize(records):
                print({k: row[k] for k in ("tokens_per_gpu", "kv_heads", "provider", "transport", "mode",
                                           "cp_efficiency", "goal")}, file=sys.stderr)  # fmt: skip
            for row in window_summary(records):
                print(row, file=sys.stderr)
            for row in host:
                print(row, file=sys.stderr)
            print(f"wrote {args.out}", file=sys.stderr)
    finally:
        dist.destroy_process_group()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", required=True, help="JSON file to write (rank 0)")
    parser.add_argument("--cp", type=int, default=2, help="ranks to spawn when not under torchrun")
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 65536], help="tokens per GPU")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument(
        "--kv-heads", type=int, nargs="+", default=[16, 2], help="K/V heads (GQA when < heads)"
    )
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--mixes", nargs="+", choices=list(MIXES), default=["1024-8192"])
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=["padded"])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument(
        "--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS),
        help="THD_CP_TRANSPORT values to measure (auto: the library's own choice)",
    )  # fmt: skip
    parser.add_argument(
        "--group", choices=GROUPS, default="default",
        help="how the NCCL group is created (default: plain init_process_group('nccl'))",
    )  # fmt: skip
    parser.add_argument("--no-overlap", action="store_true", help="also measure the ring without overlap")
    parser.add_argument(
        "--window", type=int, default=0,
        help="also the ring with window_size=(W, 0) (auto transport): time saved, launches skipped",
    )  # fmt: skip
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument(
        "--host-calls", type=int, default=200, help="calls per host-time measurement (0: skip)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", default="", help="commit the code is at (the device copy has no .git)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 8k tokens, MHA, few iterations")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo smoke test")
    parser.add_argument(
        "--host-profile", choices=("orchestration", "cpu"), default=None,
        help="the ring's Python cost per call on CPU gloo ranks (implies --device cpu; see the docstring)",
    )  # fmt: skip
    parser.add_argument("--host-profile-top", type=int, default=0, help="print rank 0's cProfile (rows)")
    args = parser.parse_args(argv)
    if args.host_profile:
        args.device = "cpu"
    if args.quick:
        args.tokens, args.kv_heads, args.warmup, args.iters, args.host_calls = [8192], [args.heads], 1, 3, 20
    args.command = command_line(argv, "bench_ring.py")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if cuda_missing("bench_ring", args.device, "CUDA GPUs"):
        return 1
    for name, value in RANK_ENV.items():  # inherited by the spawned ranks
        os.environ.setdefault(name, value)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None)
        return 0
    if args.device == "cuda" and torch.cuda.device_count() < args.cp:
        print(f"bench_ring: needs {args.cp} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="thd-bench-ring-") as tmp:
        mp.spawn(worker, args=(args.cp, args, f"file://{tmp}/rendezvous"), nprocs=args.cp, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
