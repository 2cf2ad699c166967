"""The launch argument groups both Gluon wrappers build (``thd.ops.attention.gluon.host``), on CPU:
the order the kernels take them in, written out by hand."""

from __future__ import annotations

import torch

from thd.ops.attention.gluon.host import row_strides, sequence_args
from thd.ops.attention.params import VarlenLayout


def _same(got: tuple, want: tuple) -> bool:
    return len(got) == len(want) and all(a is b for a, b in zip(got, want, strict=True))


def test_sequence_args_order_and_stand_ins() -> None:
    cu_q, cu_kv = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    cup_q, cup_kv = torch.tensor([0, 4, 8], dtype=torch.int32), torch.tensor([0, 6, 12], dtype=torch.int32)
    plain = VarlenLayout(cu_q, cu_kv, cup_q, cup_kv)
    has_positions, args = sequence_args(plain)
    assert not has_positions
    assert [a is b for a, b in zip(args, (cu_q, cu_kv, cup_q, cup_kv, cu_q, cu_kv), strict=True)] == [
        True
    ] * 6
    pos_q, pos_kv = torch.tensor([7, 0], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    placed = VarlenLayout(cu_q, cu_kv, None, None, positions_q=pos_q, positions_kv=pos_kv)
    has_positions, args = sequence_args(placed)
    assert has_positions
    # no padded offsets: the slots are the sequences
    assert [a is b for a, b in zip(args, (cu_q, cu_kv, cu_q, cu_kv, pos_q, pos_kv), strict=True)] == [
        True
    ] * 6


def test_row_strides_of_views() -> None:
    packed = torch.zeros(10, 6, 64)
    q, k = packed[:, :4], packed[:, 4:]  # heads of one packed buffer: row stride 384
    v = torch.zeros(10, 2, 32).transpose(0, 1).contiguous().transpose(0, 1)  # head-major
    assert row_strides(q, k, v) == (384, 64, 384, 64, 32, 320)
    assert row_strides() == ()
