"""Context-parallel ring attention efficiency on several GPUs (issue 5: cp=2 on two H200s).

For each per-GPU token count and document mix, every rank times (CUDA events, fixed iteration
counts so that the ranks stay in lockstep, max over ranks):

- ``single``: ``thd.attention`` on one GPU with ``tokens`` packed causal documents;
- ``ring``: ``thd.cp.ring_attention`` at ``cp`` ranks on ``cp * tokens`` documents of the same mix;
- ``ring_no_overlap``: the same ring with each exchange waited on before the step's compute.

FLOPs count real tokens only (``4 * H * D * sum(L^2) / 2`` causal forward, backward 2.5x). The
ring's per-GPU TFLOP/s is ``flops(global batch) / (time * cp)``; its CP efficiency is that
divided by the single-GPU TFLOP/s. Layouts: ``padded`` (arbitrary lengths, slots rounded up to
``2 * cp``: the exact per-rank-count path) and ``aligned`` (lengths themselves multiples of
``2 * cp``: the ``cu // cp`` fast path).

Launch with torchrun (``torchrun --standalone --nproc-per-node=2 benchmarks/bench_ring.py --out
f.json``) or plainly (``python benchmarks/bench_ring.py --out f.json``), which starts ``--cp``
ranks itself with ``torch.multiprocessing`` (mp.spawn). Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import attention_flops, env_fingerprint, error_text, make_record, write_json
from torch import Tensor

MIXES: dict[str, tuple[int, int]] = {"1024-8192": (1024, 8192), "4096-32768": (4096, 32768)}
LAYOUTS = ("padded", "aligned")
MODES = ("fwd", "fwd_bwd")
GOALS = {"fwd": 0.85, "fwd_bwd": 0.8}


def document_lengths(total: int, lo: int, hi: int, seed: int) -> list[int]:
    """Uniform random lengths in ``[lo, hi]`` filling exactly ``total`` tokens (the last one cut)."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(min(rng.randint(lo, hi), total - sum(lengths)))
    return lengths


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _cumsum(values: Sequence[int], device: torch.device) -> Tensor:
    out = [0]
    for n in values:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def _time_ms(fn: Callable[[], object], warmup: int, iters: int, device: torch.device) -> dict[str, float]:
    """Mean ms per call over ``iters`` calls after ``warmup``, max over ranks (all ranks call it).

    CUDA events on GPUs; a host clock on CPUs (the ``--device cpu`` smoke mode).
    """
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
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
    ms = torch.tensor([elapsed / iters], device=device)
    lo = ms.clone()
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return {"median_ms": float(ms.item()), "min_rank_ms": float(lo.item())}


def _randn(rows: int, heads: int, dim: int, seed: int, device: torch.device) -> Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.randn(rows, heads, dim, device=device, dtype=dtype, generator=gen)


def _callables(
    attn: Callable[[Tensor, Tensor, Tensor], Tensor],
    rows: int,
    heads: int,
    dim: int,
    seed: int,
    device: torch.device,
) -> dict[str, Callable[[], object]]:
    q, k, v, do = (_randn(rows, heads, dim, seed + i, device) for i in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def fwd() -> object:
        with torch.no_grad():
            return attn(q, k, v)

    def fwd_bwd() -> object:
        return torch.autograd.grad(attn(qg, kg, vg), (qg, kg, vg), do)

    return {"fwd": fwd, "fwd_bwd": fwd_bwd}


def _measure(
    provider: str,
    calls: dict[str, Callable[[], object]],
    flops: Callable[[str], float],
    shape: dict[str, Any],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    records = []
    for mode in args.modes:
        try:
            timing = _time_ms(calls[mode], args.warmup, args.iters, torch.device(args.device_now))
            records.append(make_record(op="ring_attention", provider=provider, mode=mode, shape=shape,
                                       flops=flops(mode), timing=timing))  # fmt: skip
        except Exception as exc:  # recorded, never raised: the other providers still run
            records.append(make_record(op="ring_attention", provider=provider, mode=mode, shape=shape,
                                       status="error", error=error_text(exc)))  # fmt: skip
    return records


def run_shape(tokens: int, mix: str, layout: str, cp: int, rank: int, args: argparse.Namespace) -> list[dict]:
    import thd
    from thd.cp import ring_attention

    heads, dim, m = args.heads, args.head_dim, 2 * cp
    lo, hi = MIXES[mix]
    device = torch.device(args.device_now)
    # Single GPU: `tokens` packed documents.
    local = document_lengths(tokens, lo, hi, args.seed)
    cu1 = _cumsum(local, device)
    max1 = max(local)
    single = lambda q, k, v: thd.attention(
        q, k, v, cu1, cu1, max_seqlen_q=max1, max_seqlen_kv=max1, causal=True
    )
    shape = {"tokens_per_gpu": tokens, "cp": cp, "heads": heads, "head_dim": dim, "mix": mix,
             "layout": layout, "dtype": "bfloat16" if device.type == "cuda" else "float32",
             "causal": True}  # fmt: skip
    records = _measure(
        "single",
        _callables(single, tokens, heads, dim, 1, device),
        lambda mode: attention_flops(local, local, heads, dim, causal=True, mode=mode),
        {**shape, "docs": len(local), "max_doclen": max1},
        args,
    )
    # Ring: cp * tokens packed documents of the same mix, every slot a multiple of 2*cp.
    lens = document_lengths(cp * tokens, lo, hi, args.seed + 1)
    if layout == "aligned":
        lens = [_round_up(n, m) for n in lens]
    slots = [_round_up(n, m) for n in lens]
    cu, cup = _cumsum(lens, device), _cumsum(slots, device)
    longest, pad = max(lens), lens != slots
    rows = sum(slots)
    ring_shape = {**shape, "docs": len(lens), "max_doclen": longest, "global_rows": rows, "padding": pad}
    global_flops = lambda mode: attention_flops(lens, lens, heads, dim, causal=True, mode=mode)
    for provider, overlap in (("ring", True), ("ring_no_overlap", False)):
        ring = lambda q, k, v, overlap=overlap: ring_attention(
            q, k, v, cu, cu, cup, cup, causal=True, pad_between_seqs=pad,
            max_seqlen_q=longest, max_seqlen_kv=longest, _overlap=overlap,
        )  # fmt: skip
        calls = _callables(ring, rows // cp, heads, dim, 10 + rank, device)
        recs = _measure(provider, calls, lambda mode: global_flops(mode) / cp, ring_shape, args)
        records.extend(recs)
    return records


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """CP efficiency per (tokens, mix, layout, provider, mode): ring TFLOP/s per GPU / single."""
    single = {
        (r["shape"]["tokens_per_gpu"], r["shape"]["mix"], r["shape"]["layout"], r["mode"]): r.get("tflops")
        for r in records
        if r["provider"] == "single"
    }
    out = []
    for r in records:
        if r["provider"] == "single" or "tflops" not in r:
            continue
        s = r["shape"]
        base = single.get((s["tokens_per_gpu"], s["mix"], s["layout"], r["mode"]))
        eff = r["tflops"] / base if base else None
        out.append({
            "tokens_per_gpu": s["tokens_per_gpu"], "mix": s["mix"], "layout": s["layout"], "cp": s["cp"],
            "provider": r["provider"], "mode": r["mode"], "ring_tflops_per_gpu": r["tflops"],
            "single_tflops": base, "cp_efficiency": eff, "goal": GOALS[r["mode"]],
            "meets_goal": None if eff is None else eff >= GOALS[r["mode"]],
        })  # fmt: skip
    return out


def worker(rank: int, world: int, args: argparse.Namespace, init_method: str | None) -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if args.device == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(local_rank)
        args.device_now = f"cuda:{local_rank}"
        # High-priority NCCL streams let the ring's transfers get SMs while attention
        # kernels fill the GPU (otherwise the exchange waits for the compute to drain).
        options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=args.high_priority)
        if args.nccl_max_ctas:  # fewer NCCL blocks: more SMs left to the overlapped attention
            options.config.max_ctas = args.nccl_max_ctas
        dist.init_process_group(
            "nccl", init_method=init_method or "env://", rank=rank, world_size=world,
            timeout=timedelta(minutes=10), device_id=torch.device("cuda", local_rank), pg_options=options,
        )  # fmt: skip
    else:  # smoke mode: gloo, attention through the torch reference
        os.environ["THD_ATTENTION_BACKEND"] = "reference"
        args.device_now = "cpu"
        dist.init_process_group(
            "gloo", init_method=init_method or "env://", rank=rank, world_size=world,
            timeout=timedelta(minutes=10),
        )  # fmt: skip
    try:
        records: list[dict[str, Any]] = []
        for tokens in args.tokens:
            for mix in args.mixes:
                for layout in args.layouts:
                    records.extend(run_shape(tokens, mix, layout, world, rank, args))
                    if rank == 0:
                        print(f"done tokens={tokens} mix={mix} layout={layout}", file=sys.stderr, flush=True)
        if rank == 0:
            config = {k: v for k, v in vars(args).items() if k not in ("out", "device_now")}
            payload = {"benchmark": "ring", "env": env_fingerprint(), "config": {**config, "cp": world},
                       "records": records, "summary": summarize(records)}  # fmt: skip
            path = write_json(args.out, payload)
            for row in payload["summary"]:
                print(row, file=sys.stderr)
            print(f"wrote {path}", file=sys.stderr)
    finally:
        dist.destroy_process_group()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", required=True, help="JSON file to write (rank 0)")
    parser.add_argument("--cp", type=int, default=2, help="ranks to spawn when not under torchrun")
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 65536], help="tokens per GPU")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--mixes", nargs="+", choices=list(MIXES), default=list(MIXES))
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-high-priority", dest="high_priority", action="store_false",
        help="create the NCCL group without high-priority streams",
    )  # fmt: skip
    parser.add_argument(
        "--nccl-max-ctas", type=int, default=0,
        help="cap the CTAs (SMs) the CP group's NCCL communicator uses (0: NCCL's default)",
    )  # fmt: skip
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo smoke test")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_ring: needs CUDA GPUs (or --device cpu for a smoke test)", file=sys.stderr)
        return 1
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
