"""Benchmark: training a transformers model with ``attn_implementation="thd"`` on a packed row
against ``"sdpa"`` on right-padded rows and against sdpa and flex_attention on the same packed row.

A small Llama-shaped model (default 8 layers, hidden 2048, 16 heads of 128, bf16, random
weights from a config) trains on one batch of random-length documents (uniform in
``[--min-len, --max-len]``, ``--tokens`` real tokens in all). Providers (``--providers``), every
one on the same documents in the same run:

- ``thd``: one packed row ``[1, T]`` with the ``cu_seq_lens_*`` / ``max_length_*`` kwargs of
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` (no padding, no host sync in
  attention);
- ``sdpa``: the same documents as a right-padded ``[B, W]`` batch with a 2-D ``attention_mask``
  (transformers builds the 4-D mask), what a user without packing runs; ``W`` is the longest
  document rounded up to ``--pad-to-multiple-of`` (64, like a tokenizer's ``pad_to_multiple_of``;
  it also keeps sdpa's masked kernels on aligned rows);
- ``sdpa_packed`` and ``flex_packed``: what a user who already packs runs without thd: the
  same packed row with ``position_ids`` only (``DataCollatorWithFlattening()``), from which
  transformers builds the document-causal mask (a dense 4-D mask for sdpa, a block mask for
  ``attn_implementation="flex_attention"``, compiled by transformers).

A step is forward, loss, backward and a fused AdamW update. After ``--warmup`` steps (compiles,
allocator), ``--steps`` steps are timed one by one (synchronized wall time). Tokens/s counts real
tokens only; ``tflops`` is the useful work per second (``6 * matmul parameters * real tokens``
plus causal attention over the real documents, the same count for every provider); peak memory
is ``torch.cuda.max_memory_allocated`` over the timed steps (``None`` on a CPU). The loss of every
step is recorded; the first step's (same weights, same documents) must agree between the
providers, as must ``initial_loss`` and ``probe_logits`` (one untimed forward without gradients
before training; ``initial_agreement`` gives each provider's distance to thd: the logits are what
shows attention across documents). A provider that fails (e.g. out of memory, or flex's missing
CPU backward) records its error and the run goes on. ``summary`` compares thd with
right-padded sdpa (top-level keys, as before) and with every baseline (``against``).

    PYTHONPATH=src:. python3 benchmarks/bench_transformers.py --out benchmarks/results/transformers.json

Defaults (8 layers, hidden 2048, 32768 tokens of 64..4096-token documents, 3 + 10 steps per
provider): about 105 TFLOP of useful work per step; on an H200 (code 2011187) 280 ms per thd
step and 568 ms per sdpa step (its padded rows); the whole committed run (thd and sdpa only)
took 28 s. ``--quick`` is a tiny smoke configuration (2 layers, hidden 128, 1024 tokens) that
also runs on a CPU (``--device cpu``; thd then runs its torch reference, or the Triton
interpreter under ``TRITON_INTERPRET=1``; flex_attention has no CPU backward, so ``flex_packed``
records that error after its initial check).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from _common import (
    attention_flops,
    command_line,
    document_lengths,
    env_fingerprint,
    error_text,
    make_record,
    sync,
    write_json,
)

PROVIDERS = ("thd", "sdpa", "sdpa_packed", "flex_packed")
# provider -> (attn_implementation, batch form); every provider trains on the same documents.
SETUPS = {
    "thd": ("thd", "packed"),  # one row, DataCollatorWithFlattening's cu_seq_lens_* kwargs
    "sdpa": ("sdpa", "padded"),  # right-padded rows, 2-D attention_mask
    "sdpa_packed": ("sdpa", "position_ids"),  # one row, document mask from position_ids
    "flex_packed": ("flex_attention", "position_ids"),
}
BATCH_FORMS = {
    "packed": "one packed row with DataCollatorWithFlattening(return_flash_attn_kwargs=True) kwargs",
    "padded": "right-padded rows with a 2-D attention_mask",
    "position_ids": "one packed row with position_ids only (transformers builds the document mask)",
}
# --quick: parser defaults of a tiny smoke run (explicit flags still win).
QUICK = {
    "tokens": 1024,
    "min_len": 16,
    "max_len": 256,
    "layers": 2,
    "hidden": 128,
    "heads": 4,
    "intermediate": 256,
    "vocab": 512,
    "warmup": 1,
    "steps": 2,
}


def make_documents(lengths: Sequence[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def packed_batch(
    docs: Sequence[list[int]], device: torch.device, flash_kwargs: bool = True
) -> dict[str, Any]:
    """One packed row: ``input_ids``, ``labels``, ``position_ids`` and, with ``flash_kwargs``, the
    ``cu_seq_lens_*`` / ``max_length_*`` kwargs. Without them transformers' sdpa and flex paths
    find the documents from ``position_ids`` (``find_packed_sequence_indices``) and mask across them."""
    from transformers import DataCollatorWithFlattening

    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    batch = collate([{"input_ids": d} for d in docs])
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def padded_batch(docs: Sequence[list[int]], device: torch.device, multiple: int = 1) -> dict[str, Any]:
    width = -(-max(len(d) for d in docs) // multiple) * multiple
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask = torch.zeros(len(docs), width, dtype=torch.long)
    for b, d in enumerate(docs):
        ids[b, : len(d)] = torch.tensor(d)
        mask[b, : len(d)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def step_flops(args: argparse.Namespace, lengths: Sequence[int]) -> float:
    """Useful FLOPs of one training step on the real tokens: ``6 * N * T`` for the ``N`` matmul
    parameters (projections, MLP, LM head; not the embedding) plus causal attention (forward and
    backward, FlashAttention convention) over every document and layer."""
    head_dim = args.hidden // args.heads
    kv = (args.kv_heads or args.heads) * head_dim
    per_layer = args.hidden * (2 * args.heads * head_dim + 2 * kv) + 3 * args.hidden * args.intermediate
    params = args.layers * per_layer + args.vocab * args.hidden
    attention = attention_flops(lengths, lengths, args.heads, head_dim, causal=True, mode="fwd_bwd")
    return 6.0 * params * sum(lengths) + args.layers * attention


def provider_batch(
    provider: str, docs: Sequence[list[int]], args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    form = SETUPS[provider][1]
    if form == "padded":
        return padded_batch(docs, device, args.pad_to_multiple_of)
    return packed_batch(docs, device, flash_kwargs=form == "packed")


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


def _release(device: torch.device) -> None:
    """Free the last provider's model, optimizer state and cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


PROBE_LOGITS = 8


def probe_positions(form: str, lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """``(batch rows, positions)`` of the first and last token of every document in a batch of
    ``form``: where attention across documents would show first."""
    rows, positions, start = [], [], 0
    for b, n in enumerate(lengths):
        row, first = (b, 0) if form == "padded" else (0, start)
        rows += [row, row]
        positions += [first, first + n - 1]
        start += n
    return rows, positions


def initial_check(
    model: torch.nn.Module, batch: dict[str, Any], form: str, lengths: Sequence[int]
) -> dict[str, Any]:
    """One untimed forward of the untrained model without gradients: the loss and the first
    ``PROBE_LOGITS`` logits at :func:`probe_positions`. Providers that compute the same
    document-causal attention agree on both; the loss alone barely moves at initialization (a
    model attending across documents changed it by 7e-4 in the quick configuration, its probe
    logits by 0.4, while the providers' probes agree to 0.004). Also runs where a provider cannot
    train (flex_attention on a CPU)."""
    with torch.no_grad():
        res = model(**batch, use_cache=False)
    rows, positions = probe_positions(form, lengths)
    probe = res.logits[rows, positions, :PROBE_LOGITS].float()
    return {"initial_loss": float(res.loss), "probe_logits": probe.tolist()}


def agreement(thd_rec: dict[str, Any], other: dict[str, Any]) -> dict[str, float]:
    """How far a provider's :func:`initial_check` is from thd's."""
    gap = torch.tensor(other["probe_logits"]) - torch.tensor(thd_rec["probe_logits"])
    return {
        "initial_loss_abs_diff": abs(other["initial_loss"] - thd_rec["initial_loss"]),
        "probe_logits_max_abs_diff": float(gap.abs().max()),
    }


def run_provider(
    model: torch.nn.Module, batch: dict[str, Any], args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    """Time ``args.steps`` training steps; returns timing, first loss and peak memory."""
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
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times_ms = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        sync(device)
        times_ms.append((time.perf_counter() - start) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    cuts = statistics.quantiles(times_ms, n=10, method="inclusive") if len(times_ms) > 1 else times_ms * 9
    return {
        "timing": {"median_ms": statistics.median(times_ms), "p20_ms": cuts[1], "p80_ms": cuts[7]},
        "first_loss": losses[0],
        "losses": losses,
        "peak_memory_gib": peak,
    }


def compare(thd_rec: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """thd against one baseline of the same run: tokens/s ratio, peak-memory ratio, first-loss gap."""
    memories = thd_rec["peak_memory_gib"], other["peak_memory_gib"]
    return {
        "speedup_tokens_per_s": thd_rec["tokens_per_s"] / other["tokens_per_s"],
        "memory_ratio": memories[0] / memories[1] if all(memories) else None,
        "first_loss_abs_diff": abs(thd_rec["first_loss"] - other["first_loss"]),
    }


def _describe(rec: dict[str, Any]) -> str:
    if rec["status"] != "ok":
        return str(rec["error"])
    peak = "n/a" if rec["peak_memory_gib"] is None else f"{rec['peak_memory_gib']:.1f} GiB"
    return (
        f"{rec['tokens_per_s']:,.0f} tok/s, {rec['median_ms']:.1f} ms/step, {rec['tflops']:.1f} TFLOP/s, "
        f"peak {peak}, first loss {rec['first_loss']:.4f} ({rec['wall_s']:.0f} s)"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    p.add_argument("--quick", action="store_true", help="tiny smoke configuration (CPU: seconds)")
    p.add_argument("--tokens", type=int, default=32768, help="real tokens per step")
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--pad-to-multiple-of", type=int, default=64, help="sdpa: padded batch width")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    if p.parse_known_args(argv)[0].quick:
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.tokens < 1 or args.pad_to_multiple_of < 1:
        p.error("expected --steps >= 1, --warmup >= 0, --tokens >= 1 and --pad-to-multiple-of >= 1")
    if not 1 <= args.min_len <= args.max_len:
        p.error("expected 1 <= --min-len <= --max-len")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    device = torch.device(args.device)
    lengths = document_lengths(args.tokens, args.min_len, args.max_len, args.seed)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    env = env_fingerprint()
    flops = step_flops(args, lengths)
    padded_width = -(-max(lengths) // args.pad_to_multiple_of) * args.pad_to_multiple_of
    payload: dict[str, Any] = {
        "benchmark": "transformers",
        "command": command_line(argv, Path(__file__).name),
        "commit": env["git_sha"],
        "gpu": env["device"],
        "env": env,
        "config": config,
        "documents": {
            "count": len(lengths),
            "lengths": lengths,
            "padded_tokens": len(lengths) * padded_width,
        },
        "step_tflop": flops / 1e12,
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
    for provider in args.providers:
        impl, form = SETUPS[provider]
        batch = provider_batch(provider, docs, args, device)
        rows = batch["input_ids"].numel()  # sdpa: padding rows included
        record = {
            "op": "train_step",
            "provider": provider,
            "mode": "fwd_bwd_step",
            "shape": shape,
            "rows": rows,
        }
        record |= {"attn_implementation": impl, "batch": BATCH_FORMS[form]}
        provider_started = time.perf_counter()
        model = None
        try:
            model = make_model(args, impl, device)
            record |= initial_check(model, batch, form, lengths)
            res = run_provider(model, batch, args, device)
        except Exception as exc:  # e.g. out of memory: record it, run the next provider
            rec = make_record(**record, status="error", error=error_text(exc))
        else:
            median_s = res["timing"]["median_ms"] / 1e3
            rec = make_record(
                **record,
                flops=flops,
                timing=res["timing"],
                tokens_per_s=args.tokens / median_s,
                first_loss=res["first_loss"],
                losses=res["losses"],
                peak_memory_gib=res["peak_memory_gib"],
            )
        rec["wall_s"] = time.perf_counter() - provider_started
        del model
        _release(device)
        payload["records"].append(rec)
        print(f"{provider:11s} rows={rows:6d} {_describe(rec)}")
    ok = {r["provider"]: r for r in payload["records"] if r["status"] == "ok"}
    if "thd" in ok:
        baselines = {p: compare(ok["thd"], rec) for p, rec in ok.items() if p != "thd"}
        # The top-level keys stay thd against right-padded sdpa (the first committed comparison).
        payload["summary"] = {**baselines.get("sdpa", {}), "against": baselines}
        print(f"summary: {payload['summary']}")
    checked = {r["provider"]: r for r in payload["records"] if "probe_logits" in r}
    if "thd" in checked:  # every provider's forward against thd's, failed trainings included
        payload["initial_agreement"] = {
            p: agreement(checked["thd"], r) for p, r in checked.items() if p != "thd"
        }
    payload["wall_s"] = time.perf_counter() - started
    write_json(args.out, payload)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
