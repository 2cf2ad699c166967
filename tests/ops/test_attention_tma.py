"""The tensor-descriptor (TMA) and warp-specialized kernel paths, through the interpreter on CPU.

Tiles with ``tma=True`` read q/k/v/do tiles through device-side tensor descriptors whose shape is
one sequence's real rows, so rows past a sequence (padding, the next sequence) read as 0 without
being touched. The same oracle as the plain path: the fp32 reference, NaN-poisoned padding, exact
zeros on padding rows of every output and gradient. Tensors the copy engine cannot read (a
misaligned view) must fall back to pointer loads and stay exact.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import thd
from tests._helpers import assert_close, make_layout, make_qkv, tolerance
from tests.ops.test_attention_variants import CPU_CASES, _compare
from thd._runtime import tiles
from thd.ops.attention import reference

_LAYOUT = make_layout("mixed", [37, 1, 70, 0], [37, 1, 70, 0], pad_q=[3, 0, 5, 2], capacity_q=2)
_CROSS = make_layout("cross", [20, 45], [50, 33], pad_q=[1, 2], pad_kv=[3, 0])


@pytest.fixture
def tma_tiles(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Interpreter tiles with TMA and warp specialization on; records each launch's TMA flag."""
    monkeypatch.setattr(tiles, "INTERPRETER_TILE", tiles.Tile(32, 32, 4, 1, tma=True, warp_specialize=True))
    seen: list[bool] = []
    capable = tiles.tma_capable

    def spy(*tensors: torch.Tensor) -> bool:
        seen.append(capable(*tensors))
        return seen[-1]

    monkeypatch.setattr(tiles, "tma_capable", spy)
    return seen


@pytest.mark.parametrize(("options", "sinks"), CPU_CASES)
@pytest.mark.parametrize("layout", [_LAYOUT, _CROSS], ids=lambda lay: lay.name)
def test_tma_path_matches_reference(tma_tiles: list[bool], layout, options: dict, sinks: bool) -> None:
    _compare(layout, (4, 2), (32, 32), torch.float32, "cpu", sinks, **options)
    assert tma_tiles and all(tma_tiles)  # every launch read its tiles through descriptors


@pytest.mark.parametrize("dims", [(8, 8), (40, 24), (72, 136)], ids=lambda d: f"D{d[0]}-Dv{d[1]}")
def test_tma_path_any_head_dim(tma_tiles: list[bool], dims: tuple[int, int]) -> None:
    _compare(_LAYOUT, (2, 1), dims, torch.float32, "cpu", False, causal=True)
    assert tma_tiles and all(tma_tiles)


def test_misaligned_tensors_fall_back_to_pointer_loads() -> None:
    base = torch.randn(8 * 2 * 32 + 1)
    view = base[1:].view(8, 2, 32)  # data pointer 4 bytes past a 16-byte boundary
    aligned = torch.randn(8, 2, 32)
    assert tiles.tma_capable(aligned)
    assert not tiles.tma_capable(view)
    assert not tiles.tma_capable(aligned, view)
    strided = torch.randn(8, 2, 34)[:, :, :32]  # row stride 68 floats: not a multiple of 16 bytes
    assert not tiles.tma_capable(strided)


def test_cpu_tensors_outside_the_interpreter_have_no_copy_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside the interpreter only a CUDA tensor of a Hopper GPU is TMA-readable: CPU tensors (the
    host-time stubs of ``benchmarks/profile_host.py``) answer False without asking for a CUDA device,
    which a CPU-only torch does not have."""
    monkeypatch.setattr(tiles, "TMA_ENABLED", True)
    monkeypatch.setattr(tiles, "SETTINGS", replace(tiles.SETTINGS, interpret=False))
    aligned = torch.randn(8, 2, 32)
    assert not tiles.tma_capable(aligned)
    monkeypatch.setattr(tiles, "SETTINGS", replace(tiles.SETTINGS, interpret=True))
    assert tiles.tma_capable(aligned)


def test_misaligned_inputs_stay_exact_on_tma_tiles(tma_tiles: list[bool]) -> None:
    q, k, v, _ = make_qkv(_LAYOUT, 2, 1, 32, 32, torch.float32)
    kwargs = _LAYOUT.kwargs("cpu")

    def shifted(x: torch.Tensor) -> torch.Tensor:
        """The same values at a data pointer 4 bytes past a 16-byte boundary."""
        out = torch.empty(x.numel() + 1)[1:].view(x.shape)
        return out.copy_(x)

    got = thd.attention(shifted(q), shifted(k), shifted(v), causal=True, **kwargs)
    want = reference.attention(q, k, v, causal=True, **kwargs)
    real = _LAYOUT.real_rows("q", "cpu")
    assert_close(got[real], want[real], "out", **tolerance(torch.float32))
    assert bool((got[~real] == 0).all())
    assert tma_tiles and not any(tma_tiles)
