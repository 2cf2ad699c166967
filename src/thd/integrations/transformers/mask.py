"""The mask function registered with ``transformers.masking_utils.AttentionMaskInterface``.

For ``thd`` the model never builds a dense 4-D mask: like transformers' ``flash_attention_mask``
this returns the 2-D padding mask (sliced to the key length) or ``None`` when nothing is
padded, and the attention function turns it into a THD layout. It also rejects left padding
here, once per forward, with a single host sync (the same read ``flash_attention_mask`` does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from thd.errors import ThdValueError

__all__ = ["LEFT_PADDING_MESSAGE", "padding_mask"]

LEFT_PADDING_MESSAGE = (
    "thd attention: the attention_mask is not right-padded (a padding token comes before a real "
    "token in some row). thd runs padded batches as slots whose real tokens come first: tokenize "
    "with padding_side='right' (tokenizer.padding_side = 'right'), or pack the documents with "
    "DataCollatorWithFlattening(return_flash_attn_kwargs=True)."
)


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., Any] | None = None,
    attention_mask: Tensor | None = None,
    **kwargs: Any,
) -> Tensor | None:
    """Bool ``[B, kv_length]`` padding mask, or ``None`` when there is no padding.

    Raises :class:`ThdValueError` for left padding (or any row whose real tokens are not a
    prefix). The mask pattern itself (causal, sliding window) is the attention function's job.
    """
    del batch_size, q_length, q_offset, kv_offset, mask_function, kwargs
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:].to(torch.bool)
    if torch.compiler.is_compiling():
        return mask  # no data-dependent checks inside a traced graph
    # One read answers both questions: "all real?" and "every row a prefix of real tokens?".
    all_real, right_padded = torch.stack((mask.all(), (mask[:, 1:] <= mask[:, :-1]).all())).tolist()
    if not right_padded:
        raise ThdValueError(LEFT_PADDING_MESSAGE)
    if all_real and mask.shape[-1] == kv_length:
        return None
    return mask
