"""thd-kernels: packed variable-length (THD) attention with context parallelism.

Public entry points:

- :func:`thd.attention` -- varlen attention (Triton on GPU, reference on CPU).
- :mod:`thd.layout` -- the cu_seqlens / cu_seqlens_padded layout contract.
- :mod:`thd.padding` -- padding detection, row masks and zeroing.
- :mod:`thd.cp` -- context-parallel partitioning and ring attention.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version

from thd.errors import ThdDistributedError, ThdError, ThdTypeError, ThdValueError

try:
    __version__: str = _dist_version("thd-kernels")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "ThdDistributedError",
    "ThdError",
    "ThdTypeError",
    "ThdValueError",
    "__version__",
    "attention",
]


def __getattr__(name: str) -> object:
    # Imported lazily so that `import thd` stays cheap and Triton is only imported on use.
    if name == "attention":
        from thd.ops.attention.interface import attention

        return attention
    raise AttributeError(f"module 'thd' has no attribute {name!r}")
