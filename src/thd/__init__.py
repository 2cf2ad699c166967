"""thd-kernels: packed variable-length (THD) attention with context parallelism.

Public entry points:

- :func:`thd.attention` -- varlen attention (Triton on GPU, reference on CPU).
- :mod:`thd.layout` -- the cu_seqlens / cu_seqlens_padded layout contract.
- :mod:`thd.padding` -- padding detection, row masks and zeroing.
- :mod:`thd.cp` -- context-parallel partitioning and ring attention.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, packages_distributions
from importlib.metadata import version as _dist_version

from thd.errors import ThdDistributedError, ThdError, ThdTypeError, ThdValueError


def _installed_version() -> str:
    """Version of the distribution that installed ``thd`` (core wheel or a flavor)."""
    for name in [*packages_distributions().get("thd", []), "thd-kernels"]:
        try:
            return _dist_version(name)
        except PackageNotFoundError:
            continue
    return "0+unknown"  # running from a source tree that is not installed


__version__: str = _installed_version()

__all__ = [
    "ThdDistributedError",
    "ThdError",
    "ThdTypeError",
    "ThdValueError",
    "__version__",
    "attention",
]


_SUBMODULES = ("cp", "layout", "ops", "padding", "reference")


def __getattr__(name: str) -> object:
    # Imported lazily so that `import thd` stays cheap (no torch, no Triton) until used.
    if name == "attention":
        from thd.ops.attention.interface import attention

        return attention
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"thd.{name}")
    raise AttributeError(f"module 'thd' has no attribute {name!r}")
