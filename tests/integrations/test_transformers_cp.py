"""Context-parallel training step through transformers: 2 spawned ranks against one process.

A packed batch goes through :func:`thd.integrations.transformers.shard_batch` and a model
registered with the CP group (ring attention); the all-reduced loss and parameter gradients
and the reassembled logits must equal the single-process packed step on the whole batch.
"""

from __future__ import annotations

import pytest

from tests.cp._dist import cuda_devices, spawn
from tests.integrations._cp_worker import cp_training_step

# Documents padded to multiples of 2*cp (exact per-rank counts) and already multiples (fast path).
LAYOUTS = ((5, 17, 1, 9, 12), (8, 12, 4))
# Gemma 2: ring attention with a sliding window (8 tokens) and the attention-logit softcap.
FAMILIES = ("llama", "qwen2", "gemma2")


@pytest.mark.distributed
def test_cp_step_matches_single_process_gloo() -> None:
    spawn(cp_training_step, 2, FAMILIES, LAYOUTS, "float32", timeout_s=300)


# Document-aware sharding: short documents whole on one rank, the long one (longer than a
# rank's share) split over the ring; labels shifted per document, num_items_in_batch global.
DOCUMENT_LAYOUTS = ((5, 17, 1, 9, 12, 60),)


@pytest.mark.distributed
def test_document_cp_step_matches_single_process_gloo() -> None:
    spawn(cp_training_step, 2, ("llama", "gemma2"), DOCUMENT_LAYOUTS, "float32", "documents", timeout_s=300)


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(cuda_devices() < 2, reason="needs 2 GPUs")
def test_cp_step_matches_single_process_nccl() -> None:
    layouts = (*LAYOUTS, (700, 1, 300, 2048, 63))
    spawn(cp_training_step, 2, FAMILIES, layouts, "bfloat16", backend="nccl", timeout_s=600)
