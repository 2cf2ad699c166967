"""Log-sum-exp merge of partial attention results (used by the context-parallel ring)."""

from thd.ops.lse_merge.interface import merge_partials

__all__ = ["merge_partials"]
