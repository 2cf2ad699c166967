"""``attn_implementation="thd"`` on a CUDA GPU in bf16 (the Triton kernels) against per-document sdpa.

The oracle is per-document sdpa (eager for Gemma 2: ``ORACLE``) in fp32 with the same weights;
thd in bf16 must be about as close to it as the per-document oracle in bf16 is (relative
Frobenius errors, logits and gradients). Gemma 2 runs here with a 200-token window (``OVERRIDES``):
longer than a tile, shorter than most documents, so the kernels skip tiles outside the window,
run whole tiles inside it and mask the tiles on its edge, with the attention-logit softcap.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from tests.integrations._models import (
    FAMILIES,
    ORACLE,
    documents,
    grads,
    make_model,
    next_token_loss,
    packed_batch,
    per_document_logits,
    right_padded_batch,
    split_packed,
    split_padded,
)
from thd.errors import ThdValueError
from thd.integrations.transformers.attention import make_attention_function

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
LENGTHS = (100, 333, 1, 517, 64, 250)
OVERRIDES: dict[str, dict[str, Any]] = {"gemma2": {"sliding_window": 200}}


def _rel(got: Tensor, want: Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


def _run(
    family: str, impl: str, form: str, dtype: torch.dtype, docs: list[Tensor]
) -> tuple[Tensor, dict[str, Tensor]]:
    """Logits of the real tokens (concatenated) and parameter gradients of the summed loss."""
    model = make_model(family, impl, dtype=dtype, device=DEVICE, **OVERRIDES.get(family, {}))
    if form == "per_document":
        logits = per_document_logits(model, docs, DEVICE)
    elif form == "right_padded":
        logits = split_padded(model(**right_padded_batch(docs, device=DEVICE), use_cache=False).logits, docs)
    else:
        batch = packed_batch(docs, flash_kwargs=form == "cu_seq_lens", device=DEVICE)
        batch.pop("labels")
        logits = split_packed(model(**batch, use_cache=False).logits, docs)
    next_token_loss(logits, docs).backward()
    return torch.cat([x.detach() for x in logits]), grads(model)


@pytest.fixture(scope="module")
def oracle() -> dict[str, Any]:
    docs = documents(LENGTHS, seed=11)
    return {
        family: {
            "docs": docs,
            "fp32": _run(family, ORACLE[family], "per_document", torch.float32, docs),
            "bf16": _run(family, ORACLE[family], "per_document", torch.bfloat16, docs),
        }
        for family in FAMILIES
    }


@pytest.mark.parametrize("form", ["cu_seq_lens", "position_ids", "right_padded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_matches_per_document_oracle(family: str, form: str, oracle: dict[str, Any]) -> None:
    ref = oracle[family]
    logits, g = _run(family, "thd", form, torch.bfloat16, ref["docs"])
    (want_logits, want_g), (bf16_logits, bf16_g) = ref["fp32"], ref["bf16"]
    bound = 2 * _rel(bf16_logits, want_logits) + 2e-3
    assert _rel(logits, want_logits) <= bound, f"logits: {_rel(logits, want_logits):.3e} > {bound:.3e}"
    assert g.keys() == want_g.keys()
    for name, want in want_g.items():
        bound = 3 * _rel(bf16_g[name], want) + 1e-2
        err = _rel(g[name], want)
        assert err <= bound, f"grad {name}: relative error {err:.3e} > {bound:.3e}"


def test_left_padding_raises_on_gpu() -> None:
    docs = documents(LENGTHS[:3])
    model = make_model("llama", "thd", dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ThdValueError, match="padding_side='right'"):
        model(**right_padded_batch(docs, left=True, device=DEVICE), use_cache=False)


@pytest.mark.parametrize(
    "features", [{}, {"sliding_window": 100, "softcap": 30.0}], ids=["plain", "window_softcap"]
)
@pytest.mark.parametrize("form", ["cu_seq_lens", "right_padded"])
def test_no_host_sync_with_known_lengths(form: str, features: dict[str, Any]) -> None:
    """Packed with max_length_* given, and right-padded: no device-to-host sync per layer, also
    with a Gemma 2 layer's sliding window and softcap."""
    fn = make_attention_function()
    g = torch.Generator(device=DEVICE).manual_seed(0)
    shape = (1, 8, 1024) if form == "cu_seq_lens" else (4, 8, 256)
    q, k, v = (
        torch.randn(
            shape[0], h, shape[2], 64, generator=g, device=DEVICE, dtype=torch.bfloat16
        ).requires_grad_()
        for h in (8, 2, 2)
    )
    module = torch.nn.Module()
    if form == "cu_seq_lens":
        cu = torch.tensor([0, 100, 612, 1024], dtype=torch.int32, device=DEVICE)
        kwargs: dict[str, Any] = {
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": 512,
            "max_length_k": 512,
        }
        mask = None
    else:
        kwargs = {}
        mask = torch.arange(256, device=DEVICE)[None, :] < torch.tensor(
            [[256], [17], [1], [200]], device=DEVICE
        )
    kwargs |= features
    fn(module, q, k, v, mask, **kwargs)[0].sum().backward()  # compile and autotune first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fn(module, q, k, v, mask, **kwargs)[0]
        out.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
