"""Plain-torch oracles, re-exported: ``thd.reference.attention`` mirrors ``thd.attention``."""

from __future__ import annotations

from thd.ops.attention.reference import attention

__all__ = ["attention"]
