"""The Gluon forward's launch (``thd.ops.attention.gluon.forward.forward``), on CPU: the kernel is
replaced by a recorder, and the launch must pass every parameter of the real kernel exactly once
(positionally in the kernel's order, then by keyword), so a parameter added to the kernel but not
to the launch fails here instead of on the GPU."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from tests.ops.gluon._work_list_builds import WorkListBuilds
from thd.ops.attention.gluon import forward as gluon_forward
from thd.ops.attention.gluon import forward_kernel, schedule, work_lists
from thd.ops.attention.params import AttentionOptions, ForwardCall, VarlenLayout

LAUNCH_OPTIONS = {"num_warps", "maxnreg"}
WORK_LIST_AT = list(forward_kernel.attention_fwd_kernel.arg_names).index("seq_ptr")
"""Where the work list (``seq, blk, count``) sits in the kernel's arguments."""


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


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    """The kernel replaced by a recorder on a 4-SM device, with no plan cached before or after."""
    recorder = _Recorder()
    monkeypatch.setattr(forward_kernel, "attention_fwd_kernel", recorder)
    monkeypatch.setattr(gluon_forward, "num_sms", lambda index: 4)
    monkeypatch.setattr(gluon_forward, "device_index", lambda device: 0)
    gluon_forward.PLANS.clear()
    work_lists.clear_work_lists()
    yield recorder
    gluon_forward.PLANS.clear()
    work_lists.clear_work_lists()


def _batch(seed: int, lengths: tuple[int, ...], head_dim: int = 128) -> tuple[torch.Tensor, ...]:
    """New ``q, k, v`` and offsets of ``lengths`` (new tensor objects every time)."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(lengths)
    q, k, v = (torch.randn(rows, 4, head_dim, dtype=torch.bfloat16, generator=gen) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def _launch_of(recorder: _Recorder, q, k, v, cu, options: AttentionOptions) -> tuple:  # type: ignore[no-untyped-def]
    """The recorded launch of one forward: grid, keywords, the arguments with each tensor as
    (shape, stride, dtype, values of the int32 ones: the work list up to its count), and the
    identities of the launch's inputs and offsets beside the call's."""
    gluon_forward.forward(ForwardCall(q, k, v, VarlenLayout(cu, cu), options))
    grid, args, kwargs = recorder.calls[-1]
    seq_at = WORK_LIST_AT
    count = int(args[seq_at + 2][0])
    shown = tuple(
        (a.shape, a.stride(), a.dtype, a.tolist()[: count if seq_at <= i < seq_at + 2 else None])
        if isinstance(a, torch.Tensor) and a.dtype == torch.int32
        else (a.shape, a.stride(), a.dtype)
        if isinstance(a, torch.Tensor)
        else a
        for i, a in enumerate(args)
    )
    identities = tuple(id(a) for a in args[:3]) + (id(args[6]),)
    return grid, kwargs, shown, identities, (id(q), id(k), id(v), id(cu))


def test_a_call_with_new_tensors_of_the_same_shapes_reuses_the_plan(recorded: _Recorder) -> None:
    """Oracle: the launch a fresh plan makes for the same call (plans cleared first)."""
    options = AttentionOptions(128**-0.5, causal=True)
    _launch_of(recorded, *_batch(0, (70, 130)), options)
    assert len(gluon_forward.PLANS) == 1
    second = _batch(1, (150, 50))  # other offsets' values, same length: the plan's key is equal
    reused = _launch_of(recorded, *second, options)
    assert len(gluon_forward.PLANS) == 1
    gluon_forward.PLANS.clear()
    fresh = _launch_of(recorded, *second, options)
    assert reused == fresh
    assert reused[3] == reused[4]  # the launch took this call's inputs and offsets


@pytest.mark.parametrize(
    "change",
    [
        {"softcap": 30.0},
        {"window_size": (64, 0)},
        {"softmax_scale": 0.25},
    ],
    ids=["softcap", "window", "scale"],
)
def test_other_options_make_their_own_plan(recorded: _Recorder, change: dict) -> None:
    base = {"softmax_scale": 128**-0.5, "causal": True}
    q, k, v, cu = _batch(0, (70, 130))
    first = _launch_of(recorded, q, k, v, cu, AttentionOptions(**base))
    options = AttentionOptions(**{**base, **change})
    changed = _launch_of(recorded, q, k, v, cu, options)
    assert len(gluon_forward.PLANS) == 2
    assert changed[:3] != first[:3]
    gluon_forward.PLANS.clear()
    assert changed == _launch_of(recorded, q, k, v, cu, options)


def test_a_changed_tile_table_makes_a_new_plan(recorded: _Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    options = AttentionOptions(128**-0.5, causal=True)
    batch = _batch(0, (70, 130))
    _launch_of(recorded, *batch, options)
    other = gluon_forward.GluonTile(64, 64, 4, 2, consumers=1)
    monkeypatch.setitem(gluon_forward.TILES, 128, other)
    _, kwargs, *_ = _launch_of(recorded, *batch, options)
    assert (kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["NUM_WG"]) == (64, 64, 1)


def test_a_zero_scale_is_never_cached(recorded: _Recorder) -> None:
    """0.0 and -0.0 are equal options but not one scale: each call launches with its own sign."""
    batch = _batch(0, (70, 130))
    for scale in (0.0, -0.0, 0.0):
        _launch_of(recorded, *batch, AttentionOptions(scale, causal=True))
        assert len(gluon_forward.PLANS) == 0
        passed = next(a for a in recorded.calls[-1][1] if isinstance(a, float))  # the first float: the scale
        assert math.copysign(1.0, passed) == math.copysign(1.0, scale)


@pytest.mark.parametrize(
    ("heads", "max_seqlen", "head_dim", "packed"),
    [
        ((8, 2), 64, 128, True),  # group 4, every sequence within half a tile
        ((4, 2), 40, 128, True),
        ((6, 2), 64, 128, False),  # group 3: no pair of heads
        ((8, 2), 65, 128, False),  # a sequence longer than half a tile
        ((8, 2), None, 128, False),  # no stated bound
        ((4, 4), 64, 128, False),  # no GQA
        ((8, 2), 64, 64, False),  # the head-dim-64 tile has three consumer warpgroups
        ((8, 2), 64, 256, False),  # not with the head-dim-256 tile
    ],
)
def test_gqa_row_packing_takes_pairs_of_heads_on_short_sequences(
    recorded: _Recorder, heads: tuple[int, int], max_seqlen: int | None, head_dim: int, packed: bool
) -> None:
    """Packed: ``PACK = 2``, the work list in half-tile query tiles (its count, the oracle: the
    sequences' tiles of ``block_m / 2`` rows), half the heads as units in the grid, a producer of 32
    registers; else the plain launch."""
    lengths = (40, 64, 1, 33)
    cu = torch.tensor([0, 40, 104, 105, 138], dtype=torch.int32)
    q = torch.randn(138, heads[0], head_dim, dtype=torch.bfloat16)
    k, v = (torch.randn(138, heads[1], head_dim, dtype=torch.bfloat16) for _ in range(2))
    layout = VarlenLayout(cu, cu, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
    gluon_forward.forward(ForwardCall(q, k, v, layout, AttentionOptions(0.1, causal=True)))
    ((grid, args, kwargs),) = recorded.calls
    tile = gluon_forward.TILES[head_dim]
    tile_m = tile.block_m // (2 if packed else 1)
    assert kwargs["PACK"] == (2 if packed else 1)
    assert int(args[WORK_LIST_AT + 2][0]) == sum(-(-n // tile_m) for n in lengths)
    capacity = args[WORK_LIST_AT].shape[0]
    assert grid == (min(4, capacity * heads[0] // kwargs["PACK"]),)
    assert kwargs["PRODUCER_REGS"] == (32 if packed else tile.producer_regs)


def test_wait_profile_launch_differs_from_the_plain_launch_only_in_the_profile(
    recorded: _Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``WAIT_PROFILE`` set: the same grid and arguments, ``PROFILE`` on with the buffer as
    ``prof_ptr`` and at least 32 producer registers (its counters); unset: profile off."""
    q, k, v, cu = _batch(0, (70, 130))
    call = ForwardCall(q, k, v, VarlenLayout(cu, cu), AttentionOptions(0.1, causal=True))
    gluon_forward.forward(call)
    buffer = torch.zeros(3, 16, dtype=torch.int64)
    monkeypatch.setattr(gluon_forward, "WAIT_PROFILE", buffer)
    gluon_forward.forward(call)
    (grid, args, plain), (grid_p, args_p, profiled) = recorded.calls
    assert plain["PROFILE"] is False and args[-1] is None  # prof_ptr, the last plain parameter
    assert profiled["PROFILE"] is True and args_p[-1] is buffer
    assert profiled["PRODUCER_REGS"] == max(plain["PRODUCER_REGS"], 32)
    assert grid_p == grid and len(args_p) == len(args)
    scalars = [(a, b) for a, b in zip(args_p[:-1], args[:-1], strict=True) if not isinstance(a, torch.Tensor)]
    assert all(a == b for a, b in scalars) and scalars  # the plain launch's sizes, strides and options
    same = {key for key in plain if key not in {"PROFILE", "PRODUCER_REGS"}}
    assert all(profiled[key] == plain[key] for key in same)


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> WorkListBuilds:
    counting = WorkListBuilds()
    monkeypatch.setattr(schedule, "build_work_list", counting)
    return counting


def _work_list_of(recorded: _Recorder) -> tuple:
    args = recorded.calls[-1][1]
    return args[WORK_LIST_AT : WORK_LIST_AT + 3]


@pytest.mark.parametrize("sequence_major", [False, True])
def test_work_list_launch_passes_every_parameter_of_its_kernel(
    recorded: _Recorder, builds: WorkListBuilds, monkeypatch: pytest.MonkeyPatch, sequence_major: bool
) -> None:
    """Every constexpr by keyword, the list's order as the plan chose it (the backward's list once
    left ``SEQUENCE_MAJOR`` to its default)."""
    monkeypatch.setattr(gluon_forward, "SEQUENCE_MAJOR", sequence_major)
    q, k, v, cu = _batch(0, (70, 130))
    gluon_forward.forward(ForwardCall(q, k, v, VarlenLayout(cu, cu), AttentionOptions(0.1, causal=True)))
    ((args, kwargs),) = builds.given
    names = list(builds.real.arg_names)
    assert sorted(names[len(args) :]) == sorted(set(kwargs) - LAUNCH_OPTIONS)
    assert kwargs["SEQUENCE_MAJOR"] is sequence_major


def test_work_list_is_built_once_for_the_same_unchanged_offsets(
    recorded: _Recorder, builds: WorkListBuilds
) -> None:
    """The same offset tensors again: no second build, the very same list; offsets written in
    place, or equal values in new tensors: built again, with the count of the new values."""
    q, k, v, cu = _batch(0, (70, 130))
    call = ForwardCall(q, k, v, VarlenLayout(cu, cu), AttentionOptions(0.1, causal=True))
    gluon_forward.forward(call)
    first = _work_list_of(recorded)
    gluon_forward.forward(call)
    assert builds.launches == 1
    assert all(a is b for a, b in zip(_work_list_of(recorded), first, strict=True))
    cu[1:] = torch.tensor([10, 200], dtype=torch.int32)  # in place: the version moves
    gluon_forward.forward(call)
    assert builds.launches == 2
    assert int(_work_list_of(recorded)[2][0]) == 1 + 2  # 10 rows: one tile; 190 rows: two
    same_values = cu.clone()
    gluon_forward.forward(call._replace(layout=VarlenLayout(same_values, same_values)))
    assert builds.launches == 3
    assert work_lists.work_list_counts["hits"] >= 1


def test_sequence_major_lists_are_their_own_list(
    recorded: _Recorder, builds: WorkListBuilds, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``SEQUENCE_MAJOR``: the kernel reads the list sequence by sequence (oracle: the lengths in
    128-row tiles), built apart from the longest-first list of the same offsets, each then reused."""
    q, k, v, cu = _batch(0, (300, 130))
    call = ForwardCall(q, k, v, VarlenLayout(cu, cu), AttentionOptions(0.1, causal=True))

    def items() -> list[tuple[int, int]]:
        seq, blk, count = _work_list_of(recorded)
        return list(zip(seq[: int(count[0])].tolist(), blk[: int(count[0])].tolist(), strict=True))

    gluon_forward.forward(call)
    assert items() == [(0, 2), (0, 1), (1, 1), (0, 0), (1, 0)]  # 3 and 2 tiles, longest first
    monkeypatch.setattr(gluon_forward, "SEQUENCE_MAJOR", True)
    gluon_forward.PLANS.clear()
    gluon_forward.forward(call)
    assert items() == [(0, 2), (0, 1), (0, 0), (1, 1), (1, 0)]
    gluon_forward.forward(call)
    assert builds.launches == 2
    monkeypatch.setattr(gluon_forward, "SEQUENCE_MAJOR", None)
    gluon_forward.PLANS.clear()
    gluon_forward.forward(call)
    assert builds.launches == 2 and items()[2] == (1, 1)  # the first list, from the cache


def test_work_list_is_built_every_time_under_capture_and_for_inference_tensors(
    recorded: _Recorder, builds: WorkListBuilds, monkeypatch: pytest.MonkeyPatch
) -> None:
    q, k, v, cu = _batch(0, (70, 130))
    call = ForwardCall(q, k, v, VarlenLayout(cu, cu), AttentionOptions(0.1, causal=True))
    monkeypatch.setattr(work_lists, "is_capturing", lambda: True)
    gluon_forward.forward(call)
    gluon_forward.forward(call)
    assert builds.launches == 2
    monkeypatch.setattr(work_lists, "is_capturing", lambda: False)
    with torch.inference_mode():
        frozen = cu.clone()
    call = call._replace(layout=VarlenLayout(frozen, frozen))
    gluon_forward.forward(call)
    gluon_forward.forward(call)
    assert builds.launches == 4


@pytest.mark.parametrize(
    ("wanted", "tile_section", "units", "expected"),
    [
        (None, 0, 16, 16),
        (None, 1, 16, 1),
        (None, 4, 6, 3),
        (0, 1, 16, 16),
        (4, 0, 16, 4),
        (3, 1, 16, 2),
        (5, 0, 6, 3),
        (1, 0, 7, 1),
        (8, 0, 7, 7),
    ],
)
def test_head_section_is_the_largest_divisor_up_to_the_setting(
    monkeypatch: pytest.MonkeyPatch, wanted: int | None, tile_section: int, units: int, expected: int
) -> None:
    """The setting where given (0: every head), else the tile's; always a divisor of ``units``."""
    monkeypatch.setattr(gluon_forward, "HEAD_SECTION", wanted)
    tile = gluon_forward.GluonTile(128, 128, 4, 2, head_section=tile_section)
    assert gluon_forward.head_section(units, tile) == expected


@pytest.mark.parametrize(
    ("dynamic", "serpentine", "tile", "expected"),
    [
        (None, None, {"dynamic": True, "serpentine": True}, (True, False)),
        (None, None, {"serpentine": True}, (False, True)),
        (False, None, {"dynamic": True, "serpentine": True}, (False, True)),
        (None, False, {"serpentine": True}, (False, False)),
        (True, True, {}, (True, False)),
    ],
)
def test_work_order_is_the_settings_or_the_tiles(
    monkeypatch: pytest.MonkeyPatch,
    dynamic: bool | None,
    serpentine: bool | None,
    tile: dict,
    expected: tuple,
) -> None:
    monkeypatch.setattr(gluon_forward, "DYNAMIC_ORDER", dynamic)
    monkeypatch.setattr(gluon_forward, "SERPENTINE", serpentine)
    assert gluon_forward.work_order(gluon_forward.GluonTile(128, 128, 4, 2, **tile)) == expected


HEAD_SECTION_AT = list(forward_kernel.attention_fwd_kernel.arg_names).index("head_section")
SERPENTINE_AT = list(forward_kernel.attention_fwd_kernel.arg_names).index("serpentine")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_launch_passes_the_work_order(
    recorded: _Recorder, monkeypatch: pytest.MonkeyPatch, head_dim: int
) -> None:
    """The kernel gets the tile table's order by default (head dim 128: dynamic, one head per
    section; 64: serpentine rounds over every head) and the settings' when set."""
    options = AttentionOptions(head_dim**-0.5, causal=True)
    batch = _batch(0, (70, 130), head_dim)
    gluon_forward.forward(ForwardCall(*batch[:3], VarlenLayout(batch[3], batch[3]), options))
    monkeypatch.setattr(gluon_forward, "HEAD_SECTION", 3)
    monkeypatch.setattr(gluon_forward, "SERPENTINE", True)
    monkeypatch.setattr(gluon_forward, "DYNAMIC_ORDER", False)
    gluon_forward.PLANS.clear()
    gluon_forward.forward(ForwardCall(*batch[:3], VarlenLayout(batch[3], batch[3]), options))
    orders = [
        (args[HEAD_SECTION_AT], args[SERPENTINE_AT], kwargs["DYNAMIC"]) for _, args, kwargs in recorded.calls
    ]
    default = (1, 0, True) if head_dim == 128 else (4, 1, False)
    assert orders == [default, (2, 1, False)]


@pytest.mark.parametrize("name", ["d64-fp16", "d128-causal-bf16", "d256-causal-bf16", "d128-gqa-pack"])
def test_compile_configs_use_the_tile_tables_work_order(name: str) -> None:
    """The sm_90 compile checks (``_compile_sm90.py``, which cannot import torch) build the work
    order the host launches for their head dim."""
    from tests.ops.gluon._compile_sm90 import CONFIGS

    constexprs = CONFIGS[name].constexprs
    tile = gluon_forward.tile_for(int(constexprs["HEAD_DIM"]), int(constexprs["HEAD_DIM_V"]))
    assert constexprs["DYNAMIC"] is gluon_forward.work_order(tile)[0]
