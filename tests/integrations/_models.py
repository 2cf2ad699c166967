"""Tiny random-weight transformers models and batches shared by the integration tests.

Every model family is built from a config (no hub access) with head_dim 32; the oracle runs
each document on its own through ``attn_implementation=ORACLE[family]`` with the same weights:
``"sdpa"``, except ``"eager"`` for Gemma 2, whose logit softcap transformers' sdpa function
drops (it has no ``softcap`` parameter; only eager, flash and flex apply it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "FAMILIES",
    "GEMMA2",
    "ORACLE",
    "VOCAB",
    "documents",
    "grads",
    "make_model",
    "next_token_loss",
    "packed_batch",
    "per_document_logits",
    "right_padded_batch",
    "split_packed",
    "split_padded",
]

VOCAB = 96
FAMILIES = ("llama", "qwen2", "mistral", "gemma2")
ORACLE = {"llama": "sdpa", "qwen2": "sdpa", "mistral": "sdpa", "gemma2": "eager"}

# Gemma 2: layer 0 is a sliding-window layer, layer 1 a full one (the config's default
# alternation). The window of 8 is shorter than most test documents; the larger random
# weights (initializer_range 0.1, std 0.02 by default) make the raw attention scores reach
# about +-7, so the logit cap of 5 bends them (with std 0.02 they stay below 0.3 and any cap
# >= 1 would be a no-op); query_pre_attn_scalar 16 makes the scale 1/4, not head_dim ** -0.5,
# so the model's ``scaling`` must reach thd as well.
GEMMA2 = {
    "head_dim": 32,
    "query_pre_attn_scalar": 16,
    "sliding_window": 8,
    "attn_logit_softcapping": 5.0,
    "initializer_range": 0.1,
}


def tiny_config(family: str, **overrides: Any):  # type: ignore[no-untyped-def]
    """A 2-layer config: hidden 128, 4 query heads and 2 KV heads of dimension 32 (GQA);
    Gemma 2 adds :data:`GEMMA2`."""
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 128,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    if family == "gemma2":
        common |= GEMMA2
    config_cls = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "mistral": MistralConfig,
        "gemma2": Gemma2Config,
    }
    return config_cls[family](**{**common, **overrides})


def make_model(
    family: str,
    attn_implementation: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    **overrides: Any,
) -> torch.nn.Module:
    """The same random weights for a given ``(family, seed, overrides)``, whatever the attention."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_config(family, **overrides), attn_implementation=attn_implementation, dtype=torch.float32
    )
    return model.to(device=device, dtype=dtype).train()


def documents(lengths: Sequence[int], seed: int = 0) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def packed_batch(docs: Sequence[Tensor], *, flash_kwargs: bool, device: str = "cpu") -> dict[str, Any]:
    """``DataCollatorWithFlattening`` output: with ``flash_kwargs`` the ``cu_seq_lens_*`` /
    ``max_length_*`` kwargs, else ``position_ids`` alone."""
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    batch = collator([{"input_ids": d.tolist()} for d in docs])
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}


def right_padded_batch(
    docs: Sequence[Tensor], *, left: bool = False, device: str = "cpu"
) -> dict[str, Tensor]:
    width = max(d.numel() for d in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask = torch.zeros(len(docs), width, dtype=torch.long)
    for b, d in enumerate(docs):
        cols = slice(width - d.numel(), width) if left else slice(0, d.numel())
        ids[b, cols] = d
        mask[b, cols] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def split_packed(logits: Tensor, docs: Sequence[Tensor]) -> list[Tensor]:
    """``[1, T, V]`` -> one ``[L, V]`` per document."""
    return list(torch.split(logits[0], [d.numel() for d in docs]))


def split_padded(logits: Tensor, docs: Sequence[Tensor]) -> list[Tensor]:
    """``[B, S, V]`` right-padded -> the real rows of each document."""
    return [logits[b, : d.numel()] for b, d in enumerate(docs)]


def per_document_logits(model: torch.nn.Module, docs: Sequence[Tensor], device: str = "cpu") -> list[Tensor]:
    """The oracle: every document alone (batch size 1, no mask)."""
    return [model(input_ids=d[None].to(device), use_cache=False).logits[0] for d in docs]


def next_token_loss(logits: Sequence[Tensor], docs: Sequence[Tensor]) -> Tensor:
    """Summed next-token cross entropy within each document (fp32)."""
    total = logits[0].new_zeros((), dtype=torch.float32)
    for lg, d in zip(logits, docs, strict=True):
        if d.numel() > 1:
            total = total + F.cross_entropy(lg[:-1].float(), d[1:].to(lg.device), reduction="sum")
    return total


def grads(model: torch.nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
