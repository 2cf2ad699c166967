"""Context parallelism: load-balanced THD partitioning and ring attention."""

from thd.cp.partition import (
    local_cu_seqlens_padded,
    partition,
    partition_indices,
    rank_cu_seqlens,
    unpartition,
)
from thd.cp.ring import ring_attention

__all__ = [
    "local_cu_seqlens_padded",
    "partition",
    "partition_indices",
    "rank_cu_seqlens",
    "ring_attention",
    "unpartition",
]
