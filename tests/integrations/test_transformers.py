"""``attn_implementation="thd"`` on tiny random-weight models (CPU, fp32) against per-document
sdpa (eager for Gemma 2).

Each family runs the same documents packed (``cu_seq_lens_*`` kwargs of
``DataCollatorWithFlattening``, or ``position_ids`` alone) and right-padded (2-D
``attention_mask``), and must give the logits and parameter gradients of the same weights run
one document at a time with ``attn_implementation=ORACLE[family]`` (``"sdpa"``; ``"eager"``
for Gemma 2, whose sliding-window layers and attention-logit softcap thd must reproduce).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import Tensor

import thd
from tests._helpers import assert_close
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
from thd.errors import ThdError, ThdValueError
from thd.integrations.transformers import attention as attention_mod
from thd.integrations.transformers import features, layout, shard_batch
from thd.integrations.transformers.mask import padding_mask

pytestmark = pytest.mark.usefixtures("reference_backend")

LENGTHS = (5, 17, 1, 9, 12)  # includes a one-token document
OUT_TOL = {"atol": 1e-5, "rtol": 1e-4}
GRAD_TOL = {"atol": 2e-5, "rtol": 2e-4}


def _oracle(family: str, docs: list[Tensor], **overrides: Any) -> tuple[list[Tensor], dict[str, Tensor]]:
    model = make_model(family, ORACLE[family], **overrides)
    logits = per_document_logits(model, docs)
    next_token_loss(logits, docs).backward()
    return [x.detach() for x in logits], grads(model)


def _run_thd(family: str, docs: list[Tensor], form: str, **overrides: Any):  # type: ignore[no-untyped-def]
    model = make_model(family, "thd", **overrides)
    if form == "right_padded":
        logits = split_padded(model(**right_padded_batch(docs), use_cache=False).logits, docs)
    else:
        batch = packed_batch(docs, flash_kwargs=form == "cu_seq_lens")
        batch.pop("labels")
        logits = split_packed(model(**batch, use_cache=False).logits, docs)
    next_token_loss(logits, docs).backward()
    return [x.detach() for x in logits], grads(model)


def _assert_same(
    got: tuple[list[Tensor], dict[str, Tensor]], want: tuple[list[Tensor], dict[str, Tensor]]
) -> None:
    for i, (a, b) in enumerate(zip(got[0], want[0], strict=True)):
        assert_close(a, b, f"logits of document {i}", **OUT_TOL)
    assert got[1].keys() == want[1].keys()
    for name, g in want[1].items():
        assert_close(got[1][name], g, f"grad {name}", **GRAD_TOL)


@pytest.mark.parametrize("form", ["cu_seq_lens", "position_ids", "right_padded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_per_document_oracle(family: str, form: str) -> None:
    docs = documents(LENGTHS)
    _assert_same(_run_thd(family, docs, form), _oracle(family, docs))


@pytest.mark.property
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    family=st.sampled_from(FAMILIES),
    form=st.sampled_from(["cu_seq_lens", "position_ids", "right_padded"]),
    seed=st.integers(0, 5),
)
def test_random_documents_match_per_document_oracle(
    lengths: list[int], family: str, form: str, seed: int
) -> None:
    """Any number and lengths of documents (one-token ones, documents longer than Gemma 2's window)."""
    assume(max(lengths) > 1)  # one-token documents alone have no next-token loss
    docs = documents(lengths, seed=seed)
    _assert_same(_run_thd(family, docs, form), _oracle(family, docs))


def test_gemma2_config_exercises_window_and_softcap() -> None:
    """The Gemma 2 oracle changes without its window or without its softcap: both bite on LENGTHS."""
    docs = documents(LENGTHS)
    want = _oracle("gemma2", docs)
    for what, override in (
        ("window", {"sliding_window": 4096}),
        ("softcap", {"attn_logit_softcapping": None}),
    ):
        got = _oracle("gemma2", docs, **override)
        diff = max(float((a - b).abs().max()) for a, b in zip(got[0], want[0], strict=True))
        assert diff > 0.1, f"the {what} changes the logits by only {diff:.2e}"


def test_model_loss_with_collator_labels_matches_per_document_mean() -> None:
    docs = documents(LENGTHS, seed=3)
    batch = packed_batch(docs, flash_kwargs=True)
    loss = make_model("llama", "thd")(**batch, use_cache=False).loss
    want = next_token_loss(per_document_logits(make_model("llama", "sdpa"), docs), docs)
    assert_close(loss, want / sum(len(d) - 1 for d in docs), "loss", **OUT_TOL)


def test_left_padding_raises_a_clear_error() -> None:
    docs = documents(LENGTHS)
    model = make_model("llama", "thd")
    with pytest.raises(ThdValueError, match="padding_side='right'"):
        model(**right_padded_batch(docs, left=True), use_cache=False)


def test_mask_function_returns_the_2d_mask_or_none() -> None:
    full = torch.ones(2, 6, dtype=torch.bool)
    assert padding_mask(2, 6, 6, attention_mask=None) is None
    assert padding_mask(2, 6, 6, attention_mask=full) is None
    right = full.clone()
    right[1, 4:] = False
    assert torch.equal(padding_mask(2, 6, 6, attention_mask=right), right)
    holes = full.clone()
    holes[0, 2] = False  # a hole is not right padding either
    with pytest.raises(ThdValueError, match="right"):
        padding_mask(2, 6, 6, attention_mask=holes)


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_generation_with_a_kv_cache_matches_the_oracle(family: str) -> None:
    """Prefill + decode steps (query shorter than the keys: bottom-right causal alignment); for
    Gemma 2 the prompt is longer than the window, whose cache layer keeps only the last
    ``sliding_window - 1`` keys."""
    prompt = documents([13], seed=5)[0][None]
    out = {}
    for impl in ("thd", ORACLE[family]):
        model = make_model(family, impl).eval()
        with torch.no_grad():
            out[impl] = model.generate(prompt, max_new_tokens=4, do_sample=False, output_logits=True,
                                       return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(out["thd"].sequences, out[ORACLE[family]].sequences)
    for i, (a, b) in enumerate(zip(out["thd"].logits, out[ORACLE[family]].logits, strict=True)):
        assert_close(a, b, f"step {i} logits", **OUT_TOL)


# ----------------------------------------------------------------------------- layouts, no host reads


@pytest.mark.usefixtures("no_host_reads")
def test_layouts_with_known_lengths_read_no_device_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    padded = layout.resolve_layout(mask, 2, 4, 4, mask.device, {})
    packed = layout.resolve_layout(None, 1, 9, 9, mask.device, {"cu_seq_lens_q": cu, "max_length_q": 5})
    monkeypatch.undo()  # host reads allowed again for the checks
    assert (padded.max_seqlen_q, packed.max_seqlen_q, packed.max_seqlen_kv) == (4, 5, 5)
    torch.testing.assert_close(
        padded.cu_seqlens_q, torch.tensor([0, 3, 5], dtype=torch.int32), rtol=0, atol=0
    )
    torch.testing.assert_close(
        padded.cu_seqlens_q_padded, torch.tensor([0, 4, 8], dtype=torch.int32), rtol=0, atol=0
    )


def test_position_ids_layout_is_built_once_per_tensor() -> None:
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    first = layout.resolve_layout(None, 1, 9, 9, pos.device, {"position_ids": pos})
    assert first.cu_seqlens_q.tolist() == [0, 3, 5, 9] and first.max_seqlen_q == 4
    assert layout.resolve_layout(None, 1, 9, 9, pos.device, {"position_ids": pos}) is first
    pos.add_(0)  # an in-place change bumps the version: rebuilt
    assert layout.resolve_layout(None, 1, 9, 9, pos.device, {"position_ids": pos}) is not first


def test_packed_kwargs_need_batch_size_one() -> None:
    with pytest.raises(ThdValueError, match="batch size 1"):
        layout.resolve_layout(None, 2, 4, 4, torch.device("cpu"), {"cu_seq_lens_q": torch.tensor([0, 4])})


# ----------------------------------------------------------------------------- window, softcap, sinks


def _attn_call(fn: Callable[..., Any], **kw: Any) -> Tensor:
    """The registered function on one packed batch of two documents (5 and 11 tokens)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, 16, 32, generator=g) for h in (4, 2, 2))
    module = torch.nn.Module()
    module.is_causal = True  # type: ignore[assignment]
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    out, weights = fn(module, q, k, v, None, scaling=0.2, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                      max_length_q=11, max_length_k=11, **kw)  # fmt: skip
    assert weights is None and out.shape == (1, 16, 4, 32)
    return out


def _dense_reference(
    softcap: float | None = None, window: int | None = None, sinks: Tensor | None = None
) -> Tensor:
    """eager-style attention per document: the transformers semantics of softcap, sliding window, s_aux."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, 16, 32, generator=g) for h in (4, 2, 2))
    k, v = (t.repeat_interleave(2, dim=1) for t in (k, v))
    out = torch.zeros(1, 16, 4, 32)
    for a, b in ((0, 5), (5, 16)):
        s = q[0, :, a:b] @ k[0, :, a:b].transpose(-1, -2) * 0.2
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(b - a)
        allowed = i[None, :] <= i[:, None]
        if window is not None:
            allowed &= i[None, :] > i[:, None] - window  # masking_utils.sliding_window_overlay
        s = s.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            s = torch.cat((s, sinks.view(-1, 1, 1).expand(-1, b - a, 1)), dim=-1)
        p = torch.softmax(s, dim=-1)[..., : b - a]
        out[0, a:b] = (p @ v[0, :, a:b]).transpose(0, 1)
    return out


@pytest.mark.parametrize(
    ("feature", "kwargs", "ref"),
    [
        ("softcap", {"softcap": 3.0}, {"softcap": 3.0}),
        ("window_size", {"sliding_window": 4}, {"window": 4}),
        (
            "sinks",
            {"s_aux": torch.tensor([0.5, -1.0, 2.0, 0.0])},
            {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])},
        ),
    ],
)
def test_feature_is_passed_through(feature: str, kwargs: dict[str, Any], ref: dict[str, Any]) -> None:
    """The model's softcap, window and sinks reach thd.attention as its keyword arguments."""
    fn = attention_mod.make_attention_function()
    assert_close(_attn_call(fn, **kwargs), _dense_reference(**ref), feature, **OUT_TOL)


def test_window_that_covers_every_document_is_a_no_op() -> None:
    """A window longer than every document (Mistral's default 4096 tokens) changes nothing."""
    fn = attention_mod.make_attention_function()
    assert_close(_attn_call(fn, sliding_window=11), _dense_reference(), "window 11", **OUT_TOL)


def test_window_convention_matches_transformers_sliding_mask() -> None:
    """(sliding_window - 1, 0), checked against sdpa's sliding mask through thd.attention."""
    docs = documents([13, 6, 20], seed=2)
    _assert_same(
        _run_thd("mistral", docs, "cu_seq_lens", sliding_window=5),
        _oracle("mistral", docs, sliding_window=5),
    )
    assert features.window_size(5, causal=True) == (4, 0)


def test_triton_interpreter_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registered function through the Triton kernels (interpreter on CPU): packed and padded."""
    if torch.cuda.is_available():
        pytest.skip("the GPU tests run the kernels themselves")
    fn = attention_mod.make_attention_function()
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, 8, 32, generator=g) for h in (2, 1, 1))
    mask = torch.tensor([[True] * 8, [True] * 3 + [False] * 5])
    module = torch.nn.Module()
    monkeypatch.setenv("THD_ATTENTION_BACKEND", "reference")
    want_padded = fn(module, q, k, v, mask)[0]
    want_packed = _attn_call(fn)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("THD_ATTENTION_BACKEND")
    got_padded = fn(module, q, k, v, mask)[0]
    assert_close(got_padded[1, :3], want_padded[1, :3], "padded row 1", **OUT_TOL)
    assert_close(got_padded[0], want_padded[0], "padded row 0", **OUT_TOL)
    assert_close(_attn_call(fn), want_packed, "packed", **OUT_TOL)


def test_dropout_is_refused() -> None:
    with pytest.raises(ThdValueError, match="attention_dropout"):
        _attn_call(attention_mod.make_attention_function(), dropout=0.1)


# ----------------------------------------------------------------------------- CP sharding (one process)


def test_shard_batch_pads_shifts_and_partitions() -> None:
    docs = documents([5, 1, 8], seed=4)
    batch = packed_batch(docs, flash_kwargs=False)  # position_ids give the boundaries
    shards = [shard_batch(batch, cp_size=2, cp_rank=r) for r in range(2)]
    cp_layout = shards[0]["thd_cp_layout"]
    assert cp_layout.cu_seqlens.tolist() == [0, 5, 6, 14]
    assert cp_layout.cu_seqlens_padded.tolist() == [0, 8, 12, 20]
    assert (cp_layout.max_seqlen, cp_layout.pad_between_seqs, cp_layout.num_label_tokens) == (8, True, 11)
    full = {
        key: thd.cp.unpartition([s[key][0] for s in shards], cp_layout.cu_seqlens_padded, 2)
        for key in ("input_ids", "position_ids", "shift_labels")
    }
    ids = torch.cat(docs)
    for start, slot, d in zip((0, 8, 12), (8, 4, 8), docs, strict=True):
        n = d.numel()
        assert torch.equal(full["input_ids"][start : start + n], d)
        assert full["position_ids"][start : start + slot].tolist() == list(range(slot))
        want = [*d[1:].tolist(), -100] + [-100] * (slot - n)
        assert full["shift_labels"][start : start + slot].tolist() == want
    assert int(shards[0]["num_items_in_batch"]) == ids.numel() - len(docs)
    assert shards[0]["labels"] is shards[0]["shift_labels"] and shards[0]["use_cache"] is False


def test_shard_batch_rejects_padding_and_needs_a_group() -> None:
    batch = {"input_ids": torch.ones(1, 4, dtype=torch.long), "attention_mask": torch.tensor([[1, 1, 1, 0]])}
    with pytest.raises(ThdValueError, match="without padding"):
        shard_batch(batch, cp_size=2, cp_rank=0)
    with pytest.raises(thd.ThdDistributedError, match="not initialized"):
        shard_batch({"input_ids": torch.ones(1, 4, dtype=torch.long)})


def test_cp_function_needs_the_sharded_layout() -> None:
    fn = attention_mod.make_attention_function(group=object())  # type: ignore[arg-type]
    with pytest.raises(ThdValueError, match="shard_batch"):
        _attn_call(fn)


# ----------------------------------------------------------------------------- imports


def test_import_thd_does_not_import_transformers() -> None:
    code = (
        "import sys, thd, thd.integrations.transformers as t\n"
        "assert 'transformers' not in sys.modules, 'transformers imported'\n"
        "t.register\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_missing_transformers_is_a_clear_thd_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from thd.integrations.transformers import register

    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ThdError, match=r"thd-kernels\[transformers\]"):
        register()
