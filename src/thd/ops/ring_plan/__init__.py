"""Per-step count and offset tables of the context-parallel ring, in one launch."""

from thd.ops.ring_plan.interface import ring_plan_tables

__all__ = ["ring_plan_tables"]
