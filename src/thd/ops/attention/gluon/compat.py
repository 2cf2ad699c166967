"""One spelling of Gluon's Hopper API for Triton 3.6 (the GPU machine) and 3.9 (CI).

Names that moved between versions are bound here once, the newer name tried first (3.9 keeps some
old names only to raise "has been removed" at compile time). Importing this module never fails:
without Gluon, :data:`HAS_GLUON` is False and the kernel modules must not be imported.
"""

from __future__ import annotations

__all__ = [
    "HAS_GLUON",
    "GluonASTSource",
    "cta_barrier",
    "fence_async_shared",
    "gl",
    "gluon",
    "gluon_available",
    "mbarrier",
    "tma",
    "tma_load",
    "tma_reduce_add",
    "tma_store_wait",
    "warpgroup_mma",
    "warpgroup_mma_wait",
]

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
except ImportError:  # a Triton without Gluon's Hopper surface
    HAS_GLUON = False
    gluon = gl = mbarrier = tma = None  # type: ignore[assignment]
    fence_async_shared = warpgroup_mma = warpgroup_mma_wait = tma_load = cta_barrier = None  # type: ignore[assignment]
    tma_reduce_add = tma_store_wait = None  # type: ignore[assignment]
    GluonASTSource = None  # type: ignore[assignment,misc]
else:
    HAS_GLUON = hasattr(gl, "warp_specialize") and hasattr(tma, "make_tensor_descriptor")
    # TMA global -> shared copy: 3.9 ``async_load``, 3.6 ``async_copy_global_to_shared``.
    tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    # Barrier over the threads of the current partition: 3.9 ``barrier``, 3.6 ``thread_barrier``.
    cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
    # Wait until at most ``pendings`` TMA stores / reductions of this thread still read shared memory.
    tma_store_wait = tma.store_wait
    if hasattr(tma, "async_atomic_add"):  # 3.9: TMA reduce-add from shared memory into global memory
        tma_reduce_add = tma.async_atomic_add
    else:  # 3.6 has the operation (the builder's create_async_tma_reduce) but no Python name for it
        from triton._C.libtriton import ir as _triton_ir
        from triton.language.core import builtin as _builtin

        @_builtin
        def tma_reduce_add(tensor_desc, coord, src, _semantic=None):  # type: ignore[no-untyped-def]
            """Add the shared-memory tile ``src`` into ``tensor_desc`` at ``coord`` (rows and
            columns outside the descriptor's shape are dropped)."""
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(
                _triton_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
            )

    try:
        from triton.experimental.gluon import GluonASTSource
    except ImportError:
        from triton.experimental.gluon._runtime import GluonASTSource


def gluon_available() -> bool:
    """Whether the installed Triton has every Gluon piece the Hopper kernels use."""
    return HAS_GLUON
