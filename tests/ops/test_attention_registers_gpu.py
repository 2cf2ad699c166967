"""Occupancy of the forward tiles users get at head dims <= 64 (``make test-gpu``; skipped on CPU).

A 4-warp forward tile needs at most 168 registers per thread to keep three blocks on an SM; the
variant branches (sinks epilogue, window mask, softcap) took 172-211 without the launcher's cap, and
the ring's accumulating launches (fp32 running output, chunk positions) 208-210.
Each variant is compiled for this GPU with exactly the tile and options ``thd.ops.attention.launch`` uses and
its register count and spills are read from the compiled kernel."""

from __future__ import annotations

import pytest
import triton

from tests.ops._compile_sm90 import _variant, compile_kernel
from thd._runtime import tiles

pytestmark = pytest.mark.gpu

REGISTERS_PER_SM = 65536
VARIANTS = {
    "plain": {"FOLD_SCALE": True},
    "sinks": {"FOLD_SCALE": True, "HAS_SINKS": True},
    "window": {"FOLD_SCALE": True, "HAS_LEFT": True},
    "softcap": {"FOLD_SCALE": False, "SOFTCAP": True},
    "ring": {"FOLD_SCALE": True, "ACCUMULATE": True},
    "ring-window-softcap-sinks": {
        "FOLD_SCALE": False,
        "ACCUMULATE": True,
        "HAS_POSITIONS": True,
        "HAS_LEFT": True,
        "SOFTCAP": True,
        "HAS_SINKS": True,
    },
}


@pytest.mark.parametrize("long_sequences", [False, True], ids=["short", "long"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_small_head_dim_forward_keeps_three_blocks_per_sm(variant: str, long_sequences: bool) -> None:
    flags = {"HAS_SINKS": False, "ACCUMULATE": False, **VARIANTS[variant]}
    meta = {**_variant(64, 64, **flags), "FP32": False}
    tile = tiles.tile_for("fwd", meta, tiles.LONG_SEQUENCES + 1 if long_sequences else 128)
    constexprs = {**meta, "TMA": tile.tma, "BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n}
    options = {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
    options.update(tiles.register_cap("fwd", tile, meta))
    target = triton.runtime.driver.active.get_current_target()
    fp32_out = frozenset({"out_ptr"}) if meta["ACCUMULATE"] else frozenset()  # the ring's running output
    compiled = compile_kernel("_attention_fwd_kernel", "bf16", constexprs, options, target, fp32_out)
    compiled._init_handles()
    threads = 32 * tile.num_warps
    blocks = REGISTERS_PER_SM // (compiled.n_regs * threads)
    assert compiled.n_spills == 0, f"{variant}: {compiled.n_spills} spilled registers"
    assert blocks >= 3, f"{variant} ({tile.name}): {compiled.n_regs} registers, {blocks} blocks per SM"
