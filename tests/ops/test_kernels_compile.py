"""The attention kernels compile for a Hopper GPU (sm_90) on a machine without one, and their fast
paths use Hopper's instructions: 16-bit matrix products are ``wgmma``, pointer tiles are
pipelined through 16-byte ``cp.async`` copies and ``tma`` tiles arrive by
bulk tensor copies (``cp.async.bulk.tensor``). Runs ``tests/ops/_compile_sm90.py`` in a process
without ``TRITON_INTERPRET`` (the interpreter has nothing to compile)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict[str, int]]:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    proc = subprocess.run(
        [sys.executable, "-m", "tests.ops._compile_sm90", "--stats"],
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


def test_every_configuration_compiles(compiled: dict[str, dict[str, int]]) -> None:
    from tests.ops._compile_sm90 import CONFIGS

    assert set(compiled) == set(CONFIGS)


def test_matrix_products_use_wgmma(compiled: dict[str, dict[str, int]]) -> None:
    for name, stats in compiled.items():
        if "fp32" not in name:  # fp32 (tf32) tiles are small and may take the older mma path
            assert stats["wgmma"] > 0, name


def test_tma_tiles_use_bulk_tensor_copies(compiled: dict[str, dict[str, int]]) -> None:
    for name, stats in compiled.items():
        if "-tma" in name:
            assert stats["bulk_tensor"] > 0, name
        else:
            assert stats["bulk_tensor"] == 0, name


def test_pointer_tiles_are_pipelined(compiled: dict[str, dict[str, int]]) -> None:
    """Without TMA the tiles arrive by 16-byte asynchronous copies (the software pipeline), given
    the alignment a launch on contiguous tensors specializes on."""
    for name, stats in compiled.items():
        if "-tma" not in name and "fp32" not in name:
            assert stats["cp_async_16"] > 0, name
