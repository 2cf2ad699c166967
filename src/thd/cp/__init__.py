"""Context parallelism: load-balanced THD partitioning, ring attention, document-aware plans."""

from thd.cp.document_attention import document_attention
from thd.cp.document_partition import (
    DocumentLayout,
    document_layout,
    partition_documents,
    unpartition_documents,
)
from thd.cp.documents import LLAMA_8B_COST, CostModel, DocumentPlan, plan_documents
from thd.cp.partition import (
    local_cu_seqlens_padded,
    partition,
    partition_indices,
    rank_cu_seqlens,
    unpartition,
)
from thd.cp.ring import ring_attention

__all__ = [
    "LLAMA_8B_COST",
    "CostModel",
    "DocumentLayout",
    "DocumentPlan",
    "document_attention",
    "document_layout",
    "local_cu_seqlens_padded",
    "partition",
    "partition_documents",
    "partition_indices",
    "plan_documents",
    "rank_cu_seqlens",
    "ring_attention",
    "unpartition",
    "unpartition_documents",
]
