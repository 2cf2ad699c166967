"""thd.cp partitioning: index math vs brute force, round trips, per-rank counts, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import thd._capture
import thd.layout
from thd.cp import (
    local_cu_seqlens_padded,
    partition,
    partition_indices,
    rank_cu_seqlens,
    unpartition,
)
from thd.errors import ThdTypeError, ThdValueError


def _i32(values: list[int], device: str = "cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _cumsum(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _brute_indices(cup: list[int], num_rows: int, cp_size: int, cp_rank: int) -> list[int]:
    """Rank's global rows by walking the slots (reserved capacity as one more slot)."""
    slots = [*cup, num_rows]
    rows: list[int] = []
    for b in range(len(slots) - 1):
        c = (slots[b + 1] - slots[b]) // (2 * cp_size)
        for k in (cp_rank, 2 * cp_size - 1 - cp_rank):
            rows.extend(range(slots[b] + k * c, slots[b] + (k + 1) * c))
    return rows


def _real_mask(cu: list[int], cup: list[int], num_rows: int) -> torch.Tensor:
    mask = torch.zeros(num_rows, dtype=torch.bool)
    for b in range(len(cu) - 1):
        mask[cup[b] : cup[b] + cu[b + 1] - cu[b]] = True
    return mask


# ----------------------------------------------------------------------------- worked example


WORKED_CU, WORKED_CUP = [0, 5, 13], [0, 8, 16]


@pytest.mark.parametrize(
    ("cp_rank", "rows", "full", "first", "second"),
    [
        (0, [0, 1, 6, 7, 8, 9, 14, 15], [0, 2, 6], [0, 2, 4], [0, 0, 2]),
        (1, [2, 3, 4, 5, 10, 11, 12, 13], [0, 3, 7], [0, 2, 4], [0, 1, 3]),
    ],
)
def test_partition_worked_example(
    cp_rank: int, rows: list[int], full: list[int], first: list[int], second: list[int]
) -> None:
    cu, cup = _i32(WORKED_CU), _i32(WORKED_CUP)
    assert partition_indices(cup, 2, cp_rank).tolist() == rows
    assert rank_cu_seqlens(cu, cup, 2, cp_rank).tolist() == full
    assert rank_cu_seqlens(cu, cup, 2, cp_rank, second_half=False).tolist() == first
    assert rank_cu_seqlens(cu, cup, 2, cp_rank, first_half=False).tolist() == second
    assert rank_cu_seqlens(cu, cup, 2, cp_rank).dtype == torch.int32
    assert local_cu_seqlens_padded(cup, 2).tolist() == [0, 4, 8]


def test_partition_reserved_capacity_is_one_more_slot() -> None:
    # Spec §1.6: cup=[0, 8], T=16, cp=2 must not duplicate or drop rows.
    cup = _i32([0, 8])
    r0 = partition_indices(cup, 2, 0, num_rows=16).tolist()
    r1 = partition_indices(cup, 2, 1, num_rows=16).tolist()
    assert r0 == [0, 1, 6, 7, 8, 9, 14, 15]
    assert r1 == [2, 3, 4, 5, 10, 11, 12, 13]
    assert sorted(r0 + r1) == list(range(16))


def test_partition_zero_length_slots_in_middle_and_at_end() -> None:
    cup = _i32([0, 4, 4, 12, 12, 12])
    assert partition_indices(cup, 2, 0).tolist() == [0, 3, 4, 5, 10, 11]
    assert partition_indices(cup, 2, 1).tolist() == [1, 2, 6, 7, 8, 9]


def test_partition_all_empty_and_no_sequences() -> None:
    assert partition_indices(_i32([0, 0, 0]), 2, 1).tolist() == []
    assert partition_indices(_i32([0]), 2, 1, num_rows=8).tolist() == [2, 3, 4, 5]
    x = torch.zeros(0, 3)
    assert partition(x, _i32([0, 0]), 4, 3).shape == (0, 3)


def test_partition_cp1_is_identity() -> None:
    cup = _i32([0, 3, 5])
    assert partition_indices(cup, 1, 0, num_rows=7).tolist() == list(range(7))
    x = torch.randn(7, 2)
    assert torch.equal(partition(x, cup, 1, 0), x)
    assert torch.equal(unpartition([x], cup, 1), x)


def test_partition_keeps_trailing_dims_and_dtype() -> None:
    cup = _i32([0, 8, 16])
    x = torch.arange(16 * 6, dtype=torch.bfloat16).reshape(16, 2, 3)
    shard = partition(x, cup, 2, 1)
    assert shard.shape == (8, 2, 3) and shard.dtype == torch.bfloat16
    assert torch.equal(shard, x[torch.tensor([2, 3, 4, 5, 10, 11, 12, 13])])


@pytest.mark.parametrize("skip", ["capture", "validation-off"])
def test_partition_is_device_side_when_checks_are_skipped(
    skip: str, monkeypatch: pytest.MonkeyPatch, no_host_reads: None
) -> None:
    if skip == "capture":
        monkeypatch.setattr(thd._capture, "is_capturing", lambda: True)
    else:
        monkeypatch.setattr(thd.layout, "_VALIDATION_ENABLED", False)
    cu, cup = _i32(WORKED_CU), _i32(WORKED_CUP)
    idx = partition_indices(cup, 2, 1, num_rows=24)
    counts = rank_cu_seqlens(cu, cup, 2, 1)
    local = local_cu_seqlens_padded(cup, 2)
    x = torch.randn(24, 3)
    shards = [partition(x, cup, 2, r) for r in range(2)]
    back = unpartition(shards, cup, 2)
    assert idx.shape == (12,) and counts.shape == (3,) and local.shape == (3,) and back.shape == x.shape


# ----------------------------------------------------------------------------- property tests


@st.composite
def cp_layouts(draw: st.DrawFn) -> tuple[list[int], list[int], int, int]:
    """(cu, cup, num_rows, cp_size) with zero-length sequences, slot padding and reserved capacity."""
    cp_size = draw(st.integers(1, 4))
    div = 2 * cp_size
    lengths = draw(st.lists(st.integers(0, 3 * div), min_size=0, max_size=6))
    padded = [-(-n // div) * div + div * draw(st.integers(0, 1)) for n in lengths]
    cu, cup = _cumsum(lengths), _cumsum(padded)
    num_rows = cup[-1] + div * draw(st.integers(0, 2))
    return cu, cup, num_rows, cp_size


@pytest.mark.property
@settings(max_examples=150, deadline=None)
@given(cp_layouts())
def test_partition_matches_brute_force_and_round_trips(layout: tuple[list[int], list[int], int, int]) -> None:
    _, cup, num_rows, cp_size = layout
    cup_t = _i32(cup)
    x = torch.randn(num_rows, 2)
    shards = []
    seen: list[int] = []
    for r in range(cp_size):
        idx = partition_indices(cup_t, cp_size, r, num_rows=num_rows)
        assert idx.dtype == torch.int64
        assert idx.tolist() == _brute_indices(cup, num_rows, cp_size, r)
        seen += idx.tolist()
        shards.append(partition(x, cup_t, cp_size, r))
    assert sorted(seen) == list(range(num_rows))
    assert torch.equal(unpartition(shards, cup_t, cp_size), x)
    assert torch.equal(unpartition(shards, cup_t, cp_size, num_rows=num_rows), x)


@pytest.mark.property
@settings(max_examples=150, deadline=None)
@given(cp_layouts())
def test_rank_cu_seqlens_matches_brute_force(layout: tuple[list[int], list[int], int, int]) -> None:
    cu, cup, num_rows, cp_size = layout
    cu_t, cup_t = _i32(cu), _i32(cup)
    real = _real_mask(cu, cup, num_rows)
    local_cup = [v // cp_size for v in cup]
    assert local_cu_seqlens_padded(cup_t, cp_size).tolist() == local_cup
    for r in range(cp_size):
        local_real = real[partition_indices(cup_t, cp_size, r, num_rows=num_rows)]
        want: dict[tuple[bool, bool], list[int]] = {(True, True): [0], (True, False): [0], (False, True): [0]}
        for b in range(len(cu) - 1):
            start, half = local_cup[b], (local_cup[b + 1] - local_cup[b]) // 2
            first = int(local_real[start : start + half].sum())
            second = int(local_real[start + half : start + 2 * half].sum())
            # The real rows of each local slot and of each half form a prefix.
            assert bool(local_real[start : start + first].all()) and bool(
                local_real[start + half : start + half + second].all()
            )
            for (f, s), acc in want.items():
                acc.append(acc[-1] + f * first + s * second)
        for (f, s), acc in want.items():
            got = rank_cu_seqlens(cu_t, cup_t, cp_size, r, first_half=f, second_half=s)
            assert got.tolist() == acc, (r, f, s)


# ----------------------------------------------------------------------------- errors


def test_rejects_reserved_capacity_not_divisible() -> None:
    with pytest.raises(
        ThdValueError, match=r"partition_indices: num_rows \(=12\): expected a multiple of 2\*cp_size = 8"
    ):
        partition_indices(_i32([0, 8]), 4, 0, num_rows=12)


def test_rejects_slot_not_divisible_when_inferring_num_rows() -> None:
    # TE #1929: cu=[0, 7] with cp=2 must be an error, not "as if [0, 6]".
    with pytest.raises(ThdValueError, match=r"slot 0 length .* = 7\): expected a multiple of 2\*cp_size = 4"):
        partition_indices(_i32([0, 7]), 2, 0)


def test_rejects_missing_num_rows_under_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(thd._capture, "is_capturing", lambda: True)
    with pytest.raises(ThdValueError, match="num_rows: expected an int during CUDA-graph capture"):
        partition_indices(_i32([0, 8]), 2, 0)


@pytest.mark.parametrize(("cp_size", "cp_rank"), [(0, 0), (2, 2), (2, -1), (True, 0), (2.0, 0)])
def test_rejects_bad_cp_arguments(cp_size: object, cp_rank: int) -> None:
    with pytest.raises(ThdValueError, match="partition_indices: cp_"):
        partition_indices(_i32([0, 8]), cp_size, cp_rank, num_rows=8)  # type: ignore[arg-type]


def test_rejects_int64_offsets() -> None:
    with pytest.raises(
        ThdTypeError, match=r"cu_seqlens_padded dtype: expected torch\.int32, got torch\.int64"
    ):
        partition_indices(torch.tensor([0, 8]), 2, 0, num_rows=8)


def test_rejects_mismatched_shapes_in_rank_cu_seqlens() -> None:
    with pytest.raises(ThdValueError, match=r"cu_seqlens_padded shape: expected \[3\]"):
        rank_cu_seqlens(_i32([0, 5, 13]), _i32([0, 16]), 2, 0)


def test_rejects_bad_shards() -> None:
    cup = _i32([0, 8])
    with pytest.raises(ThdValueError, match="shards: expected cp_size = 2 tensors, got 1"):
        unpartition([torch.zeros(4)], cup, 2)
    with pytest.raises(ThdValueError, match=r"shards\[1\] shape"):
        unpartition([torch.zeros(4), torch.zeros(3)], cup, 2)
    with pytest.raises(
        ThdValueError, match=r"num_rows \(=16\): expected cp_size \* shards\[0\].shape\[0\] = 8"
    ):
        unpartition([torch.zeros(4), torch.zeros(4)], cup, 2, num_rows=16)


def test_rejects_partition_num_rows_mismatch() -> None:
    with pytest.raises(ThdValueError, match=r"partition: num_rows \(=16\): expected x.shape\[0\] = 8"):
        partition(torch.zeros(8), _i32([0, 8]), 2, 0, num_rows=16)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_partition_on_cuda_matches_cpu() -> None:
    cu, cup, num_rows = [0, 7, 7, 16, 17], [0, 8, 8, 24, 32], 40
    for cp_size in (2, 4):
        x = torch.randn(num_rows, 3, device="cuda")
        shards = []
        for r in range(cp_size):
            idx = partition_indices(_i32(cup, "cuda"), cp_size, r, num_rows=num_rows)
            assert idx.device.type == "cuda"
            assert idx.tolist() == _brute_indices(cup, num_rows, cp_size, r)
            got = rank_cu_seqlens(_i32(cu, "cuda"), _i32(cup, "cuda"), cp_size, r)
            assert got.tolist() == rank_cu_seqlens(_i32(cu), _i32(cup), cp_size, r).tolist()
            shards.append(partition(x, _i32(cup, "cuda"), cp_size, r))
        assert torch.equal(unpartition(shards, _i32(cup, "cuda"), cp_size), x)


@pytest.mark.gpu
def test_partition_captures_into_cuda_graph() -> None:
    cu = _i32([0, 5, 13], "cuda")
    cup = _i32([0, 8, 16], "cuda")
    x = torch.randn(24, 4, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture
        partition(x, cup, 2, 1)
        rank_cu_seqlens(cu, cup, 2, 1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda.set_sync_debug_mode("error")  # inside: entering the graph context synchronizes
        try:
            shard = partition(x, cup, 2, 1)
            counts = rank_cu_seqlens(cu, cup, 2, 1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    cu.copy_(_i32([0, 3, 14], "cuda"))
    cup.copy_(_i32([0, 4, 16], "cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert shard.tolist() == x[partition_indices(cup, 2, 1, num_rows=24)].tolist()
    assert counts.tolist() == rank_cu_seqlens(cu, cup, 2, 1).tolist()


# ----------------------------------------------------------------------------- spec §6 layouts


def _brute_counts(cu: list[int], cup: list[int], cp_size: int, cp_rank: int) -> tuple[list[int], list[int]]:
    """Per-sequence (first-half, second-half) real counts from the indices and a real-row mask."""
    real = _real_mask(cu, cup, cup[-1])
    local_real = real[partition_indices(_i32(cup), cp_size, cp_rank)]
    firsts, seconds = [], []
    for b in range(len(cu) - 1):
        start, half = cup[b] // cp_size, (cup[b + 1] - cup[b]) // (2 * cp_size)
        firsts.append(int(local_real[start : start + half].sum()))
        seconds.append(int(local_real[start + half : start + 2 * half].sum()))
    return firsts, seconds


@pytest.mark.parametrize(
    ("lengths", "slots", "cp_size", "want_first", "want_second"),
    [
        # §6.12: L=3, P=8, cp=2: rank 1's first half is partly real, its second half empty.
        ([3], [8], 2, [[2], [1]], [[0], [0]]),
        # §6.11: L=1 with cp=4: only rank 0 owns a real row; ranks 1..3 own none at all.
        ([1], [8], 4, [[1], [0], [0], [0]], [[0], [0], [0], [0]]),
        # §6.4: L=4, P=8 and L=8, P=16 (real length divisible by 2*cp, slot longer).
        ([4, 8], [8, 16], 2, [[2, 4], [2, 4]], [[0, 0], [0, 0]]),
        # §6.5: padding in the middle sequences, [7, 9, 1, 0, 13] padded to multiples of 4.
        (
            [7, 9, 1, 0, 13],
            [8, 12, 4, 0, 16],
            2,
            [[2, 3, 1, 0, 4], [2, 3, 0, 0, 4]],
            [[1, 0, 0, 0, 1], [2, 3, 0, 0, 4]],
        ),
    ],
)
def test_rank_cu_seqlens_spec_edge_cases(
    lengths: list[int],
    slots: list[int],
    cp_size: int,
    want_first: list[list[int]],
    want_second: list[list[int]],
) -> None:
    cu, cup = _cumsum(lengths), _cumsum(slots)
    for r in range(cp_size):
        assert _brute_counts(cu, cup, cp_size, r) == (want_first[r], want_second[r])
        first = rank_cu_seqlens(_i32(cu), _i32(cup), cp_size, r, second_half=False)
        second = rank_cu_seqlens(_i32(cu), _i32(cup), cp_size, r, first_half=False)
        both = rank_cu_seqlens(_i32(cu), _i32(cup), cp_size, r)
        assert first.tolist() == _cumsum(want_first[r])
        assert second.tolist() == _cumsum(want_second[r])
        assert both.tolist() == _cumsum([f + s for f, s in zip(want_first[r], want_second[r], strict=True)])


def test_rank_cu_seqlens_with_no_halves_is_zero() -> None:
    got = rank_cu_seqlens(_i32([0, 5, 13]), _i32([0, 8, 16]), 2, 0, first_half=False, second_half=False)
    assert got.tolist() == [0, 0, 0]


def test_partition_same_tensor_as_layout_rejects_undivisible_last_slot() -> None:
    # §6.2: cu passed as its own padded layout with a tail that does not split over ranks.
    cu = _i32([0, 8, 13])
    with pytest.raises(ThdValueError, match=r"slot 1 length .* = 5\): expected a multiple of 2\*cp_size = 4"):
        partition_indices(cu, 2, 0)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_all_rank_cu_seqlens_matches_per_rank_calls(cp: int) -> None:
    """The batched table equals rank_cu_seqlens for every rank and half selection."""
    from thd.cp.partition import all_rank_cu_seqlens

    gen = torch.Generator().manual_seed(cp)
    lens = torch.randint(0, 40, (9,), generator=gen)
    lens[3] = 0
    slots = (lens + torch.randint(0, 3 * cp, (9,), generator=gen) + 2 * cp - 1) // (2 * cp) * (2 * cp)
    cu = torch.cat((torch.zeros(1, dtype=torch.int64), lens.cumsum(0))).to(torch.int32)
    cup = torch.cat((torch.zeros(1, dtype=torch.int64), slots.cumsum(0))).to(torch.int32)
    table = all_rank_cu_seqlens(cu, cup, cp)
    assert table.dtype == torch.int32 and table.shape == (3, cp, cu.numel())
    for r in range(cp):
        for h, (first, second) in enumerate(((True, True), (True, False), (False, True))):
            want = rank_cu_seqlens(cu, cup, cp, r, first_half=first, second_half=second)
            assert torch.equal(table[h, r], want), (cp, r, first, second)
