"""The softmax ``exp2`` with one element in 4 or 8 on the FMA pipe (``gluon/exp2_mix.py``): its
polynomial step against ``exp2`` in float64 and against ``ldexp`` (the bit arithmetic), its edge
values (masked scores exactly 0, NaN kept), and, compiled for sm_90 by Triton 3.6's ptxas, exactly
the expected share of the forward's ``MUFU.EX2`` gone with nothing spilled."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.ops.gluon._compile_sm90 import compile_in_subprocess
from thd.ops.attention.gluon.exp2_mix import EXP2_POLY_COEFFS, exp2_asm, exp2_poly_reference


def test_polynomial_is_within_bf16_and_fp16_rounding_of_exp2() -> None:
    x = torch.linspace(-126.0, 0.49, 2_000_001)
    got = exp2_poly_reference(x).double()
    want = torch.exp2(x.double())
    relative = ((got - want).abs() / want).max().item()
    assert relative < 1.1e-4  # half an fp16 ulp is 4.9e-4, half a bf16 ulp 3.9e-3


def test_bit_arithmetic_equals_ldexp() -> None:
    """``(round(t) + 127) << 23`` read as a float is ``2^round(t)``: the step equals an independent
    numpy evaluation ``ldexp(p(t - rint(t)), rint(t))`` bit for bit where that is a normal number."""
    x = np.linspace(-126.49, 0.49, 400_003, dtype=np.float32)
    n = np.rint(x)
    f = (x - n).astype(np.float32)
    c1, c2, c3 = (np.float32(c) for c in EXP2_POLY_COEFFS)
    p = ((f * c3 + c2) * f + c1) * f + np.float32(1.0)
    want = np.ldexp(p, n.astype(np.int32)).astype(np.float32)
    got = exp2_poly_reference(torch.from_numpy(x)).numpy()
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


def test_edge_values() -> None:
    x = torch.tensor([float("-inf"), -1e30, -127.0, -126.6, float("nan"), 0.0, -0.5, -1.0])
    got = exp2_poly_reference(x)
    assert torch.equal(got[:4], torch.zeros(4))  # masked scores (-inf) and below 2^-126.5: exactly 0
    assert torch.isnan(got[4])
    assert got[5].item() == 1.0
    assert abs(got[6].item() - 2**-0.5) < 1e-4 and abs(got[7].item() - 0.5) < 1e-4


@pytest.mark.parametrize("every", [2, 4, 8])
def test_asm_takes_the_last_register_of_each_pack(every: int) -> None:
    lines = exp2_asm(every).splitlines()
    direct = [line for line in lines if line.startswith("ex2.approx.ftz.f32")]
    assert direct == [f"ex2.approx.ftz.f32 ${i}, ${every + i};" for i in range(every - 1)]
    assert f"max.NaN.f32 t, ${2 * every - 1}, 0fC2FE0000;" in lines
    assert lines[-2] == f"mul.rn.f32 ${every - 1}, p, e;"
    with pytest.raises(ValueError, match="every"):
        exp2_asm(1)


def test_forward_moves_one_exp2_in_four_or_eight_off_the_mufu_with_triton_3_6() -> None:
    """Head dim 64 (three consumers, 64 scores per thread and tile, two ``_softmax_step`` sites
    each): 3 * 2 * 64 / 4 = 96 fewer ``MUFU.EX2`` with one in four, 48 with one in eight; no spill,
    no injected wait."""
    python = os.environ.get("THD_TRITON36_PYTHON", "")
    if not python:
        pytest.skip("THD_TRITON36_PYTHON is unset: name a Python with triton==3.6.0 (torch not needed)")
    names = ("d64-causal-bf16", "d64-causal-bf16-exp-poly4", "d64-causal-bf16-exp-poly8")
    stats = compile_in_subprocess(python, names, ptxas=True)
    plain = stats["d64-causal-bf16"]["mufu_ex2"]
    assert plain - stats["d64-causal-bf16-exp-poly4"]["mufu_ex2"] == 96, stats
    assert plain - stats["d64-causal-bf16-exp-poly8"]["mufu_ex2"] == 48, stats
    for name in names:
        assert stats[name]["spill_bytes"] == 0 and stats[name]["injected_waits"] == 0, (name, stats[name])
