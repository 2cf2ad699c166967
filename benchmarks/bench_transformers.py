"""Benchmark: training a transformers model with ``attn_implementation="thd"`` on packed batches
against ``"sdpa"`` on right-padded batches of the same documents.

A small Llama-shaped model (default 8 layers, hidden 2048, 16 heads of 128, bf16, random
weights from a config) trains on one batch of random-length documents (uniform in
``[--min-len, --max-len]``, ``--tokens`` real tokens in all):

- ``thd``: one packed row ``[1, T]`` with the ``cu_seq_lens_*`` / ``max_length_*`` kwargs of
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` (no padding, no host sync in
  attention);
- ``sdpa``: the same documents as a right-padded ``[B, max_len]`` batch with a 2-D
  ``attention_mask`` (transformers builds the 4-D mask), what a user without packing runs.

A step is forward, loss, backward and a fused AdamW update. After ``--warmup`` steps (compiles,
allocator), ``--steps`` steps are timed one by one (synchronized wall time). Tokens/s counts real
tokens only; peak memory is ``torch.cuda.max_memory_allocated`` over the timed steps. The first
step's loss of both providers is recorded (same weights, same documents: it must agree). A
provider that fails (e.g. out of memory) records its error and the run goes on.

    PYTHONPATH=src:. python3 benchmarks/bench_transformers.py --out benchmarks/results/transformers.json
"""

from __future__ import annotations

import argparse
import gc
import random
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from _common import env_fingerprint, error_text, make_record, write_json

PROVIDERS = ("thd", "sdpa")


def document_lengths(total: int, lo: int, hi: int, seed: int) -> list[int]:
    """Uniform random lengths in ``[lo, hi]`` filling exactly ``total`` tokens (the last one cut)."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(min(rng.randint(lo, hi), total - sum(lengths)))
    return lengths


def make_documents(lengths: Sequence[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def packed_batch(docs: Sequence[list[int]], device: torch.device) -> dict[str, Any]:
    from transformers import DataCollatorWithFlattening

    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d} for d in docs])
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def padded_batch(docs: Sequence[list[int]], device: torch.device) -> dict[str, Any]:
    width = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask = torch.zeros(len(docs), width, dtype=torch.long)
    for b, d in enumerate(docs):
        ids[b, : len(d)] = torch.tensor(d)
        mask[b, : len(d)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def make_model(args: argparse.Namespace, impl: str, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or args.heads,
        max_position_embeddings=max(args.max_len, 4096),
    )
    torch.manual_seed(args.seed)  # same weights for every provider
    with device:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=torch.bfloat16)
    return model.train()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    """Free the last provider's model, optimizer state and cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_provider(
    impl: str, batch: dict[str, Any], args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    """Time ``args.steps`` training steps; returns timing, first loss and peak memory."""
    model = make_model(args, impl, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    losses: list[float] = []

    def step() -> None:
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))

    for _ in range(args.warmup):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times_ms = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        _sync(device)
        times_ms.append((time.perf_counter() - start) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    cuts = statistics.quantiles(times_ms, n=10, method="inclusive") if len(times_ms) > 1 else times_ms * 9
    return {
        "timing": {"median_ms": statistics.median(times_ms), "p20_ms": cuts[1], "p80_ms": cuts[7]},
        "first_loss": losses[0],
        "peak_memory_gib": peak,
    }


def _describe(rec: dict[str, Any]) -> str:
    if rec["status"] != "ok":
        return str(rec["error"])
    peak = rec["peak_memory_gib"] or 0.0
    return (
        f"{rec['tokens_per_s']:,.0f} tok/s, {rec['median_ms']:.1f} ms/step, peak {peak:.1f} GiB, "
        f"first loss {rec['first_loss']:.4f}"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    p.add_argument("--tokens", type=int, default=32768, help="real tokens per step")
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    device = torch.device(args.device)
    lengths = document_lengths(args.tokens, args.min_len, args.max_len, args.seed)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    env = env_fingerprint()
    payload: dict[str, Any] = {
        "benchmark": "transformers",
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "commit": env["git_sha"],
        "gpu": env["device"],
        "env": env,
        "config": config,
        "documents": {
            "count": len(lengths),
            "lengths": lengths,
            "padded_tokens": len(lengths) * max(lengths),
        },
        "records": [],
    }
    try:
        import transformers

        from thd.integrations.transformers import register
    except ImportError as exc:
        payload["records"] = [
            make_record(
                op="train_step",
                provider=p,
                mode="fwd_bwd_step",
                shape={},
                status="unavailable",
                error=str(exc),
            )
            for p in args.providers
        ]
        write_json(args.out, payload)
        print(f"transformers unavailable: {exc}", file=sys.stderr)
        return 0
    import thd

    env["transformers"], env["thd"] = transformers.__version__, thd.__version__
    register()
    docs = make_documents(lengths, args.vocab, args.seed)
    shape = {"tokens": args.tokens, "documents": len(lengths), "max_len": max(lengths)}
    shape |= {"layers": args.layers, "hidden": args.hidden, "heads": args.heads}
    for impl in args.providers:
        batch = packed_batch(docs, device) if impl == "thd" else padded_batch(docs, device)
        rows = batch["input_ids"].numel()  # sdpa: padding rows included
        record = {"op": "train_step", "provider": impl, "mode": "fwd_bwd_step", "shape": shape, "rows": rows}
        try:
            res = run_provider(impl, batch, args, device)
        except Exception as exc:  # e.g. out of memory: record it, run the next provider
            rec = make_record(**record, status="error", error=error_text(exc))
        else:
            median_s = res["timing"]["median_ms"] / 1e3
            rec = make_record(
                **record,
                timing=res["timing"],
                tokens_per_s=args.tokens / median_s,
                first_loss=res["first_loss"],
                peak_memory_gib=res["peak_memory_gib"],
            )
        _release(device)
        payload["records"].append(rec)
        print(f"{impl:5s} rows={rows:6d} {_describe(rec)}")
    ok = {r["provider"]: r for r in payload["records"] if r["status"] == "ok"}
    if "thd" in ok and "sdpa" in ok:
        payload["summary"] = {
            "speedup_tokens_per_s": ok["thd"]["tokens_per_s"] / ok["sdpa"]["tokens_per_s"],
            "memory_ratio": (ok["thd"]["peak_memory_gib"] / ok["sdpa"]["peak_memory_gib"])
            if ok["thd"]["peak_memory_gib"]
            else None,
            "first_loss_abs_diff": abs(ok["thd"]["first_loss"] - ok["sdpa"]["first_loss"]),
        }
        print(f"summary: {payload['summary']}")
    payload["wall_s"] = time.perf_counter() - started
    write_json(args.out, payload)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
