"""Registration of the ``thd`` attention and mask functions with transformers."""

from __future__ import annotations

import torch.distributed as dist

from thd.integrations.transformers._hf import require_transformers
from thd.integrations.transformers.attention import make_attention_function
from thd.integrations.transformers.mask import padding_mask

__all__ = ["register"]


def register(name: str = "thd", group: dist.ProcessGroup | None = None) -> str:
    """Register ``name`` with ``transformers.AttentionInterface`` and ``AttentionMaskInterface``.

    Afterwards ``AutoModelForCausalLM.from_config(config, attn_implementation=name)`` (or
    ``from_pretrained``) runs every layer that uses the attention interface through thd:
    packed batches (``cu_seq_lens_*`` kwargs or ``position_ids``), right-padded batches (2-D
    ``attention_mask``) and plain ones. With ``group`` the function runs ring attention over
    that context-parallel group and every forward needs the inputs of :func:`shard_batch`
    (either mode: a ``mode="documents"`` shard runs :func:`thd.cp.document_attention`).
    Registering a name again replaces its functions. Returns ``name``.
    """
    transformers = require_transformers()
    from transformers.masking_utils import AttentionMaskInterface

    transformers.AttentionInterface.register(name, make_attention_function(group))
    AttentionMaskInterface.register(name, padding_mask)
    return name
