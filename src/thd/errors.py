"""Exception hierarchy: every error raised by ``thd`` is a :class:`ThdError`."""

from __future__ import annotations

__all__ = ["ThdDistributedError", "ThdError", "ThdTypeError", "ThdValueError"]


class ThdError(Exception):
    """Base class of all errors raised by thd."""


class ThdValueError(ThdError, ValueError):
    """An argument has a bad value (shape, layout, length)."""


class ThdTypeError(ThdError, TypeError):
    """An argument has a bad dtype or type."""


class ThdDistributedError(ThdError, RuntimeError):
    """A process group is missing or does not match the layout."""
