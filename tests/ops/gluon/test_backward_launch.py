"""The Gluon backward's launches (``thd.ops.attention.gluon.backward.backward``), on CPU: its three
kernels are replaced by recorders. Each launch must pass every parameter of its real kernel exactly
once (positionally in the kernel's order, then by keyword), and a launch from a reused plan must be
the launch a fresh plan makes for the same call."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from tests.ops.gluon._work_list_builds import WorkListBuilds
from thd.errors import ThdValueError
from thd.ops.attention.gluon import backward as gluon_backward
from thd.ops.attention.gluon import backward_kernel, schedule, work_lists
from thd.ops.attention.params import AttentionOptions, BackwardCall, SavedForBackward, VarlenLayout

KERNELS = ("_preprocess_kernel", "_dkdv_kernel", "_dq_kernel", "_dkdv_persistent_kernel")
LAUNCH_OPTIONS = {"num_warps"}
ARG_NAMES = {name: list(getattr(backward_kernel, name).arg_names) for name in KERNELS}


class _Recorder:
    """Stands in for ``kernel[grid](*args, **kwargs)`` and keeps what it was given."""

    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def __getitem__(self, grid: tuple):  # type: ignore[no-untyped-def]
        def launch(*args: object, **kwargs: object) -> None:
            self.calls.append((self.name, grid, args, kwargs))

        return launch


@pytest.fixture(params=[False, True], ids=["per-tile", "persistent"])
def persistent(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """The dK/dV kernel run as one program per key tile, or as persistent programs on a 4-SM
    device (their work list built for real, by the interpreter)."""
    monkeypatch.setattr(gluon_backward, "PERSISTENT", request.param)
    monkeypatch.setattr(gluon_backward, "device_sms", lambda t: 4)
    return request.param


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list]:
    """The launches of every backward in the test, in order; no plan or work list cached before or
    after."""
    recorded: list = []
    for name in KERNELS:
        monkeypatch.setattr(backward_kernel, name, _Recorder(name, recorded))
    gluon_backward.PLANS.clear()
    work_lists.clear_work_lists()
    yield recorded
    gluon_backward.PLANS.clear()
    work_lists.clear_work_lists()


def _call(
    seed: int,
    lengths: tuple[int, ...],
    *,
    deterministic: bool,
    sinks: bool = False,
    head_dim: int = 64,
    max_seqlen: int | None = None,
) -> BackwardCall:
    """A backward of new tensors (new objects every time) on packed ``lengths``; ``max_seqlen``
    (default: the longest length) as both bounds."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(lengths)
    q, k, v, do, out = (torch.randn(rows, 4, head_dim, dtype=torch.bfloat16, generator=gen) for _ in range(5))
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    lse = torch.randn(4, rows, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    bound = max(lengths) if max_seqlen is None else max_seqlen
    layout = VarlenLayout(cu, cu, max_seqlen_q=bound, max_seqlen_kv=bound)
    saved = SavedForBackward(q, k, v, out, lse, torch.zeros(4) if sinks else None)
    return BackwardCall(do, saved, layout, AttentionOptions(0.125, causal=True, deterministic=deterministic))


def _shown(args: tuple) -> tuple:
    """The arguments with each tensor as (shape, stride, dtype) and int32 ones with their values."""
    return tuple(
        (a.shape, a.stride(), a.dtype, a.tolist() if a.dtype == torch.int32 else None)
        if isinstance(a, torch.Tensor)
        else a
        for a in args
    )


def _launches(calls: list, call: BackwardCall) -> list:
    """The launches of one backward as (kernel, grid, keywords, shown arguments)."""
    start = len(calls)
    gluon_backward.backward(call)
    return [(name, grid, kwargs, _shown(args)) for name, grid, args, kwargs in calls[start:]]


@pytest.mark.parametrize("deterministic", [True, False], ids=["split-dq", "atomic-dq"])
def test_every_launch_passes_every_kernel_parameter(
    calls: list, deterministic: bool, persistent: bool
) -> None:
    gluon_backward.backward(_call(0, (70, 130), deterministic=deterministic, sinks=True))
    names = [name for name, *_ in calls]
    dkdv = "_dkdv_persistent_kernel" if persistent else "_dkdv_kernel"
    assert names == ["_preprocess_kernel", dkdv] + (["_dq_kernel"] if deterministic else [])
    for name, _, args, kwargs in calls:
        params = ARG_NAMES[name]
        assert sorted(params[len(args) :]) == sorted(set(kwargs) - LAUNCH_OPTIONS), name
        assert set(kwargs) >= LAUNCH_OPTIONS


@pytest.mark.parametrize("persistent", [True], ids=["persistent"], indirect=True)
def test_work_list_launch_passes_every_parameter_of_its_kernel(
    calls: list, persistent: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The persistent dK/dV programs' work list: every constexpr by keyword, its order stated (until
    the twenty-second session it left ``SEQUENCE_MAJOR`` out, which sent every launch of the list
    down Triton's normal path while the cached launcher took no defaults)."""
    builds = WorkListBuilds()
    monkeypatch.setattr(schedule, "build_work_list", builds)
    gluon_backward.backward(_call(0, (70, 130), deterministic=False))
    ((args, kwargs),) = builds.given
    names = list(builds.real.arg_names)
    assert sorted(names[len(args) :]) == sorted(set(kwargs) - LAUNCH_OPTIONS)
    assert kwargs["SEQUENCE_MAJOR"] is False  # the kernel's order: longest tile index first


@pytest.mark.parametrize("deterministic", [True, False], ids=["split-dq", "atomic-dq"])
def test_a_call_with_new_tensors_of_the_same_shapes_reuses_the_plan(
    calls: list, deterministic: bool, persistent: bool
) -> None:
    """Oracle: the launches a fresh plan makes for the same call (plans cleared first)."""
    _launches(calls, _call(0, (70, 130), deterministic=deterministic))
    assert len(gluon_backward.PLANS) == 1
    second = _call(1, (130, 70), deterministic=deterministic)  # other offsets' values, same key
    reused = _launches(calls, second)
    assert len(gluon_backward.PLANS) == 1
    gluon_backward.PLANS.clear()
    assert reused == _launches(calls, second)


def test_other_calls_make_their_own_plan(calls: list, persistent: bool) -> None:
    base = _launches(calls, _call(0, (70, 130), deterministic=True))
    for other in (
        _call(0, (70, 130), deterministic=False),  # dQ added by the dK/dV kernel
        _call(0, (70, 130), deterministic=True, sinks=True),
        _call(0, (70, 131), deterministic=True),  # other shapes and bounds
    ):
        launches = _launches(calls, other)
        assert launches != base
        gluon_backward.PLANS.clear()
        assert launches == _launches(calls, other)
    call = _call(0, (70, 130), deterministic=True)
    window = call._replace(
        options=AttentionOptions(0.125, causal=True, window_size=(16, 0), deterministic=True)
    )
    assert _launches(calls, window) != base
    assert len(gluon_backward.PLANS) == 2


def _cross_call(lengths_q: tuple[int, ...], lengths_kv: tuple[int, ...], slots: bool) -> BackwardCall:
    """A backward of ``q`` rows of ``lengths_q`` against ``k, v`` rows of ``lengths_kv``; with
    ``slots``, every key slot 9 rows longer than its sequence and 5 spare rows after the last."""
    gen = torch.Generator().manual_seed(0)
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_kv = torch.tensor([0, *torch.tensor(lengths_kv).cumsum(0).tolist()], dtype=torch.int32)
    slots_kv = cu_kv + 9 * torch.arange(len(lengths_kv) + 1, dtype=torch.int32) if slots else None
    rows_q, rows_kv = int(cu_q[-1]), int(cu_kv[-1]) + (9 * len(lengths_kv) + 5 if slots else 0)
    q, do, out = (torch.randn(rows_q, 4, 64, dtype=torch.bfloat16, generator=gen) for _ in range(3))
    k, v = (torch.randn(rows_kv, 2, 64, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    layout = VarlenLayout(
        cu_q,
        cu_kv,
        cu_q if slots else None,
        slots_kv,
        max_seqlen_q=max(lengths_q),
        max_seqlen_kv=max(lengths_kv),
    )
    saved = SavedForBackward(q, k, v, out, torch.randn(4, rows_q, generator=gen), None)
    return BackwardCall(do, saved, layout, AttentionOptions(0.125, causal=True))


@pytest.mark.parametrize("tiles", ["two-partitions", "one-partition"])
@pytest.mark.parametrize("slots", [False, True])
@pytest.mark.parametrize("persistent", [True], ids=["persistent"], indirect=True)
def test_persistent_work_list_holds_every_key_tile_once(
    calls: list, persistent: bool, slots: bool, tiles: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Oracle: the key tiles of 128 rows of each key sequence, counted from the lengths (the query
    sequences differ; the one-partition tile has 64-row query tiles). The persistent kernel gets
    the list of (sequence, tile) items longest first and at most one program per SM."""
    if tiles == "one-partition":
        monkeypatch.setattr(gluon_backward, "TILES", dict(gluon_backward.ONE_CONSUMER_TILES))
    lengths_kv = (70, 300, 0, 129)
    gluon_backward.backward(_cross_call((500, 10, 3, 200), lengths_kv, slots))
    ((grid, args, kwargs),) = [(g, a, k) for name, g, a, k in calls if name == "_dkdv_persistent_kernel"]
    names = ARG_NAMES["_dkdv_persistent_kernel"]
    seq, blk, count = (args[names.index(name)] for name in ("seq_ptr", "blk_ptr", "count_ptr"))
    tiles_per_sequence = [(length + 127) // 128 for length in lengths_kv]
    items = [(int(b), int(t)) for b, t in zip(seq[: int(count[0])], blk[: int(count[0])], strict=True)]
    assert sorted(items) == [(b, t) for b, n in enumerate(tiles_per_sequence) for t in range(n)]
    assert [t for _, t in items] == sorted((t for _, t in items), reverse=True)  # longest first
    assert grid == (4,)
    assert kwargs["SLOTS"] is slots
    assert args[names.index("num_kv_heads")] == 2 and args[names.index("num_seqs")] == len(lengths_kv)


@pytest.mark.parametrize(
    ("head_dim", "max_seqlen", "expected"),
    [(64, 1024, True), (64, 2048, True), (64, 2049, False), (64, 8192, False), (128, 1024, False)],
)
def test_default_tiles_take_persistent_programs_on_short_documents_at_head_dim_64(
    calls: list, monkeypatch: pytest.MonkeyPatch, head_dim: int, max_seqlen: int, expected: bool
) -> None:
    """With ``PERSISTENT`` unset, the default tiles choose: persistent dK/dV programs at head dim 64
    up to 2048 key rows per sequence (measured faster there), one program per key tile elsewhere."""
    monkeypatch.setattr(gluon_backward, "PERSISTENT", None)
    monkeypatch.setattr(gluon_backward, "device_sms", lambda t: 4)
    gluon_backward.backward(
        _call(0, (70, 130), deterministic=False, head_dim=head_dim, max_seqlen=max_seqlen)
    )
    dkdv = [name for name, *_ in calls if name.startswith("_dkdv")]
    assert dkdv == ["_dkdv_persistent_kernel" if expected else "_dkdv_kernel"]


@pytest.mark.parametrize("ticket", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("persistent", [True], ids=["persistent"], indirect=True)
def test_persistent_order_reaches_the_kernel(
    calls: list, persistent: bool, ticket: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``DYNAMIC_ORDER`` becomes the kernel's ``DYNAMIC``; serpentine rounds only in the static
    order; the ticket the dynamic programs draw from (``count[1]``, their done count ``count[2]``)
    starts at zero, as the list's builder leaves it."""
    monkeypatch.setattr(gluon_backward, "DYNAMIC_ORDER", ticket)
    gluon_backward.backward(_cross_call((500, 10, 3, 200), (70, 300, 0, 129), True))
    ((args, kwargs),) = [(a, k) for name, _, a, k in calls if name == "_dkdv_persistent_kernel"]
    names = ARG_NAMES["_dkdv_persistent_kernel"]
    tile = gluon_backward.TILES[("dkdv", 64)]
    assert kwargs["DYNAMIC"] is ticket
    assert args[names.index("serpentine")] == int(tile.serpentine and not ticket)
    count = args[names.index("count_ptr")]
    assert int(count[0]) == 6 and count[1:3].tolist() == [0, 0]  # key tiles: 1 + 3 + 0 + 2


@pytest.mark.parametrize("deterministic", [True, False], ids=["split-dq", "atomic-dq"])
def test_softcap_reaches_every_kernel_that_computes_scores(
    calls: list, deterministic: bool, persistent: bool
) -> None:
    """Oracle: the call's options. The kernels get ``SOFTCAP`` and the cap's value in their
    ``softcap`` parameter; a call without softcap passes ``SOFTCAP=False``."""
    plain = _call(0, (70, 130), deterministic=deterministic)
    capped = plain._replace(
        options=AttentionOptions(0.125, causal=True, softcap=30.0, deterministic=deterministic)
    )
    for call, expected in ((plain, False), (capped, True)):
        for name, _, kwargs, args in _launches(calls, call):
            if name == "_preprocess_kernel":
                continue
            assert kwargs["SOFTCAP"] is expected, name
            if expected:
                assert args[ARG_NAMES[name].index("softcap")] == 30.0, name


def test_softcap_takes_64_query_dkdv_tiles_at_head_dim_64(monkeypatch: pytest.MonkeyPatch) -> None:
    """Oracle: the tile table. With softcap the two-partition dK/dV tile of head dim 64 (128
    queries) takes 64 queries, the same object on every call (plans compare tiles by identity);
    head dim 128 (64 already) and the one-partition tiles are left as they are."""
    table = gluon_backward.TWO_CONSUMER_TILES
    monkeypatch.setattr(gluon_backward, "TILES", dict(table))
    assert table[("dkdv", 64)].block_m == 128
    dkdv, dq = gluon_backward.tiles_for(64, softcap=True)
    assert dkdv.block_m == 64 and dkdv.block_n == table[("dkdv", 64)].block_n and dq is table[("dq", 64)]
    assert dkdv.persistent_up_to == table[("dkdv", 64)].persistent_up_to
    assert gluon_backward.tiles_for(64, softcap=True)[0] is dkdv
    assert gluon_backward.tiles_for(64, softcap=False)[0] is table[("dkdv", 64)]
    assert gluon_backward.tiles_for(128, softcap=True)[0] is table[("dkdv", 128)]
    monkeypatch.setattr(gluon_backward, "TILES", dict(gluon_backward.ONE_CONSUMER_TILES))
    assert gluon_backward.tiles_for(64, softcap=True)[0] is gluon_backward.ONE_CONSUMER_TILES[("dkdv", 64)]


@pytest.mark.parametrize("deterministic", [True, False], ids=["split-dq", "atomic-dq"])
def test_dq_rows_reach_the_dkdv_kernel_where_it_adds_dq(
    calls: list, deterministic: bool, persistent: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Oracle: the tile and the dQ path. A two-partition tile with ``dq_rows`` has the dK/dV kernel
    split dQ by query rows where that kernel adds dQ (the atomic path), not where dQ has its own
    kernel; a tile without it passes ``DQ_ROWS=False``."""
    table = dict(gluon_backward.TWO_CONSUMER_TILES)
    table[("dkdv", 64)] = replace(table[("dkdv", 64)], dq_rows=False)
    monkeypatch.setattr(gluon_backward, "TILES", table)
    call = _call(0, (70, 130), deterministic=deterministic)
    dkdv = "_dkdv_persistent_kernel" if persistent else "_dkdv_kernel"
    (plain,) = [kwargs for name, _, kwargs, _ in _launches(calls, call) if name == dkdv]
    assert plain["DQ_ROWS"] is False
    table[("dkdv", 64)] = replace(table[("dkdv", 64)], dq_rows=True)
    gluon_backward.PLANS.clear()
    (rows,) = [kwargs for name, _, kwargs, _ in _launches(calls, call) if name == dkdv]
    assert rows["DQ_ROWS"] is (not deterministic) and rows["BLOCK_M"] == 128


def test_dq_rows_need_two_partitions_of_128_query_tiles() -> None:
    tile = gluon_backward.GluonTile(128, 128, consumers=2, dq_rows=True)
    assert tile.dq_rows
    for block_m, consumers in ((64, 2), (128, 1)):
        with pytest.raises(ThdValueError, match=rf"dq_rows: .*consumers={consumers}, block_m={block_m}"):
            gluon_backward.GluonTile(block_m, 128, consumers=consumers, dq_rows=True)
