"""The attention benchmark's inputs and the attention calls it times (one factory per provider).

Every provider is fed the same THD tensors ``[T, H, D]`` (bf16) and int32 offsets:

- ``thd-tl``, ``thd-gluon``: ``thd.attention(..., causal=True)`` with ``max_seqlen`` given, run
  with ``THD_KERNELS=tl`` / ``gluon`` (one kernel family each; a family this thd does not have
  is ``unavailable``); ``thd``: whatever family thd picks itself. Padded slots through
  ``cu_seqlens_*_padded``. Each record says which family ran (``kernel_family``);
- ``fa4``: FlashAttention-4 (``flash_attn.cute.flash_attn_varlen_func``, CuTe DSL); padded slots
  as ``cu_seqlens_* = slot offsets`` plus ``seqused_* = real lengths``;
- ``cudnn``: cuDNN's attention through cudnn-frontend (``cudnn.sdpa.fwd.torch_op.sdpa``), packed
  layouts only;
- ``varlen_attn``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2; causal is
  ``window_size=(-1, 0)``), packed layouts only;
- ``flex``: compiled ``flex_attention`` on the ``[1, H, T, D]`` view with a document-causal
  ``BlockMask`` built once per shape, outside the timed region; packed layouts only.

A provider that is not installed, or does not offer what a shape needs, raises ``ImportError`` or
:class:`Unsupported` from its factory: the benchmark records it as ``unavailable``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
from _common import document_lengths, error_text, offsets, offsets_tensor, package_version
from torch import Tensor

__all__ = [
    "FACTORIES",
    "MIXES",
    "ONE_DOCUMENT",
    "PADDED_PROVIDERS",
    "PEERS",
    "PROVIDERS",
    "THD_FAMILIES",
    "VARIANT_PROVIDERS",
    "Attn",
    "LayoutSpec",
    "Problem",
    "Provider",
    "Unsupported",
    "Variant",
    "is_thd",
    "kernel_family_ran",
    "make_problem",
    "peer_versions",
]

Attn = Callable[[Tensor, Tensor, Tensor], Tensor]

MIXES: dict[str, tuple[int, int]] = {
    "64-1024": (64, 1024),
    "256-4096": (256, 4096),
    "512-8192": (512, 8192),
    "25000-40000": (25000, 40000),  # with 65536 tokens: two or three long documents
}
ONE_DOCUMENT = "one-document"  # the "mix" of a variant run on a single document
THD_FAMILIES = {"thd-tl": "tl", "thd-gluon": "gluon"}  # provider -> THD_KERNELS
PEERS = ("fa4", "cudnn", "varlen_attn", "flex")
PROVIDERS = (*THD_FAMILIES, "thd", *PEERS)
PADDED_PROVIDERS = (
    *THD_FAMILIES,
    "thd",
    "fa4",
)  # the peers without a padded-slot interface are not run there
VARIANT_PROVIDERS = (*THD_FAMILIES, "thd", "fa4")


def is_thd(provider: str) -> bool:
    """``thd`` or one of its kernel families (``thd-tl``, ``thd-gluon``)."""
    return provider == "thd" or provider.startswith("thd-")


class Unsupported(Exception):
    """This provider does not offer what the shape needs: recorded as ``unavailable``."""


@dataclass(frozen=True)
class Provider:
    """A prepared call and the ``THD_*`` settings it runs under (set around its measurements)."""

    call: Attn
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LayoutSpec:
    tokens: int
    mix: str
    slot: int = 1

    @classmethod
    def parse(cls, text: str) -> LayoutSpec:
        """``TOKENS:MIX[:SLOT]``; ``SLOT > 1`` rounds every document's slot up to a multiple of SLOT rows."""
        import argparse

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

    def seed(self, base: int) -> int:
        """The seed ``bench_attention.py`` makes this layout's problem with (``base`` + the mix's
        index): every mix its own documents, the same in every run."""
        return base + list(MIXES).index(self.mix)


@dataclass(frozen=True)
class Variant:
    """Options beyond causal masking; every provider gets the same ones."""

    name: str = "causal"
    window_left: int | None = None
    softcap: float = 0.0
    sinks: bool = False
    one_document: bool = False

    def window_softcap_kwargs(self) -> dict[str, Any]:
        """``window_size`` and ``softcap`` as thd and FA4 both spell them (those this variant sets)."""
        kwargs: dict[str, Any] = {}
        if self.window_left is not None:
            kwargs["window_size"] = (self.window_left, 0)
        if self.softcap:
            kwargs["softcap"] = self.softcap
        return kwargs


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
    real = torch.zeros(rows, dtype=torch.bool)
    for start, n in zip(offsets(slots), lengths, strict=False):
        real[start : start + n] = True
    sinks = None
    if variant.sinks:
        sinks = torch.randn(heads, device=device, generator=gen).to(torch.bfloat16).float()
    return Problem(
        spec=spec, lengths=lengths, heads=heads, head_dim=head_dim, q=q, k=k, v=v, do=do,
        cu=offsets_tensor(lengths, device), cu_slots=offsets_tensor(slots, device),
        seqused=torch.tensor(lengths, dtype=torch.int32, device=device),
        real_rows=real.to(device), variant=variant, sinks=sinks,
    )  # fmt: skip


# ----------------------------------------------------------------------------- thd


def kernel_family_ran(phase: str = "forward") -> str | None:
    """The implementation that ran thd's latest attention call of ``phase`` (``tl``, ``gluon`` or
    ``reference``), where this thd reports it (``thd.ops.attention.dispatch.kernel_choice``)."""
    try:
        from thd.ops.attention.dispatch import kernel_choice  # type: ignore[import-not-found]
    except ImportError:
        return None
    choice = kernel_choice(phase)
    return None if choice is None else str(choice.family)


def _family_missing(family: str) -> str | None:
    """Why this thd cannot run kernel family ``family`` (None: it can be asked for)."""
    try:
        from thd.ops.attention.dispatch import FAMILIES  # type: ignore[import-not-found]
    except ImportError:
        return None if family == "tl" else "this thd has one kernel family (tl): no THD_KERNELS selection"
    if FAMILIES.family(family) is None:
        return f"the {family} kernel family is not available: {FAMILIES.why_missing(family) or 'absent'}"
    return None


def _thd_call(p: Problem) -> Attn:
    import thd

    kwargs: dict[str, Any] = {"max_seqlen_q": p.max_len, "max_seqlen_kv": p.max_len, "causal": True}
    if p.padded:
        kwargs.update(cu_seqlens_q_padded=p.cu_slots, cu_seqlens_kv_padded=p.cu_slots)
    kwargs.update(p.variant.window_softcap_kwargs())
    if p.variant.sinks:
        kwargs["sinks"] = p.sinks

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = thd.attention(q, k, v, p.cu, p.cu, **kwargs)
        assert isinstance(out, Tensor)
        return out

    return call


def thd_provider(p: Problem) -> Provider:
    """thd with the kernel family it picks itself."""
    return Provider(_thd_call(p))


def _family_provider(family: str) -> Callable[[Problem], Provider]:
    def factory(p: Problem) -> Provider:
        missing = _family_missing(family)
        if missing is not None:
            raise Unsupported(missing)
        return Provider(_thd_call(p), {"THD_KERNELS": family})

    factory.__doc__ = f"thd with ``THD_KERNELS={family}``."
    return factory


# ----------------------------------------------------------------------------- peers


@cache
def _fa4_varlen() -> Callable[..., Any]:
    from flash_attn.cute import flash_attn_varlen_func

    return flash_attn_varlen_func


def fa4_provider(p: Problem) -> Provider:
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
    kwargs.update(p.variant.window_softcap_kwargs())
    if p.variant.sinks:
        assert p.sinks is not None
        kwargs["learnable_sink"] = p.sinks.to(torch.bfloat16)  # FA4 takes bf16 sinks

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        result = fa4(q, k, v, **kwargs)
        return result[0] if isinstance(result, tuple) else result

    return Provider(call)


@cache
def _cudnn_sdpa() -> Callable[..., Any]:
    from cudnn.sdpa.fwd.torch_op import sdpa

    return sdpa


def cudnn_provider(p: Problem) -> Provider:
    if p.padded or p.variant.name != "causal":
        raise Unsupported("cudnn: packed causal layouts only in this benchmark")
    try:
        sdpa = _cudnn_sdpa()
    except Exception as exc:  # cudnn-frontend not installed, or cuDNN does not load
        raise ImportError(f"cudnn.sdpa: {error_text(exc)}") from exc
    kwargs = {
        "cu_seqlens_q": p.cu,
        "cu_seqlens_kv": p.cu,
        "max_seqlen_q": p.max_len,
        "max_seqlen_kv": p.max_len,
    }

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return sdpa(q, k, v, is_causal=True, return_lse=True, **kwargs)[0]  # type: ignore[no-any-return]

    return Provider(call)


def varlen_provider(p: Problem) -> Provider:
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

    return Provider(call)


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


def flex_provider(p: Problem) -> Provider:
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

    return Provider(call)


FACTORIES: dict[str, Callable[[Problem], Provider]] = {
    **{name: _family_provider(family) for name, family in THD_FAMILIES.items()},
    "thd": thd_provider,
    "fa4": fa4_provider,
    "cudnn": cudnn_provider,
    "varlen_attn": varlen_provider,
    "flex": flex_provider,
}


def _cudnn_backend() -> str | None:
    try:
        import cudnn

        return str(cudnn.backend_version())
    except Exception:
        return None


def peer_versions() -> dict[str, str | None]:
    """Versions of the optional peers (None: absent), for the run's environment record."""
    fa4 = package_version("flash-attn-4", "flash_attn_4", "flash-attn-cute")
    if fa4 is None:
        try:
            import flash_attn

            fa4 = getattr(flash_attn, "__version__", None)
        except Exception:
            fa4 = None
    return {
        "fa4": fa4,
        "cutlass_dsl": package_version("nvidia-cutlass-dsl"),
        "cudnn_frontend": package_version("nvidia-cudnn-frontend", "nvidia_cudnn_frontend"),
        "cudnn": _cudnn_backend(),
    }
