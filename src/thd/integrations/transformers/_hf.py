"""Lazy import of Hugging Face ``transformers`` with a clear error when it is missing."""

from __future__ import annotations

from types import ModuleType

from thd.errors import ThdError

__all__ = ["require_transformers"]

_INSTALL = "pip install 'thd-kernels[transformers]' (transformers>=5.17,<5.19)"


def require_transformers() -> ModuleType:
    """The ``transformers`` module; :class:`ThdError` if it is not installed or older than 5."""
    try:
        import transformers
    except ImportError as exc:
        raise ThdError(f"thd.integrations.transformers needs the transformers package: {_INSTALL}") from exc
    major = transformers.__version__.split(".", 1)[0]
    if not major.isdigit() or int(major) < 5:
        raise ThdError(
            f"thd.integrations.transformers needs transformers 5 (AttentionInterface, masking_utils), "
            f"found {transformers.__version__}: {_INSTALL}"
        )
    return transformers
