"""Invalid layouts on the unvalidated path (both ``max_seqlen_*`` given) stay inside the tensors.

The kernels clamp every row range read from ``cu_seqlens`` to the tensor on the device, so an
invalid layout may give garbage outputs but never reads or writes outside q, k, v, out, lse or
the gradients. On CPU the interpreter runs the kernels on raw memory: before the clamp these
layouts corrupted the heap and aborted the process. Inputs and accumulators are views into
larger buffers whose other rows are canaries that must come back unchanged. On the GPU the
same cases run under ``compute-sanitizer --tool memcheck`` (see ``make memcheck``), on the ``tl``
kernels (fp32, head dim 32) and on the Gluon kernels (``THD_KERNELS=gluon``, bf16, head dim 64).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from thd._runtime import tiles
from thd.ops.attention import AttentionOptions, VarlenLayout, attention_backward, attention_forward

ROWS = 40
CANARY = 3.25

# name -> (cu_seqlens, cu_seqlens_padded or None); every one is invalid for ROWS rows.
INVALID = {
    "longer-than-buffer": ([0, 100], None),
    "slot-past-end": ([0, 10, 30], [0, 30, 1000]),
    "decreasing": ([0, 50, 10], None),
    "negative-start": ([-20, 5], None),
    "int32-max": ([0, 2**31 - 1], None),
    "negative-slot": ([0, 8, 16], [0, -64, 8]),
    "overlapping-slots": ([0, 30, 60], [0, 10, 20]),
}


def _canaried(
    rows: int, heads: int, dim: int, device: str, *, value: Tensor | None = None, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """A ``[rows, heads, dim]`` view with 16 canary rows before and after it in one buffer."""
    buf = torch.full((rows + 32, heads, dim), CANARY, device=device, dtype=dtype)
    view = buf[16 : 16 + rows]
    view.copy_(torch.randn(rows, heads, dim, device=device) if value is None else value)
    return buf, view


def _run(name: str, device: str, dtype: torch.dtype = torch.float32, dim: int = 32) -> None:
    cu_list, cup_list = INVALID[name]
    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
    cup = None if cup_list is None else torch.tensor(cup_list, dtype=torch.int32, device=device)
    layout = VarlenLayout(cu, cu, cup, cup, 64, 64)
    options = AttentionOptions(dim**-0.5, causal=True)
    buffers, (q, k, v, do) = zip(
        *(_canaried(ROWS, 2, dim, device, dtype=dtype) for _ in range(4)), strict=True
    )
    zeros = torch.zeros(ROWS, 2, dim, device=device)
    out_buf, out = _canaried(ROWS, 2, dim, device, value=zeros, dtype=dtype)
    lse_buf = torch.full((2, ROWS + 32), CANARY, device=device)
    lse = lse_buf[:, 16 : 16 + ROWS]
    lse.fill_(float("-inf"))
    before = [b.clone() for b in buffers]
    attention_forward(q, k, v, layout, options, accumulate=(out, lse))
    fresh_out, fresh_lse = attention_forward(q, k, v, layout, options)
    for deterministic in (False, True):
        opts = AttentionOptions(dim**-0.5, causal=True, deterministic=deterministic)
        attention_backward(do, q, k, v, fresh_out, fresh_lse, layout, opts)
    if device == "cuda":
        torch.cuda.synchronize()
    for b, b0 in zip(buffers, before, strict=True):
        assert torch.equal(b, b0), "an input or its canary rows changed"
    assert bool((out_buf[:16] == CANARY).all() and (out_buf[-16:] == CANARY).all()), "write before/after out"
    assert bool((lse_buf[:, :16] == CANARY).all() and (lse_buf[:, -16:] == CANARY).all()), "write around lse"


def _force_tma(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every launch on tensor-descriptor (TMA) tiles: the interpreter tile, and the table's."""
    tma = tiles.Tile(32, 32, 4, 1, tma=True)
    monkeypatch.setattr(tiles, "INTERPRETER_TILE", tma)
    monkeypatch.setattr(tiles, "TILES", {key: tiles.Tile(64, 64, 4, 2, tma=True) for key in tiles.TILES})


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("name", list(INVALID))
def test_invalid_layouts_stay_inside_tensors_cpu(
    name: str, tma: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("THD_ATTENTION_BACKEND", "triton")
    if tma:
        _force_tma(monkeypatch)
    _run(name, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["table", "tma"])
@pytest.mark.parametrize("name", list(INVALID))
def test_invalid_layouts_stay_inside_tensors_gpu(
    name: str, tma: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if tma:
        _force_tma(monkeypatch)
    _run(name, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(INVALID))
def test_invalid_layouts_stay_inside_tensors_gluon(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels need an sm_90 GPU")
    monkeypatch.setenv("THD_KERNELS", "gluon")
    _run(name, "cuda", torch.bfloat16, 64)
