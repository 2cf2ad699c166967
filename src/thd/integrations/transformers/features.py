"""Optional attention features (sliding window, logit softcap, sinks) and the ones thd refuses.

``thd.attention`` / ``thd.cp.ring_attention`` take ``window_size=(left, right)``,
``softcap=float`` and ``sinks=[Hq] logits`` keyword arguments from the release that adds them;
which ones the installed function accepts is read once per function from its signature, and
they are passed only then. Otherwise a model that asks for one gets a :class:`ThdValueError`,
except for a window that cannot change anything (every sequence fits in it).

Sinks: transformers' ``s_aux`` (gpt-oss) adds ``exp(s_aux[h])`` to every softmax denominator
with no value row (``eager_attention_forward`` concatenates it to the scores), which is what
thd's ``sinks`` does. Softcap: scores become ``softcap * tanh(scores / softcap)`` in both.

Window convention. transformers' causal sliding mask (``masking_utils.sliding_window_overlay``
and ``causal_mask_function``, used by sdpa/eager) lets query ``i`` see key ``j`` iff
``i - sliding_window < j <= i``: the token itself and the ``sliding_window - 1`` before it.
In flash-attention's ``window_size=(left, right)`` convention (query ``i`` sees
``i - left <= j <= i + right``) that is ``(sliding_window - 1, 0)``. The bidirectional
overlay (``sliding_window_bidirectional_overlay``) allows ``|i - j| <= sliding_window``:
``(sliding_window, sliding_window)``. A causal window is a no-op iff no sequence is longer
than ``sliding_window``; a bidirectional one iff none is longer than ``sliding_window + 1``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from torch import Tensor

from thd.errors import ThdValueError

__all__ = ["accepted_kwargs", "check_unsupported", "feature_kwargs", "window_size"]


@functools.cache
def accepted_kwargs(fn: Callable[..., Any]) -> frozenset[str]:
    """Parameter names of ``fn`` (read once per function object)."""
    return frozenset(inspect.signature(fn).parameters)


def window_size(sliding_window: int, causal: bool) -> tuple[int, int]:
    """transformers' ``sliding_window`` as ``(left, right)`` (see the module docstring)."""
    return (sliding_window - 1, 0) if causal else (sliding_window, sliding_window)


def _window_is_noop(sliding_window: int, causal: bool, longest: int) -> bool:
    return longest <= (sliding_window if causal else sliding_window + 1)


def feature_kwargs(
    fn: Callable[..., Any],
    *,
    sliding_window: int | None,
    softcap: float | None,
    sinks: Tensor | None,
    causal: bool,
    longest: Callable[[], int],
) -> dict[str, Any]:
    """Extra keyword arguments of ``fn`` for the model's window, softcap and sinks.

    ``longest()`` returns the longest sequence (query or key) of the call; it is asked only
    when a window is set that ``fn`` cannot take, and may cost a host sync.
    """
    extra: dict[str, Any] = {}
    name = getattr(fn, "__qualname__", "thd.attention")
    if sliding_window is not None and sliding_window > 0:
        if "window_size" in accepted_kwargs(fn):
            extra["window_size"] = window_size(int(sliding_window), causal)
        elif not _window_is_noop(int(sliding_window), causal, longest()):
            raise ThdValueError(
                f"thd attention: sliding_window={sliding_window} is not supported yet by this thd "
                f"version ({name} has no window_size argument) and some sequence is longer than the "
                "window. Use a config with sliding_window=None, sequences no longer than the window, "
                "or attn_implementation='sdpa' / 'flash_attention_2' for this model."
            )
    if softcap is not None and softcap != 0:
        if "softcap" not in accepted_kwargs(fn):
            raise ThdValueError(
                f"thd attention: softcap={softcap} (attention logit soft-capping) is not supported yet by "
                f"this thd version ({name} has no softcap argument); use attn_implementation='sdpa' or "
                "'eager' for this model."
            )
        extra["softcap"] = float(softcap)
    if sinks is not None:
        if "sinks" not in accepted_kwargs(fn):
            raise ThdValueError(
                f"thd attention: attention sinks (s_aux) are not supported yet by this thd version "
                f"({name} has no sinks argument); use attn_implementation='sdpa' or 'eager' for this model."
            )
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
