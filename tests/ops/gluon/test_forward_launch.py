"""The Gluon forward's launch (``thd.ops.attention.gluon.forward.forward``), on CPU: the kernel is
replaced by a recorder, and the launch must pass every parameter of the real kernel exactly once
(positionally in the kernel's order, then by keyword), so a parameter added to the kernel but not
to the launch fails here instead of on the GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from thd.ops.attention.gluon import forward as gluon_forward
from thd.ops.attention.gluon import forward_kernel
from thd.ops.attention.params import AttentionOptions, ForwardCall, VarlenLayout

LAUNCH_OPTIONS = {"num_warps", "maxnreg"}


class _Recorder:
    """Stands in for ``kernel[grid](*args, **kwargs)`` and keeps what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, tuple, dict]] = []

    def __getitem__(self, grid: tuple):  # type: ignore[no-untyped-def]
        def launch(*args: object, **kwargs: object) -> None:
            self.calls.append((grid, args, kwargs))

        return launch


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_forward_launch_passes_every_kernel_parameter(
    monkeypatch: pytest.MonkeyPatch, padded: bool, head_dim: int
) -> None:
    names = list(forward_kernel.attention_fwd_kernel.arg_names)
    recorder = _Recorder()
    monkeypatch.setattr(forward_kernel, "attention_fwd_kernel", recorder)
    monkeypatch.setattr(gluon_forward, "num_sms", lambda index: 4)
    monkeypatch.setattr(gluon_forward, "device_index", lambda device: 0)
    cu = torch.tensor([0, 70, 200], dtype=torch.int32)
    slots = torch.tensor([0, 80, 208], dtype=torch.int32) if padded else None
    rows = 208 if padded else 200
    q, k, v = (torch.randn(rows, 4, head_dim, dtype=torch.bfloat16) for _ in range(3))
    layout = VarlenLayout(cu, cu, slots, slots)
    gluon_forward.forward(ForwardCall(q, k, v, layout, AttentionOptions(head_dim**-0.5, causal=True)))
    ((grid, args, kwargs),) = recorder.calls
    keywords = set(kwargs) - LAUNCH_OPTIONS
    assert sorted(names[len(args) :]) == sorted(keywords)
    assert set(kwargs) >= LAUNCH_OPTIONS
    assert kwargs["SLOTS"] is padded
    assert kwargs["HEAD_DIM"] == head_dim
    assert len(grid) == 1 and 1 <= grid[0] <= 4
