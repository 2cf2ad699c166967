"""zero_padding_: Triton kernel (interpreter on CPU) vs the oracle, fast paths, fallback, capture."""

from __future__ import annotations

import os

import pytest
import torch

import thd._capture
import thd.ops.zero_padding.interface as interface
from thd.errors import ThdTypeError, ThdValueError
from thd.ops.zero_padding.reference import zero_padding_masked_, zero_padding_reference
from thd.padding import detect_pad_between_seqs, detection_stats, zero_padding_

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="Triton interpreter lane only")

# (cu_seqlens, cu_seqlens_padded, T): slot padding, tail, reserved capacity, empties.
LAYOUTS = [
    pytest.param([0, 3, 5, 9], [0, 4, 8, 12], 16, id="slots+capacity"),
    pytest.param([0, 3, 3, 7], [0, 4, 4, 8], 8, id="zero-length-middle"),
    pytest.param([0, 5, 13], [0, 8, 16], 16, id="worked-example"),
    pytest.param([0, 3, 5], [0, 3, 8], 10, id="tail-only"),
    pytest.param([0, 4, 8], [0, 4, 8], 8, id="no-padding"),
    pytest.param([0, 8, 8, 8], [0, 8, 8, 8], 12, id="placeholders+capacity"),
    pytest.param([0, 0, 0], [0, 0, 4], 6, id="all-empty"),
    pytest.param([0], [0], 4, id="no-sequences"),
    pytest.param([0, 1, 2], [0, 4, 8], 8, id="single-tokens"),
]


def _i32(values: list[int], device: str = "cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _real_rows(cu: list[int], cup: list[int] | None, num_rows: int) -> torch.Tensor:
    slots = cu if cup is None else cup
    mask = torch.zeros(num_rows, dtype=torch.bool)
    for b in range(len(cu) - 1):
        mask[slots[b] : slots[b] + cu[b + 1] - cu[b]] = True
    return mask


def _poisoned(
    shape: tuple[int, ...], dtype: torch.dtype, real: torch.Tensor, device: str = "cpu"
) -> torch.Tensor:
    """Random real rows, NaN (or -1 for integers) on every padding row."""
    if dtype.is_floating_point:
        x = torch.randn(shape, device=device).to(dtype)
        bad = float("nan")
    else:
        x = torch.randint(1, 100, shape, device=device, dtype=dtype)
        bad = -1
    x[~real.to(device)] = bad
    return x


def _assert_zeroed(got: torch.Tensor, before: torch.Tensor, real: torch.Tensor) -> None:
    """Padding rows exactly +0 (all bits clear); real rows bit-for-bit unchanged."""
    real = real.to(got.device)
    int_view = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    got_bits, before_bits = got.view(int_view), before.view(int_view)
    assert int(torch.count_nonzero(got_bits[~real])) == 0, "padding rows not zero"
    assert torch.equal(got_bits[real], before_bits[real]), "real rows changed"


@pytest.fixture(autouse=True)
def _fresh_cache(fresh_detection_cache: None) -> None:
    """Every test starts with an empty detection cache."""


@pytest.fixture
def kernel_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail if the masked_fill fallback runs instead of the kernel."""

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("fallback used")

    monkeypatch.setattr(interface, "zero_padding_masked_", boom)


# ----------------------------------------------------------------------------- kernel vs oracle


@needs_interpreter
@pytest.mark.parametrize(("cu", "cup", "num_rows"), LAYOUTS)
@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((2, 3), torch.float32), ((), torch.bfloat16), ((4,), torch.int32)],
    ids=["W6-fp32", "W1-bf16", "W4-int32"],
)
def test_zero_padding_kernel_matches_oracle(
    cu: list[int],
    cup: list[int],
    num_rows: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    kernel_only: None,
) -> None:
    real = _real_rows(cu, cup, num_rows)
    x = _poisoned((num_rows, *shape), dtype, real)
    before = x.clone()
    out = zero_padding_(x, _i32(cu), _i32(cup), pad_between_seqs=True)
    assert out is x
    _assert_zeroed(x, before, real)
    assert torch.equal(x, zero_padding_reference(before, _i32(cu), _i32(cup)).nan_to_num(0.0))


@needs_interpreter
def test_zero_padding_kernel_with_many_splits_and_iterations(
    monkeypatch: pytest.MonkeyPatch, kernel_only: None
) -> None:
    monkeypatch.setattr(interface, "_INTERPRETER_BLOCK", 8)
    monkeypatch.setattr(interface, "_INTERPRETER_PROGRAMS", 3)
    cu, cup, num_rows = [0, 3, 3, 17], [0, 8, 8, 24], 40
    real = _real_rows(cu, cup, num_rows)
    for shape in [(num_rows, 3), (num_rows,), (num_rows, 16)]:  # flat, W=1, tiles of 8 columns x2
        x = _poisoned(shape, torch.float32, real)
        before = x.clone()
        zero_padding_(x, _i32(cu), _i32(cup))
        _assert_zeroed(x, before, real)


@needs_interpreter
def test_zero_padding_strided_rows_view(kernel_only: None) -> None:
    cu, cup, num_rows = [0, 3, 5, 9], [0, 4, 8, 12], 16
    real = _real_rows(cu, cup, num_rows)
    base = _poisoned((num_rows, 8), torch.float32, real)
    base[:, 5:] = 7.0
    view = base[:, :5]  # rows are contiguous, stride(0) = 8 != 5
    before = view.clone()
    zero_padding_(view, _i32(cu), _i32(cup))
    _assert_zeroed(view, before, real)
    assert bool((base[:, 5:] == 7.0).all()), "columns outside the view were written"


@needs_interpreter
def test_zero_padding_without_slot_padding_clears_only_the_tail(kernel_only: None) -> None:
    cu, cup, num_rows = [0, 3, 5], [0, 4, 8], 12
    x = torch.ones(num_rows, 2)
    zero_padding_(x, _i32(cu), _i32(cup), pad_between_seqs=False)  # explicit value wins
    assert x[:, 0].tolist() == [1.0] * 5 + [0.0] * 7
    y = torch.ones(num_rows, 2)
    zero_padding_(y, _i32([0, 3, 5]), None)  # no padded tensor: slots are the sequences
    assert y[:, 0].tolist() == [1.0] * 5 + [0.0] * 7


@needs_interpreter
def test_zero_padding_detects_when_not_told(kernel_only: None) -> None:
    cu, num_rows = _i32([0, 3, 5, 9]), 12
    for cup, want in ((_i32([0, 4, 8, 12]), True), (_i32([0, 3, 5, 9]), False)):
        real = _real_rows(cu.tolist(), cup.tolist(), num_rows)
        x = _poisoned((num_rows, 2), torch.float32, real)
        before = x.clone()
        zero_padding_(x, cu, cup)
        _assert_zeroed(x, before, real)
        assert detect_pad_between_seqs(cu, cup) is want
    assert detection_stats()["misses"] == 2


# ----------------------------------------------------------------------------- fast paths / fallback


def test_zero_padding_valid_end_slices_without_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(interface, "_launch", lambda *a: pytest.fail("kernel launched"))
    monkeypatch.setattr(interface, "zero_padding_masked_", lambda *a: pytest.fail("fallback used"))
    cu, cup = _i32([0, 3, 5]), _i32([0, 3, 5])
    x = torch.ones(8, 2)
    zero_padding_(x, cu, cup, pad_between_seqs=False, valid_end=5)
    assert x[:, 1].tolist() == [1.0] * 5 + [0.0] * 3
    y = torch.ones(5, 2)
    zero_padding_(y, cu, cup, pad_between_seqs=False, valid_end=5)  # no tail: nothing to do
    assert bool((y == 1).all())


def test_zero_padding_valid_end_with_slot_padding() -> None:
    cu, cup, num_rows = [0, 3, 5], [0, 4, 8], 12
    real = _real_rows(cu, cup, num_rows)
    x = _poisoned((num_rows, 3), torch.float32, real)
    before = x.clone()
    zero_padding_(x, _i32(cu), _i32(cup), pad_between_seqs=True, valid_end=8)
    _assert_zeroed(x, before, real)


@pytest.mark.parametrize(("cu", "cup", "num_rows"), LAYOUTS)
def test_zero_padding_torch_fallback_matches_oracle(
    cu: list[int], cup: list[int], num_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # plain CPU: no Triton
    monkeypatch.setattr(interface, "_launch", lambda *a: pytest.fail("kernel launched"))
    real = _real_rows(cu, cup, num_rows)
    for pad in (True, False):
        x = _poisoned((num_rows, 2, 2), torch.float32, real)
        before = x.clone()
        zero_padding_(x, _i32(cu), _i32(cup), pad_between_seqs=pad)
        assert torch.equal(
            x.nan_to_num(5.0), zero_padding_reference(before, _i32(cu), _i32(cup), pad).nan_to_num(5.0)
        )


def test_zero_padding_non_contiguous_rows_use_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(interface, "_launch", lambda *a: pytest.fail("kernel launched"))
    cu, cup = [0, 3, 5], [0, 4, 8]
    real = _real_rows(cu, cup, 8)
    x = _poisoned((8, 3), torch.float32, real).T.contiguous().T  # x[i] is strided: not one block
    before = x.clone()
    zero_padding_(x, _i32(cu), _i32(cup))
    _assert_zeroed(x, before, real)


def test_zero_padding_complex_and_bool_use_fallback() -> None:
    cu, cup = _i32([0, 1]), _i32([0, 2])
    z = torch.ones(3, 2, dtype=torch.complex64)
    zero_padding_(z, cu, cup)
    assert z[:, 0].tolist() == [1 + 0j, 0j, 0j]
    b = torch.ones(3, dtype=torch.bool)
    zero_padding_(b, cu, cup)
    assert b.tolist() == [True, False, False]


def test_zero_padding_empty_tensors() -> None:
    cu, cup = _i32([0, 0]), _i32([0, 0])
    assert zero_padding_(torch.empty(0, 4), cu, cup).shape == (0, 4)
    assert zero_padding_(torch.empty(4, 0), _i32([0, 1]), _i32([0, 2])).shape == (4, 0)


def test_zero_padding_is_capture_safe(monkeypatch: pytest.MonkeyPatch, no_host_reads: None) -> None:
    monkeypatch.setattr(thd._capture, "is_capturing", lambda: True)
    cu, cup = _i32([0, 3, 5]), _i32([0, 3, 5])  # value-equal but unseen: the miss assumes padding
    x = torch.ones(8, 2)
    zero_padding_(x, cu, cup)
    zero_padding_(x, cu, cup, pad_between_seqs=False)
    zero_padding_masked_(x, cu, cup, True)
    assert detection_stats()["fallbacks"] == 1


# ----------------------------------------------------------------------------- errors


def test_rejects_bad_arguments() -> None:
    cu, cup = _i32([0, 3]), _i32([0, 4])
    with pytest.raises(
        ThdValueError, match=r"zero_padding_: valid_end: expected an int in \[0, x.shape\[0\] = 4\]"
    ):
        zero_padding_(torch.zeros(4), cu, cup, valid_end=5)
    with pytest.raises(ThdValueError, match="zero_padding_: x shape"):
        zero_padding_(torch.tensor(1.0), cu, cup)
    with pytest.raises(ThdTypeError, match=r"zero_padding_: x: expected a torch\.Tensor, got list"):
        zero_padding_([1.0], cu, cup)  # type: ignore[arg-type]
    with pytest.raises(ThdTypeError, match=r"zero_padding_: cu_seqlens dtype: expected torch\.int32"):
        zero_padding_(torch.zeros(4), torch.tensor([0, 3]), cup)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize(("cu", "cup", "num_rows"), LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_zero_padding_cuda_matches_oracle(
    cu: list[int], cup: list[int], num_rows: int, dtype: torch.dtype
) -> None:
    real = _real_rows(cu, cup, num_rows)
    x = _poisoned((num_rows, 4, 8), torch.float32, real, "cuda").to(dtype)
    before = x.clone()
    zero_padding_(x, _i32(cu, "cuda"), _i32(cup, "cuda"))
    _assert_zeroed(x, before, real)


@pytest.mark.gpu
def test_zero_padding_cuda_large_random_layout() -> None:
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 700, (37,), generator=gen).tolist()
    slots = [n + int(torch.randint(0, 64, (1,), generator=gen)) for n in lengths]
    cu, cup = [0], [0]
    for n, p in zip(lengths, slots, strict=True):
        cu.append(cu[-1] + n)
        cup.append(cup[-1] + p)
    num_rows = cup[-1] + 123
    real = _real_rows(cu, cup, num_rows)
    for shape in [(num_rows, 8, 128), (num_rows,), (num_rows, 3, 5)]:
        x = _poisoned(shape, torch.bfloat16, real, "cuda")
        before = x.clone()
        zero_padding_(x, _i32(cu, "cuda"), _i32(cup, "cuda"))
        _assert_zeroed(x, before, real)
    base = _poisoned((num_rows, 8, 128), torch.bfloat16, real, "cuda")
    view = base[:, :5]  # strided rows
    before = view.clone()
    zero_padding_(view, _i32(cu, "cuda"), _i32(cup, "cuda"))
    _assert_zeroed(view, before, real)
    assert bool(torch.isfinite(base[:, 5:][real.cuda()].float()).all())


def _graph_case(warm: tuple[list[int], list[int]], replays: list[tuple[list[int], list[int]]]) -> None:
    num_rows = 64
    cu = _i32(warm[0], "cuda")
    cup = _i32(warm[1], "cuda")
    x = torch.empty(num_rows, 4, 16, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: eager detection fills the cache, Triton compiles
        for _ in range(2):
            zero_padding_(x, cu, cup)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    hits_before = detection_stats()["hits"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda.set_sync_debug_mode("error")  # inside: entering the graph context synchronizes
        try:
            verdict = detect_pad_between_seqs(cu, cup)
            zero_padding_(x, cu, cup)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    stats = detection_stats()
    assert stats["fallbacks"] == 0 and stats["hits"] == hits_before + 2
    assert verdict is detect_pad_between_seqs(cu, cup)
    for new_cu, new_cup in replays:
        cu.copy_(_i32(new_cu, "cuda"))
        cup.copy_(_i32(new_cup, "cuda"))
        real = _real_rows(new_cu, new_cup, num_rows)
        x.copy_(_poisoned(tuple(x.shape), torch.bfloat16, real, "cuda"))
        before = x.clone()
        graph.replay()
        torch.cuda.synchronize()
        _assert_zeroed(x, before, real)


@pytest.mark.gpu
def test_zero_padding_cuda_graph_with_slot_padding_replays_new_layouts() -> None:
    _graph_case(
        ([0, 3, 5, 9], [0, 4, 8, 12]),
        [([0, 7, 7, 20], [0, 8, 8, 24]), ([0, 1, 2, 3], [0, 16, 32, 48]), ([0, 8, 16, 24], [0, 8, 16, 24])],
    )


@pytest.mark.gpu
def test_zero_padding_cuda_graph_without_slot_padding_replays_new_tails() -> None:
    # Warm-up saw value-equal tensors (False): the captured graph clears only [cu[-1], T),
    # which stays exact for any replayed layout without slot padding.
    _graph_case(
        ([0, 3, 5, 9], [0, 3, 5, 9]),
        [
            ([0, 10, 30, 31], [0, 10, 30, 31]),
            ([0, 0, 0, 0], [0, 0, 0, 0]),
            ([0, 20, 40, 64], [0, 20, 40, 64]),
        ],
    )


@pytest.mark.gpu
def test_zero_padding_cuda_graph_capture_miss_is_safe() -> None:
    x = torch.empty(32, 8, device="cuda")
    # Compile the variant the capture will use (slot padding assumed) outside capture.
    zero_padding_(x, _i32([0, 1], "cuda"), _i32([0, 2], "cuda"), pad_between_seqs=True)
    cu = _i32([0, 3, 5], "cuda")
    cup = _i32([0, 3, 5], "cuda")  # value-equal, never seen eagerly
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda.set_sync_debug_mode("error")
        try:
            zero_padding_(x, cu, cup)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert detection_stats()["fallbacks"] == 1
    cu.copy_(_i32([0, 3, 9], "cuda"))
    cup.copy_(_i32([0, 4, 12], "cuda"))  # slot padding now: the safe capture still zeroes it
    real = _real_rows([0, 3, 9], [0, 4, 12], 32)
    x.copy_(_poisoned((32, 8), torch.float32, real, "cuda"))
    before = x.clone()
    graph.replay()
    torch.cuda.synchronize()
    _assert_zeroed(x, before, real)


def test_rejects_layout_on_other_device() -> None:
    cu = _i32([0, 3])
    with pytest.raises(
        ThdValueError, match=r"zero_padding_: cu_seqlens device: expected meta \(as x\), got cpu"
    ):
        zero_padding_(torch.empty(4, device="meta"), cu, None)


def test_rejects_non_bool_pad_between_seqs() -> None:
    cu = _i32([0, 3])
    with pytest.raises(
        ThdTypeError, match="zero_padding_: pad_between_seqs: expected a bool or None, got int"
    ):
        zero_padding_(torch.zeros(4), cu, _i32([0, 4]), pad_between_seqs=1)  # type: ignore[arg-type]
