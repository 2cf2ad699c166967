"""Hugging Face transformers integration: ``attn_implementation="thd"``.

Install with ``pip install 'thd-kernels[transformers]'``; transformers is imported only by
:func:`register`, so importing this package never needs it. Usage (``docs/transformers.md``)::

    from thd.integrations.transformers import register
    register()  # "thd" for AttentionInterface and AttentionMaskInterface
    model = AutoModelForCausalLM.from_config(config, attn_implementation="thd")

Context parallelism: ``register(group=cp_group)`` and ``model(**shard_batch(batch, cp_group))``
(``shard_batch(..., mode="documents")``: document-aware, short documents stay on one rank).
"""

from thd.integrations.transformers.cp import LAYOUT_KWARG, CPLayout, DocumentCPLayout, shard_batch
from thd.integrations.transformers.register import register

__all__ = ["LAYOUT_KWARG", "CPLayout", "DocumentCPLayout", "register", "shard_batch"]
