"""Names the Gluon backward needs that differ between Triton 3.6 and 3.9, bound once.

``HAS_GLUON_HOPPER`` is False when the installed Triton lacks the Gluon Hopper surface (the
other names are then unusable and the backward falls back to the tl kernels).
"""

from __future__ import annotations

__all__ = ["HAS_GLUON_HOPPER", "GluonASTSource", "cta_barrier", "tma_load"]

try:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401  (probed names)
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    # The new names first: 3.9 still has the old ones, but they raise when compiled.
    tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
    try:
        from triton.experimental.gluon import GluonASTSource
    except ImportError:  # Triton 3.6
        from triton.experimental.gluon._runtime import GluonASTSource
    HAS_GLUON_HOPPER = hasattr(gl, "warp_specialize") and hasattr(tma, "make_tensor_descriptor")
except ImportError:  # a Triton without Gluon
    tma_load = cta_barrier = GluonASTSource = None  # type: ignore[assignment]
    HAS_GLUON_HOPPER = False
