"""thd.layout: validation rules and messages, the switch, capture behaviour, pack_lengths."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import thd._capture
from thd.errors import ThdTypeError, ThdValueError
from thd.layout import PackedLayout, pack_lengths, set_validation, validate, validation_enabled
from thd.padding import valid_rows

SRC = Path(__file__).resolve().parents[1] / "src"


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


@pytest.fixture(autouse=True)
def _validation_on() -> Iterator[None]:
    previous = set_validation(True)
    yield
    set_validation(previous)


# ----------------------------------------------------------------------------- validate


@pytest.mark.parametrize(
    ("cu", "cup", "num_rows", "cp_size"),
    [
        ([0, 3, 5, 9], [0, 4, 8, 12], 16, 1),
        ([0, 5, 13], [0, 8, 16], 16, 2),
        ([0, 5, 13], [0, 8, 16], 24, 2),  # reserved capacity, one more slot of 8
        ([0, 3, 3, 7], [0, 4, 4, 8], None, 2),  # zero-length middle sequence
        ([0, 8, 8, 8], [0, 8, 8, 8], 8, 4),  # trailing placeholders
        ([0, 8, 8], [0, 8, 16], 16, 2),  # trailing dummy slot
        ([0, 0, 0], [0, 0, 0], 0, 2),  # all empty
        ([0], [0], 4, 1),  # no sequences
        ([0, 4, 12], None, 12, 2),  # no padded tensor: slots are the sequences
    ],
)
def test_validate_accepts(cu: list[int], cup: list[int] | None, num_rows: int | None, cp_size: int) -> None:
    validate(_i32(cu), None if cup is None else _i32(cup), num_rows=num_rows, cp_size=cp_size)


@pytest.mark.parametrize(
    ("cu", "cup", "kwargs", "message"),
    [
        (
            [0, 3],
            [0, 4, 8],
            {},
            r"validate: cu_seqlens_padded shape: expected \[2\] \(same as cu_seqlens\), got \[3\]",
        ),
        ([1, 3], [0, 4], {}, r"validate: cu_seqlens\[0\] \(=1\): expected 0"),
        ([0, 3], [2, 4], {}, r"validate: cu_seqlens_padded\[0\] \(=2\): expected 0"),
        (
            [0, 5, 3],
            None,
            {},
            r"validate: cu_seqlens\[2\] \(=3\) < cu_seqlens\[1\] \(=5\): expected non-decreasing",
        ),
        (
            [0, 4, 8, 9],
            [0, 8, 30, 22],
            {},
            r"validate: cu_seqlens_padded\[3\] \(=22\) < cu_seqlens_padded\[2\] \(=30\): "
            r"expected non-decreasing",
        ),
        (
            [0, 3, 10],
            [0, 4, 8],
            {},
            r"validate: slot 1 length \(cu_seqlens_padded\[2\] - cu_seqlens_padded\[1\] = 4\) "
            r"< real length \(cu_seqlens\[2\] - cu_seqlens\[1\] = 7\)",
        ),
        (
            [0, 3, 9],
            [0, 4, 10],
            {"cp_size": 2},
            r"validate: slot 1 length \(cu_seqlens_padded\[2\] - cu_seqlens_padded\[1\] = 6\): "
            r"expected a multiple of 2\*cp_size = 4",
        ),
        (
            [0, 7],
            None,
            {"cp_size": 2},
            r"slot 0 length \(cu_seqlens\[1\] - cu_seqlens\[0\] = 7\): expected a multiple of 2\*cp_size = 4",
        ),
        (
            [0, 3, 5],
            [0, 4, 8],
            {"num_rows": 6},
            r"validate: num_rows \(=6\) < cu_seqlens_padded\[-1\] \(=8\)",
        ),
        (
            [0, 3],
            [0, 4],
            {"num_rows": 6, "cp_size": 2},
            r"validate: num_rows \(=6\): expected a multiple of 2\*cp_size",
        ),
        ([0, 3], [0, 4], {"num_rows": -1}, r"validate: num_rows: expected an int >= 0, got -1"),
        ([0, 3], [0, 4], {"cp_size": 0}, r"validate: cp_size: expected an int >= 1, got 0"),
    ],
)
def test_rejects_bad_layout(
    cu: list[int], cup: list[int] | None, kwargs: dict[str, int], message: str
) -> None:
    with pytest.raises(ThdValueError, match=message):
        validate(_i32(cu), None if cup is None else _i32(cup), **kwargs)  # type: ignore[arg-type]


def test_rejects_wrong_dtype_and_shape() -> None:
    with pytest.raises(
        ThdTypeError, match=r"validate: cu_seqlens dtype: expected torch\.int32, got torch\.int64"
    ):
        validate(torch.tensor([0, 3]))
    with pytest.raises(ThdTypeError, match=r"validate: cu_seqlens_padded dtype: expected torch\.int32"):
        validate(_i32([0, 3]), torch.tensor([0.0, 4.0]))
    with pytest.raises(ThdTypeError, match=r"validate: cu_seqlens: expected a torch\.Tensor, got list"):
        validate([0, 3])  # type: ignore[arg-type]
    with pytest.raises(
        ThdValueError, match=r"validate: cu_seqlens shape: expected \[B\+1\] with B >= 0, got \[1, 2\]"
    ):
        validate(_i32([[0, 3]]))
    with pytest.raises(ThdValueError, match=r"got \[0\]"):
        validate(_i32([]))
    # Type errors are also the builtin types, for callers that catch those.
    with pytest.raises(TypeError):
        validate(torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        validate(_i32([1, 3]))


def test_validate_reads_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    tolist = torch.Tensor.tolist

    def counting_tolist(self: torch.Tensor) -> object:
        calls.append("tolist")
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("item"))
    validate(_i32([0, 3, 5, 9]), _i32([0, 4, 8, 12]), num_rows=16, cp_size=2)
    assert calls == ["tolist"]


def test_validate_skips_values_under_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(thd._capture, "is_capturing", lambda: True)
    for name in ("item", "tolist", "cpu", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, **k: pytest.fail("host read under capture"))
    validate(_i32([0, 5, 3]), _i32([0, 4, 2]), cp_size=2)  # bad values: not read, not raised
    with pytest.raises(ThdTypeError):  # metadata checks still run
        validate(torch.tensor([0, 3]))


def test_set_validation_switches_value_checks() -> None:
    assert validation_enabled() is True
    assert set_validation(False) is True
    validate(_i32([0, 5, 3]))  # skipped
    with pytest.raises(ThdTypeError):
        validate(torch.tensor([0, 3]))
    assert set_validation(True) is False
    with pytest.raises(ThdValueError):
        validate(_i32([0, 5, 3]))


def test_validation_switch_reads_environment() -> None:
    env = {**os.environ, "THD_VALIDATE": "off", "PYTHONPATH": str(SRC)}
    code = "import thd.layout as l; print(l.validation_enabled())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_device_validation_mode_reads_environment_and_keeps_host_checks_on_cpu() -> None:
    env = {**os.environ, "THD_VALIDATE": "device", "PYTHONPATH": str(SRC)}
    code = (
        "import torch, thd.layout as l\n"
        "print(l.validation_enabled(), l.set_device_validation(True))\n"
        "try:\n"
        "    l.validate(torch.tensor([0, 5, 3], dtype=torch.int32))\n"
        "except l.ThdValueError as e:\n"
        "    print('raised', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "True True"
    assert lines[1].startswith("raised validate: cu_seqlens[2] (=3) < cu_seqlens[1] (=5)")


_DEVICE_SCRIPT = """
import sys, torch, thd.layout as l
from thd.cp import partition
l.set_device_validation(True)
good = torch.tensor([0, 3, 9], dtype=torch.int32, device="cuda")
cup = torch.tensor([0, 4, 12], dtype=torch.int32, device="cuda")
x = torch.randn(16, 2, device="cuda")
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("error")  # any host sync below raises
l.validate(good, cup, num_rows=16, cp_size=2)
partition(x, cup, 2, 1)
l.check_layout_async("attention", good, cup, num_rows=16)
torch.cuda.set_sync_debug_mode("default")
torch.cuda.synchronize()
print("valid ok", flush=True)
bad = {"slots": (good, torch.tensor([0, 2, 12], dtype=torch.int32, device="cuda")),
       "rows": (good, torch.tensor([0, 4, 20], dtype=torch.int32, device="cuda")),
       "start": (torch.tensor([1, 3, 9], dtype=torch.int32, device="cuda"), cup)}[sys.argv[1]]
torch.cuda.set_sync_debug_mode("error")
l.validate(*bad, num_rows=16, cp_size=2)
torch.cuda.set_sync_debug_mode("default")
print("enqueued", flush=True)
torch.cuda.synchronize()
print("not flagged", flush=True)
"""


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["slots", "rows", "start"])
def test_device_validation_flags_invalid_layouts_without_a_sync(case: str) -> None:
    """THD_VALIDATE=device: no host sync for any layout; an invalid one trips a device assertion."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run(
        [sys.executable, "-c", _DEVICE_SCRIPT, case], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.stdout.splitlines()[:2] == ["valid ok", "enqueued"], (done.stdout, done.stderr)
    assert "not flagged" not in done.stdout
    assert done.returncode != 0 and "device-side assert" in done.stderr, done.stderr[-2000:]


_CAPTURE_SCRIPT = """
import torch, thd.layout as l
l.set_device_validation(True)
cu = torch.tensor([0, 3, 9], dtype=torch.int32, device="cuda")
cup = torch.tensor([0, 4, 12], dtype=torch.int32, device="cuda")
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    l.validate(cu, cup, num_rows=16, cp_size=2)
graph.replay()
torch.cuda.synchronize()
print("valid replay ok", flush=True)
cup.copy_(torch.tensor([0, 2, 12], dtype=torch.int32))
graph.replay()
torch.cuda.synchronize()
print("not flagged", flush=True)
"""


@pytest.mark.gpu
def test_device_validation_is_captured_and_checks_every_replay() -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run(
        [sys.executable, "-c", _CAPTURE_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.stdout.splitlines()[:1] == ["valid replay ok"], (done.stdout, done.stderr)
    assert "not flagged" not in done.stdout
    assert done.returncode != 0 and "device-side assert" in done.stderr, done.stderr[-2000:]


# ----------------------------------------------------------------------------- pack_lengths


def test_pack_lengths_worked_example() -> None:
    layout = pack_lengths([5, 8], cp_size=2)
    assert isinstance(layout, PackedLayout)
    assert layout.cu_seqlens.tolist() == [0, 5, 13]
    assert layout.cu_seqlens_padded.tolist() == [0, 8, 16]
    assert layout.cu_seqlens.dtype == layout.cu_seqlens_padded.dtype == torch.int32
    assert layout.index.tolist() == [0, 1, 2, 3, 4, 8, 9, 10, 11, 12, 13, 14, 15]
    assert (layout.num_rows, layout.max_seqlen, layout.max_seqlen_padded) == (16, 8, 8)
    assert layout.padded_lengths == (8, 8) and layout.pad_between_seqs is True
    assert layout.valid_end == 16


def test_pack_lengths_without_cp_adds_no_padding() -> None:
    layout = pack_lengths([3, 0, 2])
    assert layout.cu_seqlens.tolist() == layout.cu_seqlens_padded.tolist() == [0, 3, 3, 5]
    assert layout.pad_between_seqs is False and layout.valid_end == 5
    slotted = pack_lengths([3, 0, 2], pad_multiple=4, num_rows=12)
    assert slotted.cu_seqlens_padded.tolist() == [0, 4, 4, 8]
    assert slotted.num_rows == 12 and slotted.valid_end == 6 and slotted.pad_between_seqs is True


def test_pack_lengths_empty_and_zero_lengths() -> None:
    empty = pack_lengths([])
    assert empty.cu_seqlens.tolist() == [0] and empty.index.tolist() == [] and empty.max_seqlen == 0
    zeros = pack_lengths([0, 0], cp_size=4, num_rows=8)
    assert zeros.cu_seqlens_padded.tolist() == [0, 0, 0] and zeros.valid_end == 0
    assert zeros.pad_between_seqs is False


def test_pack_and_unpack_round_trip() -> None:
    layout = pack_lengths([3, 1, 6], cp_size=2, num_rows=24)
    tokens = torch.arange(10 * 2, dtype=torch.float32).reshape(10, 2) + 1
    rows = layout.pack(tokens)
    assert rows.shape == (24, 2)
    assert torch.equal(layout.unpack(rows), tokens)
    assert torch.equal(rows.abs().sum(1) > 0, valid_rows(layout.cu_seqlens, layout.cu_seqlens_padded, 24))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lengths": [3, -1]}, r"pack_lengths: lengths\[1\] \(=-1\): expected >= 0"),
        (
            {"lengths": [5], "cp_size": 2, "num_rows": 4},
            r"pack_lengths: num_rows \(=4\) < cu_seqlens_padded\[-1\] \(=8\)",
        ),
        (
            {"lengths": [5], "cp_size": 2, "num_rows": 10},
            r"pack_lengths: num_rows \(=10\): expected a multiple of 2\*cp_size = 4",
        ),
        (
            {"lengths": [5], "cp_size": 2, "pad_multiple": 6},
            r"pad_multiple \(=6\): expected a multiple of 2\*cp_size = 4",
        ),
        ({"lengths": [5], "pad_multiple": 0}, r"pack_lengths: pad_multiple: expected an int >= 1, got 0"),
        ({"lengths": [5], "cp_size": -2}, r"pack_lengths: cp_size: expected an int >= 1, got -2"),
    ],
)
def test_rejects_bad_pack_arguments(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ThdValueError, match=message):
        pack_lengths(**kwargs)  # type: ignore[arg-type]


@pytest.mark.property
@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 20), max_size=8),
    cp_size=st.integers(1, 4),
    capacity=st.integers(0, 2),
)
def test_pack_lengths_produces_valid_layouts(lengths: list[int], cp_size: int, capacity: int) -> None:
    div = 2 * cp_size
    bare = pack_lengths(lengths, cp_size=cp_size)
    layout = pack_lengths(lengths, cp_size=cp_size, num_rows=bare.num_rows + div * capacity)
    validate(layout.cu_seqlens, layout.cu_seqlens_padded, num_rows=layout.num_rows, cp_size=cp_size)
    cup = layout.cu_seqlens_padded.tolist()
    for b, n in enumerate(lengths):
        slot = cup[b + 1] - cup[b]
        assert slot >= n and (cp_size == 1 or slot % div == 0) and slot - n < (div if cp_size > 1 else 1)
    mask = valid_rows(layout.cu_seqlens, layout.cu_seqlens_padded, layout.num_rows)
    assert mask.nonzero().flatten().tolist() == layout.index.tolist()
    assert layout.valid_end == (int(mask.nonzero().max()) + 1 if sum(lengths) else 0)
    assert layout.max_seqlen == max(lengths, default=0)


def test_rejects_tensors_on_different_devices() -> None:
    with pytest.raises(
        ThdValueError,
        match=r"validate: cu_seqlens_padded device: expected cpu \(same as cu_seqlens\), got meta",
    ):
        validate(_i32([0, 3]), torch.empty(2, dtype=torch.int32, device="meta"))


def test_pack_lengths_moves_tensors_to_device() -> None:
    layout = pack_lengths([2, 3], cp_size=1, device="cpu")
    assert layout.cu_seqlens.device.type == layout.index.device.type == "cpu"
