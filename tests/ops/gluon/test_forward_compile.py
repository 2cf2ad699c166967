"""The Gluon forward compiles for Hopper (sm_90) on a machine without a GPU, with Triton 3.9 (this
environment) and with Triton 3.6 (the GPU machine's, an interpreter named by ``THD_TRITON36_PYTHON``),
and its PTX has FA3's pieces: async ``wgmma`` with one group left in flight (the next QK^T over this
tile's softmax), TMA tile copies completing on mbarriers (``expect_tx``, ``try_wait``), register
budgets per partition (``setmaxnreg``) and the ``sm_90a`` target. Runs
``tests/ops/gluon/_compile_fwd_sm90.py`` in a subprocess without ``TRITON_INTERPRET`` and with a fresh
Triton cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ("d128-causal-bf16", "d64-fp16")


def _compile(python: str, cache: Path) -> dict[str, dict[str, int]]:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        TRITON_CACHE_DIR=str(cache),
        TRITON_DEFAULT_FP_FUSION="1",
    )
    proc = subprocess.run(
        [python, "-m", "tests.ops.gluon._compile_fwd_sm90", *CONFIGS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    stats: dict[str, dict[str, int]] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("ok "):
            _, name, *fields = line.split()
            stats[name] = {key: int(value) for key, value in (f.split("=") for f in fields)}
    return stats


def _assert_fa3_pieces(stats: dict[str, dict[str, int]]) -> None:
    assert set(stats) == set(CONFIGS)
    for name, counts in stats.items():
        for key in ("wgmma", "wgmma_wait1", "bulk_tensor", "expect_tx", "try_wait", "setmaxnreg", "sm90a"):
            assert counts[key] > 0, (name, key, counts)
        # two 4-warp consumer warpgroups and the producer warp's warpgroup
        assert counts["num_warps"] == 12, (name, counts)


def test_compiles_for_sm90_with_this_triton(tmp_path: Path) -> None:
    pytest.importorskip("triton.experimental.gluon")
    _assert_fa3_pieces(_compile(sys.executable, tmp_path))


def test_compiles_for_sm90_with_triton_3_6(tmp_path: Path) -> None:
    python = os.environ.get("THD_TRITON36_PYTHON", "")
    if not python:
        pytest.skip("THD_TRITON36_PYTHON is unset: name a Python with triton==3.6.0 (torch not needed)")
    _assert_fa3_pieces(_compile(python, tmp_path))
