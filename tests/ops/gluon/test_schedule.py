"""The persistent Gluon forward's work list (``thd.ops.attention.gluon.schedule``), built by its
``tl`` kernel (the interpreter on CPU), against a Python oracle: every (sequence, query tile) once,
tile index descending, sequences in order within one index (or, ``SEQUENCE_MAJOR``, sequence by
sequence, each from its highest tile down); nothing written past the capacity."""

from __future__ import annotations

import pytest
import torch

from thd.ops.attention.gluon.schedule import build_work_list


def _oracle(lens: list[int], block_m: int, sequence_major: bool = False) -> list[tuple[int, int]]:
    tiles = [(-(-n // block_m)) for n in lens]
    if sequence_major:
        return [(b, m) for b, n in enumerate(tiles) for m in reversed(range(n))]
    top = max(tiles, default=0)
    return [(b, m) for m in reversed(range(top)) for b, n in enumerate(tiles) if n > m]


def _build(
    lens: list[int], pads: list[int], block_m: int, capacity: int, sequence_major: bool = False
) -> tuple[list, int, torch.Tensor]:
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = [n + p for n, p in zip(lens, pads, strict=True)]
    cup = torch.tensor([0, *torch.tensor(slots).cumsum(0).tolist()], dtype=torch.int32)
    buffer = torch.full((2 * capacity + 3,), -7, dtype=torch.int32)
    seq, blk, count = (
        buffer[:capacity],
        buffer[capacity : 2 * capacity],
        buffer[2 * capacity :],
    )
    build_work_list[(len(lens),)](
        cu, cup, seq, blk, count, len(lens), int(cup[-1]), capacity, BLOCK_M=block_m, BLOCK_B=4, BLOCK_T=2,
        SEQUENCE_MAJOR=sequence_major,
    )  # fmt: skip
    n = int(count[0])
    return list(zip(seq[:n].tolist(), blk[:n].tolist(), strict=True)), n, buffer


@pytest.mark.parametrize(
    ("lens", "pads"),
    [([300, 1, 128, 0, 517, 64], [0] * 6), ([5, 129, 700, 3, 3, 256, 1000], [3, 0, 1, 125, 0, 0, 24])],
)
@pytest.mark.parametrize("sequence_major", [False, True], ids=["longest-first", "sequence-major"])
def test_work_list_matches_oracle(lens: list[int], pads: list[int], sequence_major: bool) -> None:
    block_m = 128
    capacity = sum(n + p for n, p in zip(lens, pads, strict=True)) // block_m + len(lens) + 1
    items, n, buffer = _build(lens, pads, block_m, capacity, sequence_major)
    assert items == _oracle(lens, block_m, sequence_major)
    assert n == len(items)
    assert buffer[2 * capacity + 1 :].tolist() == [0, 0]  # the dynamic order's counters, zeroed


@pytest.mark.parametrize("sequence_major", [False, True], ids=["longest-first", "sequence-major"])
def test_work_list_never_writes_past_capacity(sequence_major: bool) -> None:
    lens = [1000, 900]
    items, n, buffer = _build(lens, [0, 0], 64, 5, sequence_major)
    assert n == 5
    assert buffer[11:].tolist() == [0, 0]  # the counters after the count; nothing else written
    assert items == _oracle(lens, 64, sequence_major)[:5]  # the list's first items, nothing past them
