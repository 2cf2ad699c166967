"""Optional attention features (sliding window, logit softcap, sinks) and the ones thd refuses.

``thd.attention`` / ``thd.cp.ring_attention`` take ``window_size=(left, right)``,
``softcap=float`` and ``sinks=[Hq] logits`` keyword arguments; :func:`feature_kwargs` turns the
model's settings into them. Attention dropout and an additive position bias are refused
(:func:`check_unsupported`).

Sinks: transformers' ``s_aux`` (gpt-oss) adds ``exp(s_aux[h])`` to every softmax denominator
with no value row (``eager_attention_forward`` concatenates it to the scores), which is what
thd's ``sinks`` does. Softcap: scores become ``softcap * tanh(scores / softcap)`` in both.

Window convention. transformers' causal sliding mask (``masking_utils.sliding_window_overlay``
and ``causal_mask_function``, used by sdpa/eager) lets query ``i`` see key ``j`` iff
``i - sliding_window < j <= i``: the token itself and the ``sliding_window - 1`` before it.
In flash-attention's ``window_size=(left, right)`` convention (query ``i`` sees
``i - left <= j <= i + right``) that is ``(sliding_window - 1, 0)``. The bidirectional
overlay (``sliding_window_bidirectional_overlay``) allows ``|i - j| <= sliding_window``:
``(sliding_window, sliding_window)``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from thd.errors import ThdValueError

__all__ = ["check_unsupported", "feature_kwargs", "window_size"]


def window_size(sliding_window: int, causal: bool) -> tuple[int, int]:
    """transformers' ``sliding_window`` as ``(left, right)`` (see the module docstring)."""
    return (sliding_window - 1, 0) if causal else (sliding_window, sliding_window)


def feature_kwargs(
    *, sliding_window: int | None, softcap: float | None, sinks: Tensor | None, causal: bool
) -> dict[str, Any]:
    """Keyword arguments of ``thd.attention`` / ``thd.cp.ring_attention`` for the model's window,
    softcap and sinks (only those the model sets)."""
    extra: dict[str, Any] = {}
    if sliding_window is not None and sliding_window > 0:
        extra["window_size"] = window_size(int(sliding_window), causal)
    if softcap is not None and softcap != 0:
        extra["softcap"] = float(softcap)
    if sinks is not None:
        extra["sinks"] = sinks
    return extra


def check_unsupported(dropout: float, kwargs: dict[str, Any]) -> None:
    """Reject what thd does not implement: attention dropout and an additive position bias."""
    if dropout:
        raise ThdValueError(
            f"thd attention: attention dropout ({dropout}) is not supported; set config.attention_dropout=0.0"
        )
    if kwargs.get("position_bias") is not None:
        raise ThdValueError(
            "thd attention: an additive position bias (position_bias) is not supported; "
            "use attn_implementation='sdpa'"
        )
