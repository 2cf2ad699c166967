"""thd-kernels: packed variable-length (THD) attention with context parallelism.

Public entry points:

- :func:`thd.attention` -- varlen attention (Triton on GPU, reference on CPU).
- :func:`thd.flash_attn_varlen_func`, :func:`thd.flash_attn_func` -- FlashAttention 2 drop-ins.
- :mod:`thd.layout` -- the cu_seqlens / cu_seqlens_padded layout contract.
- :mod:`thd.padding` -- padding detection, row masks and zeroing.
- :mod:`thd.cp` -- context-parallel partitioning and ring attention.
"""

from __future__ import annotations

import functools

from thd.errors import ThdDistributedError, ThdError, ThdTypeError, ThdValueError


@functools.cache
def _installed_version() -> str:
    """Version of the distribution that installed ``thd``: the core wheel (or metapackage),
    else a flavor wheel such as ``thd-kernels-cu12``. Looked up on first access only: the
    fallback scans every installed distribution."""
    from importlib.metadata import PackageNotFoundError, packages_distributions
    from importlib.metadata import version as dist_version

    for name in ["thd-kernels", *packages_distributions().get("thd", [])]:
        try:
            return dist_version(name)
        except PackageNotFoundError:
            continue
    return "0+unknown"  # running from a source tree that is not installed


__all__ = [
    "ThdDistributedError",
    "ThdError",
    "ThdTypeError",
    "ThdValueError",
    "__version__",
    "attention",
    "flash_attn_func",
    "flash_attn_varlen_func",
]


_SUBMODULES = ("cp", "layout", "ops", "padding", "reference")


def __getattr__(name: str) -> object:
    # Resolved lazily so that `import thd` stays cheap (no torch, no Triton, no metadata scan).
    if name == "__version__":
        return _installed_version()
    if name == "attention":
        from thd.ops.attention.interface import attention

        globals()["attention"] = attention  # later lookups skip this hook (host time per call)
        return attention
    if name in ("flash_attn_func", "flash_attn_varlen_func"):  # FlashAttention 2 drop-ins
        from thd import flash_compat

        return getattr(flash_compat, name)
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"thd.{name}")
    raise AttributeError(f"module 'thd' has no attribute {name!r}")
