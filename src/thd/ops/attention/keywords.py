"""The keyword arguments the attention entry points share, typed once (PEP 692 ``Unpack``).

:func:`thd.attention` and :func:`thd.reference.attention` take ``**kw:
Unpack[AttentionArgs]`` (the reference adds the positions); :func:`thd.cp.ring_attention`,
:func:`thd.cp.document_attention` and :func:`thd.cp.reference.simulate_ring_attention` take
``**scores: Unpack[ScoreArgs]``. Each entry point's docstring gives the meaning and default of
every keyword; :func:`score_options` and :func:`reference_options` are the one place where the score
keywords become :class:`AttentionOptions` (checked, and as given for the torch references).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TypedDict

from torch import Tensor

from thd.errors import ThdTypeError
from thd.ops.attention.arguments import resolve_options
from thd.ops.attention.params import AttentionOptions

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # typing_extensions comes with torch
    from typing_extensions import Unpack

__all__ = [
    "ATTENTION_ARGS",
    "SCORE_ARGS",
    "AttentionArgs",
    "ScoreArgs",
    "Unpack",
    "check_keywords",
    "reference_options",
    "score_options",
]


class ScoreArgs(TypedDict, total=False):
    """What each score is and which keys a query sees: every attention entry point takes these."""

    causal: bool
    """Bottom-right aligned causal mask (default False for :func:`thd.attention`, True for the
    self-attention of :mod:`thd.cp`)."""
    softmax_scale: float | None
    """Scale of ``q.k``; default ``D ** -0.5``."""
    window_size: tuple[int, int]
    """``(left, right)`` sliding window, ``-1`` unbounded; default ``(-1, -1)``."""
    softcap: float
    """When > 0, scores are ``softcap * tanh(q.k * scale / softcap)``; default 0.0."""
    sinks: Tensor | None
    """``[Hq]`` sink logits added to every real row's softmax denominator; default None."""


class AttentionArgs(ScoreArgs, total=False):
    """The keywords of :func:`thd.attention` (and :func:`thd.reference.attention`)."""

    cu_seqlens_q_padded: Tensor | None
    """int32 ``[B+1]`` query slot offsets; default None (the slots are the sequences)."""
    cu_seqlens_kv_padded: Tensor | None
    """The same for keys/values."""
    max_seqlen_q: int | None
    """Largest real query length; default None (read from the device)."""
    max_seqlen_kv: int | None
    """Largest real key length; default None (read from the device)."""
    return_lse: bool
    """Also return the log-sum-exp of the scores; default False."""
    deterministic: bool
    """The backward without atomics; default False."""


SCORE_ARGS = frozenset(ScoreArgs.__optional_keys__)
ATTENTION_ARGS = frozenset(AttentionArgs.__optional_keys__)


def check_keywords(fn: str, keywords: Mapping[str, object], allowed: frozenset[str]) -> None:
    """Refuse a keyword ``fn`` does not take (a :class:`ThdTypeError`, so a ``TypeError`` too)."""
    if allowed.issuperset(keywords):
        return
    for name in keywords:
        if name not in allowed:
            raise ThdTypeError(
                f"{fn}: {name}: unexpected keyword argument; expected one of {', '.join(sorted(allowed))}"
            )


def score_options(
    fn: str, q: Tensor, scores: ScoreArgs, *, causal: bool, deterministic: object = False
) -> AttentionOptions:
    """Checked :class:`AttentionOptions` of ``scores`` (``causal``: the entry point's default),
    every failure a ``ThdError`` naming ``fn``; the scale defaults to ``D ** -0.5``."""
    return resolve_options(
        fn,
        q,
        scores.get("causal", causal),
        scores.get("softmax_scale"),
        scores.get("window_size", (-1, -1)),
        scores.get("softcap", 0.0),
        deterministic,
    )


def reference_options(q: Tensor, scores: ScoreArgs, *, causal: bool) -> AttentionOptions:
    """:class:`AttentionOptions` of ``scores`` as given (no checks: the torch references take any
    head dim and dtype); the scale defaults to ``D ** -0.5``."""
    scale = scores.get("softmax_scale")
    return AttentionOptions(
        softmax_scale=float(q.shape[-1] ** -0.5 if scale is None else scale),
        causal=scores.get("causal", causal),
        window_size=tuple(scores.get("window_size", (-1, -1))),  # type: ignore[arg-type]
        softcap=float(scores.get("softcap", 0.0)),
    )
