"""The Gluon backward kernels compile for sm_90 on a machine without a GPU, and their PTX is the
FA3 structure: async wgmma, TMA bulk-tensor loads against mbarriers, register budgets moved by
``setmaxnreg`` to the consumer warpgroups, fp32 atomics for dQ on the default path.

Compiles in a subprocess (``tests/ops/gluon/_compile_sm90.py``, ``TRITON_INTERPRET`` unset,
fresh ``TRITON_CACHE_DIR``): with this interpreter's Triton (CI: 3.9) and with the Triton 3.6 the
GPU machine runs, through the interpreter named by ``THD_TRITON36_PYTHON`` (skipped when unset).
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.ops.gluon._compile_sm90 import compile_in_subprocess

# The atomic dK/dV kernel (one partition), the default dK/dV kernels (two partitions, atomic dQ by
# TMA reduce-add; head dims 128 and 64), the deterministic one at head dim 128 (split dQ), the
# one-partition and the default two-partition dQ kernels, and the default dK/dV tiles as persistent
# programs; each compile takes seconds on CI's two cores.
CONFIGS = (
    "dkdv-d128",
    "dkdv-d128-2wg",
    "dkdv-d64-2wg",
    "dkdv-d128-2wg-split",
    "dq-d64",
    "dq-d128-2wg",
    "dkdv-d128-2wg-persistent",
    "dkdv-d64-2wg-persistent",
    "dkdv-d64-2wg-persistent-dynamic",
    "dkdv-d128-2wg-softcap",
    "dkdv-d64-2wg-persistent-softcap",
    "dq-d128-2wg-softcap",
    "dkdv-d64-2wg-dqcols",
)
# Bytes ptxas (Triton 3.6) may spill, per configuration (none where not named). The dK/dV kernels
# at head dim 128 spill a few loop scalars: 80 and 56 bytes (stores and loads) since each stage's
# lse and delta sit in shared memory; with them in registers the default tile spilled 336 bytes
# and ptxas serialised its S^T and dP^T products. The default tiles (three stages at head dim 128,
# 128-query tiles at 64) spill 356 and 588 bytes and measured faster than the tiles without spills
# (gluon-bwd-tiles-ab-h100.json); at 64 with dQ split by query rows (GluonTile.dq_rows, the default
# since gluon-bwd-dq-rows-881fcc3-h100.json) 476.
# The persistent dK/dV programs (same tiles) keep their work list's arguments and the next item's
# addresses live through the key tile: 920 and 928 bytes (ptxas 3.6), about 5 and 9 more local
# loads per query tile than the per-tile programs; 988 at head dim 64 with dQ by query rows.
# Softcap: the tanh's values beside S^T and dP^T cost the head-dim-128 tile 856 bytes (one partition
# of 8 warps: 292); at head dim 64 its 64-query tile (backward.tiles_for) spills 44 to 76 (128 queries: 2856).
# dQ split by columns at head dim 64 (the default before dq_rows): 588 bytes.
# Since a query tile's dQ product waits for the other partition's dS^T one tile late (issued beside
# the next tile's dK product, nineteenth session): 360 / 532 (per-tile, head dims 128 / 64), 772 /
# 1048 (persistent), 1000 (dynamic), 912 (softcap, 128), 120 (persistent softcap, 64), 584 (dQ by
# columns at 64).
SPILL_LIMITS = {
    "dkdv-d128": 96,
    "dkdv-d128-2wg": 368,
    "dkdv-d64-2wg": 544,
    "dkdv-d128-2wg-split": 64,
    "dkdv-d128-2wg-persistent": 936,
    "dkdv-d64-2wg-persistent": 1064,
    "dkdv-d64-2wg-persistent-dynamic": 1016,
    "dkdv-d128-2wg-softcap": 928,
    "dkdv-d64-2wg-persistent-softcap": 128,
    "dkdv-d64-2wg-dqcols": 600,
}


def _compile(python: str) -> dict[str, dict[str, object]]:
    return compile_in_subprocess(python, CONFIGS, ptxas=True)


def _assert_fa3_structure(stats: dict[str, dict[str, object]]) -> None:
    assert set(stats) == set(CONFIGS)
    for name, s in stats.items():
        for marker in ("wgmma", "wgmma_wait", "tma_load", "mbarrier_expect", "mbarrier_wait", "sm_90a"):
            assert s[marker] > 0, (name, marker, s)  # type: ignore[operator]
        assert s["setmaxnreg"] > 0, (name, s)  # type: ignore[operator]
        maxnreg = s["maxnreg"]
        assert 24 in maxnreg and 240 in maxnreg, (name, maxnreg)  # type: ignore[operator]
        assert s["num_warps"] == 12, (name, s)  # 8 consumer warps (1 or 2 partitions) + a producer warpgroup
    assert stats["dkdv-d128"]["atomic_f32"] > 0  # type: ignore[operator]
    assert stats["dq-d64"]["atomic_f32"] == 0
    # the dynamic order: two draws of the ticket (the first item, then one item ahead) and the
    # done count that zeroes it; the static order draws none
    assert stats["dkdv-d64-2wg-persistent-dynamic"]["ticket_add"] == 3
    assert stats["dkdv-d64-2wg-persistent"]["ticket_add"] == 0
    # dQ by query rows: its product in wgmma of N = 64 (every column), half as many as with N = 32,
    # at both of its call sites (a query tile's dQ issued beside the next tile's dK, and the last's)
    dq_rows, dq_cols = stats["dkdv-d64-2wg"]["wgmma"], stats["dkdv-d64-2wg-dqcols"]["wgmma"]
    assert dq_cols - dq_rows == 2 * 16, (dq_rows, dq_cols)  # type: ignore[operator]
    # the softcap's tanh: one more exp2 per score than the plain kernels (MUFU counted by ptxas)
    if "mufu_ex2" in stats["dq-d128-2wg"]:
        for plain, capped in (
            ("dkdv-d128-2wg", "dkdv-d128-2wg-softcap"),
            ("dq-d128-2wg", "dq-d128-2wg-softcap"),
        ):
            assert stats[capped]["mufu_ex2"] == 2 * stats[plain]["mufu_ex2"], (plain, capped)  # type: ignore[operator]


def test_compiles_for_sm90_with_this_triton() -> None:
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    _assert_fa3_structure(_compile(sys.executable))


def test_compiles_for_sm90_with_triton_3_6() -> None:
    python = os.environ.get("THD_TRITON36_PYTHON")
    if not python:
        pytest.skip("THD_TRITON36_PYTHON unset: no Triton 3.6 interpreter to compile with")
    stats = _compile(python)
    assert all(str(s["triton"]).startswith("3.6") for s in stats.values()), stats
    _assert_fa3_structure(stats)
    # On the GPU machine's toolchain the tiles (nearly) fit their register budgets.
    for name, s in stats.items():
        assert s["spill_bytes"] <= SPILL_LIMITS.get(name, 0), (name, s["spill_bytes"])
        # no wgmma wait injected by ptxas (one serialised S^T and dP^T while delta sat in registers)
        assert s["injected_waits"] == 0, (name, s)
        # nor serialised for want of registers (C7512: holding dQ into the next tile's products did that)
        assert s["wgmma_serialized"] == 0, (name, s)


def test_compiled_default_tiles_are_the_ones_users_get() -> None:
    """The two-partition dK/dV configurations compiled here are ``TWO_CONSUMER_TILES``' dK/dV tiles."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from tests.ops.gluon._compile_sm90 import config_for
    from thd.ops.attention.gluon import backward as gluon_backward

    for head_dim in (64, 128):
        tile = gluon_backward.TWO_CONSUMER_TILES[("dkdv", head_dim)]
        compiled = config_for(f"dkdv-d{head_dim}-2wg").constexprs
        assert {key: compiled[key] for key in tile.constexprs()} == tile.constexprs(), head_dim
        assert compiled["DQ_ROWS"] == tile.dq_rows, head_dim
