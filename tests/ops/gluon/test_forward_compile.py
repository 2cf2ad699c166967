"""The Gluon forward compiles for Hopper (sm_90) on a machine without a GPU, with Triton 3.9 (this
environment) and with Triton 3.6 (the GPU machine's, an interpreter named by ``THD_TRITON36_PYTHON``),
and its PTX has FA3's pieces: async ``wgmma`` with one group left in flight (the next QK^T over this
tile's softmax), TMA tile copies completing on mbarriers (``expect_tx``, ``try_wait``), register
budgets per partition (``setmaxnreg``) and the ``sm_90a`` target. Runs
``tests/ops/gluon/_compile_sm90.py`` in a subprocess without ``TRITON_INTERPRET`` and with a fresh
Triton cache."""

from __future__ import annotations

import os
import sys

import pytest

from tests.ops.gluon._compile_sm90 import compile_in_subprocess

CONFIGS = ("d128-causal-bf16", "d64-fp16")


def _assert_fa3_pieces(stats: dict[str, dict]) -> None:
    assert set(stats) == set(CONFIGS)
    for name, counts in stats.items():
        for key in (
            "wgmma",
            "wgmma_wait1",
            "tma_load",
            "mbarrier_expect",
            "mbarrier_wait",
            "setmaxnreg",
            "sm_90a",
        ):
            assert counts[key] > 0, (name, key, counts)
    # 4-warp consumer warpgroups (two at head dim 128, three at 64) and the producer warp's warpgroup
    assert stats["d128-causal-bf16"]["num_warps"] == 12, stats
    assert stats["d64-fp16"]["num_warps"] == 16, stats


def _fits_registers(stats: dict[str, object]) -> bool:
    """ptxas spilled nothing, injected no wgmma wait and serialised no wgmma (C7512)."""
    return stats["spill_bytes"] == 0 and stats["injected_waits"] == 0 and stats["wgmma_serialized"] == 0


def test_compiles_for_sm90_with_this_triton() -> None:
    pytest.importorskip("triton.experimental.gluon")
    _assert_fa3_pieces(compile_in_subprocess(sys.executable, CONFIGS))


def test_compiles_for_sm90_with_triton_3_6() -> None:
    python = os.environ.get("THD_TRITON36_PYTHON", "")
    if not python:
        pytest.skip("THD_TRITON36_PYTHON is unset: name a Python with triton==3.6.0 (torch not needed)")
    _assert_fa3_pieces(compile_in_subprocess(python, CONFIGS))


def test_softmax_overlaps_the_pv_product_in_sass_with_triton_3_6() -> None:
    """In the head-dim-128 key loop (two consumers) the whole tile's softmax (64 ``exp2`` per thread,
    plus ``alpha``) sits between the scores' wait and the ``P V`` wait in the SASS of Triton 3.6's
    ptxas; without ``_after_softmax`` ptxas hoisted that wait above every ``exp2`` (0 here)."""
    python = os.environ.get("THD_TRITON36_PYTHON", "")
    if not python:
        pytest.skip("THD_TRITON36_PYTHON is unset: name a Python with triton==3.6.0 (torch not needed)")
    stats = compile_in_subprocess(python, ("d128-causal-bf16",), ptxas=True)["d128-causal-bf16"]
    counts = stats["exp2_before_last_wait"]
    assert len(counts) == 2, stats  # one key loop per consumer warpgroup
    assert min(counts) >= 64, stats
    assert _fits_registers(stats), stats


D256 = ("d256-causal-bf16", "d256-variants-fp16", "d256-dv128-gqa")
SM90_SHARED_BYTES = 232448  # 227 KB: the most shared memory one block may have on sm_90


def test_head_dim_256_fits_shared_memory_without_spills_with_triton_3_6() -> None:
    """The head-dim-256 tile (two consumers, 32-row key tiles, two stages) fits one block's shared
    memory with no spill in every variant; 64-row key tiles would not (257 KB, 88 bytes spilled)."""
    python = os.environ.get("THD_TRITON36_PYTHON", "")
    if not python:
        pytest.skip("THD_TRITON36_PYTHON is unset: name a Python with triton==3.6.0 (torch not needed)")
    stats = compile_in_subprocess(python, D256, ptxas=True)
    for name in D256:
        s = stats[name]
        assert s["wgmma_wait1"] > 0 and s["tma_load"] > 0 and s["num_warps"] == 12, (name, s)
        assert _fits_registers(s), (name, s)
        assert s["shared"] <= SM90_SHARED_BYTES, (name, s["shared"])


def test_gqa_row_packing_compiles_without_spills_with_triton_3_6() -> None:
    """The packed forward (two query heads per item, a Q descriptor each, the producer at 32
    registers as the host launches it): FA3's pieces, no spill, the softmax order kept."""
    python = os.environ.get("THD_TRITON36_PYTHON", "")
    if not python:
        pytest.skip("THD_TRITON36_PYTHON is unset: name a Python with triton==3.6.0 (torch not needed)")
    stats = compile_in_subprocess(python, ("d128-gqa-pack",), ptxas=True)["d128-gqa-pack"]
    assert stats["wgmma_wait1"] > 0 and stats["tma_load"] > 0 and stats["num_warps"] == 12, stats
    assert _fits_registers(stats), stats
    assert min(stats["exp2_before_last_wait"]) >= 64, stats


def test_the_wait_profile_compiles_out_unless_asked_for() -> None:
    """``PROFILE`` adds ``%clock64`` reads (the wait profile of ``profile_gluon_waits.py``); the
    kernel users get has none and keeps its registers without spills."""
    pytest.importorskip("triton.experimental.gluon")
    python = os.environ.get("THD_TRITON36_PYTHON", "")
    if not python:
        pytest.skip("THD_TRITON36_PYTHON is unset: name a Python with triton==3.6.0 (torch not needed)")
    stats = compile_in_subprocess(python, ("d128-causal-bf16", "d128-causal-bf16-profile"), ptxas=True)
    assert stats["d128-causal-bf16"]["clock64"] == 0 and stats["d128-causal-bf16"]["spill_bytes"] == 0
    assert stats["d128-causal-bf16-profile"]["clock64"] > 0
