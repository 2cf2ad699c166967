"""The persistent Gluon kernels' static work order (``work_order.item_and_head``, used by the forward and
the persistent dK/dV kernel), run as plain Python with ``gl.num_programs`` stood in for: ``G``
programs each taking ``w = p, p + G, ...`` must take every (item, head) of the list exactly once,
serpentine or not, for every head section that divides the heads; within a section the items come
in the list's order (longest first) with the section's heads innermost."""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("triton.experimental.gluon")

from thd.ops.attention.gluon import work_order


def _order(programs: int) -> Callable[[int, int, int, int, int], tuple[int, int]]:
    """``item_and_head`` as a Python function on ``programs`` programs."""
    fn = work_order.item_and_head.fn
    stub = types.SimpleNamespace(num_programs=lambda axis: programs)
    return types.FunctionType(fn.__code__, {**fn.__globals__, "gl": stub}, fn.__name__)


def _taken(
    programs: int, items: int, heads: int, section: int, serpentine: int
) -> list[list[tuple[int, int]]]:
    """Per program, the (item, head) pairs it takes, in its order."""
    order, total = _order(programs), items * heads
    return [
        [order(w, total, heads, section, serpentine) for w in range(p, total, programs)]
        for p in range(programs)
    ]


@pytest.mark.parametrize("serpentine", [0, 1])
@pytest.mark.parametrize("programs", [1, 3, 7, 132])
@pytest.mark.parametrize(("items", "heads"), [(1, 1), (5, 2), (17, 4), (132, 16), (263, 12)])
def test_every_item_and_head_is_taken_once(items: int, heads: int, programs: int, serpentine: int) -> None:
    for section in (d for d in range(1, heads + 1) if heads % d == 0):
        taken = [pair for pairs in _taken(programs, items, heads, section, serpentine) for pair in pairs]
        assert sorted(taken) == [(i, h) for i in range(items) for h in range(heads)], (section, taken)


@pytest.mark.parametrize(("items", "heads", "section"), [(17, 4, 1), (17, 4, 2), (9, 6, 3), (5, 8, 8)])
def test_sections_come_one_after_another_longest_first(items: int, heads: int, section: int) -> None:
    """Without serpentine rounds, ``w`` in order walks section after section; in each, the items in
    the list's order and the section's heads innermost."""
    order = _order(1)
    walked = [order(w, items * heads, heads, section, 0) for w in range(items * heads)]
    expected = [
        (i, s * section + h) for s in range(heads // section) for i in range(items) for h in range(section)
    ]
    assert walked == expected


def test_serpentine_reverses_every_other_full_round() -> None:
    """Program ``p`` of ``G`` takes item ``G - 1 - p`` of each odd full round; a last partial round
    is not reversed."""
    programs, items = 4, 10  # one head: rounds [0, 4), [4, 8) reversed, [8, 10) partial
    taken = _taken(programs, items, 1, 1, 1)
    assert [[i for i, _ in pairs] for pairs in taken] == [[0, 7, 8], [1, 6, 9], [2, 5], [3, 4]]


BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.fixture
def document_lengths(monkeypatch: pytest.MonkeyPatch) -> Callable[[int, int, int, int], list[int]]:
    """The benchmarks' document lengths (``benchmarks/_common.py``), as the goal table draws them."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import _common

    return _common.document_lengths


def _dkdv_items(lengths: list[int], block_n: int) -> list[tuple[int, int]]:
    """The persistent dK/dV kernel's work list as ``schedule.build_work_list`` orders it: (sequence,
    blk) with blk (key tile ``tiles - 1 - blk``) highest first, sequences in order within a blk."""
    tiles = [-(-n // block_n) for n in lengths]
    return [(s, blk) for blk in range(max(tiles) - 1, -1, -1) for s, t in enumerate(tiles) if blk < t]


def _causal_work(lengths: list[int], seq: int, blk: int, block_m: int, block_n: int) -> int:
    """Query tiles a causal mask leaves under item (seq, blk): from the key tile's diagonal on."""
    n = lengths[seq]
    first_query_tile = (-(-n // block_n) - 1 - blk) * block_n // block_m
    return -(-n // block_m) - first_query_tile


LAYOUTS = [(16384, 64, 1024), (16384, 256, 4096), (32768, 512, 8192), (65536, 25000, 40000)]


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize(("tokens", "lo", "hi"), LAYOUTS)
def test_one_section_of_all_heads_balances_the_causal_backward(
    document_lengths: Callable[[int, int, int, int], list[int]], tokens: int, lo: int, hi: int, block_m: int
) -> None:
    """The persistent dK/dV kernel's static rounds (128-key items, 132 programs, 16 heads, one
    section, serpentine) give the busiest program at most 1.1x the mean causal work (query tiles
    under its key tiles) on the goal table's layouts; sections of one head give 1.87x on 32k of
    512-8192, where the H100 ran them 0.54x the per-tile programs
    (``gluon-bwd-persistent-17a7487-h100.json``)."""
    programs, heads, block_n = 132, 16, 128
    order = _order(programs)
    for seed in range(3):
        lengths = document_lengths(tokens, lo, hi, seed)
        items = _dkdv_items(lengths, block_n)
        total = len(items) * heads
        loads = [0] * programs
        for p in range(programs):
            for w in range(p, total, programs):
                seq, blk = items[order(w, total, heads, heads, 1)[0]]
                loads[p] += _causal_work(lengths, seq, blk, block_m, block_n)
        mean = sum(loads) / programs
        assert max(loads) <= 1.1 * mean, (seed, len(lengths), max(loads), mean)
