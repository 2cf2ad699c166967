"""A model of the two-partition dK/dV programs' barrier protocol for dQ, run on every interleaving
a random scheduler picks: no deadlock, no dS^T buffer overwritten before both partitions' dQ
products read it, no dQ product reading a buffer before both halves are stored.

The model follows ``backward_kernel._dkdv_key_tile``: the producer fills ``NUM_STAGES`` stages
(``ready`` / ``empty``); per query tile ``it`` each partition waits for its stage, waits (from
``it = 2``) until both partitions' dQ products of tile ``it - 2`` have read dS^T buffer ``it % 2``,
stores its half and arrives on that buffer's ``full`` barrier; then it waits for the previous
tile's ``full`` barrier, runs that tile's dQ product, arrives on its ``read`` barrier and releases
its stage; the last query tile's dQ runs after the loop. Parities are the kernel's. The GPU tests
(``test_backward_gpu.py``) check the kernel itself; this checks the protocol they rely on (a first
version of it, arriving on the wrong tile's ``read`` barrier, deadlocked on the GPU and fails here).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

Wait = tuple[str, int, int]  # (barrier kind, index, parity)


class _Barriers:
    """mbarriers: a phase completes after ``count`` arrivals; ``wait(parity)`` passes once the
    phase of that parity has completed (the current phase's parity differs)."""

    def __init__(self, counts: dict[str, int], sizes: dict[str, int]) -> None:
        self.count = counts
        self.arrivals = {(kind, i): 0 for kind, n in sizes.items() for i in range(n)}
        self.completed = dict.fromkeys(self.arrivals, 0)

    def arrive(self, kind: str, index: int) -> None:
        key = (kind, index)
        self.arrivals[key] += 1
        if self.arrivals[key] == self.count[kind]:
            self.arrivals[key] = 0
            self.completed[key] += 1

    def passes(self, wait: Wait) -> bool:
        kind, index, parity = wait
        return (self.completed[(kind, index)] & 1) != parity


def _run(key_tiles: list[int], stages: int, seed: int, mutation: str = "") -> str:
    """``"ok"``, or the deadlock or race found; ``mutation`` breaks the protocol on purpose:
    ``"wrong-read-arrival"`` (the first GPU version) or ``"no-read-wait"``."""
    bars = _Barriers(
        counts={"ready": 1, "empty": 2, "full": 2, "read": 2},
        sizes={"ready": stages, "empty": stages, "full": 2, "read": 2},
    )
    stored: dict[int, list[int | None]] = {0: [None, None], 1: [None, None]}  # buffer -> tile per half
    dq_done: set[tuple[int, int]] = set()  # (partition, tile)
    total = sum(key_tiles)

    def producer() -> Iterator[Wait | None]:
        for it in range(total):
            yield ("empty", it % stages, ((it // stages) & 1) ^ 1)
            bars.arrive("ready", it % stages)

    def dq_product(wg: int, tile: int, it: int) -> Iterator[Wait | None]:
        yield ("full", tile % 2, (tile // 2) & 1)
        assert stored[tile % 2] == [tile, tile], (
            f"partition {wg} read buffer {tile % 2} for tile {tile}: {stored}"
        )
        yield None  # the product runs
        dq_done.add((wg, tile))
        bars.arrive("read", (it if mutation == "wrong-read-arrival" else tile) % 2)

    def consumer(wg: int) -> Iterator[Wait | None]:
        it = 0
        for query_tiles in key_tiles:
            pending = -1
            for _ in range(query_tiles):
                yield ("ready", it % stages, (it // stages) & 1)
                if it >= 2 and mutation != "no-read-wait":
                    yield ("read", it % 2, ((it // 2) & 1) ^ 1)
                    assert {(0, it - 2), (1, it - 2)} <= dq_done, f"buffer {it % 2} overwritten at tile {it}"
                stored[it % 2][wg] = it
                bars.arrive("full", it % 2)
                yield None  # dK product
                if pending >= 0:
                    yield from dq_product(wg, pending, it)
                pending = it
                bars.arrive("empty", it % stages)
                it += 1
            if pending >= 0:
                yield from dq_product(wg, pending, pending)

    agents = {"producer": producer(), 0: consumer(0), 1: consumer(1)}
    blocked: dict[object, Wait | None] = dict.fromkeys(agents)
    rng = random.Random(seed)
    while agents:
        runnable = [name for name in agents if blocked[name] is None or bars.passes(blocked[name])]  # type: ignore[arg-type]
        if not runnable:
            return f"deadlock: {blocked}"
        name = rng.choice(runnable)
        try:
            blocked[name] = next(agents[name])
        except StopIteration:
            del agents[name]
        except AssertionError as race:
            return f"race: {race}"
    return "ok"


def _layouts(count: int) -> Iterator[tuple[list[int], int]]:
    rng = random.Random(0)
    for seed in range(count):
        yield [rng.randint(1, 6) for _ in range(rng.randint(1, 3))], seed


@pytest.mark.parametrize("stages", [2, 3])
def test_protocol_has_no_deadlock_and_no_race(stages: int) -> None:
    for key_tiles, seed in _layouts(600):
        assert _run(key_tiles, stages, seed) == "ok", (key_tiles, seed)


@pytest.mark.parametrize("mutation", ["wrong-read-arrival", "no-read-wait"])
def test_the_model_catches_a_broken_protocol(mutation: str) -> None:
    outcomes = [_run(key_tiles, 2, seed, mutation) for key_tiles, seed in _layouts(60)]
    assert any(outcome != "ok" for outcome in outcomes)
