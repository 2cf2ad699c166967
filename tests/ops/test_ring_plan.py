"""``thd.ops.ring_plan.ring_plan_tables``: the kernel against the torch reference, and the
reference against per-rank :func:`thd.cp.rank_cu_seqlens` and plain Python (independent oracles)."""

from __future__ import annotations

import itertools
import os
import random

import pytest
import torch

from thd.cp.partition import rank_cu_seqlens
from thd.ops.ring_plan import ring_plan_tables
from thd.ops.ring_plan.reference import ring_plan_tables_reference

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_CUDA = torch.cuda.is_available()


def _layout(seed: int, cp: int, num_seqs: int, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random real lengths (zeros included) in slots rounded up to ``2cp``, some much longer."""
    rng = random.Random(seed)
    lens = [rng.choice([0, 1, rng.randint(0, longest)]) for _ in range(num_seqs)]
    slots = [-(-max(n, rng.choice([n, rng.randint(0, 2 * longest)])) // (2 * cp)) * 2 * cp for n in lens]
    cu, cup = [0], [0]
    for n, s in zip(lens, slots, strict=True):
        cu.append(cu[-1] + n)
        cup.append(cup[-1] + s)
    return torch.tensor(cu, dtype=torch.int32), torch.tensor(cup, dtype=torch.int32)


CASES = [
    (seed, cp, b) for seed, (cp, b) in enumerate([(1, 3), (2, 0), (2, 1), (2, 5), (3, 7), (4, 40), (8, 3)])
]


@pytest.mark.parametrize(("seed", "cp", "num_seqs"), CASES)
def test_reference_matches_rank_cu_seqlens_and_python(seed: int, cp: int, num_seqs: int) -> None:
    cu, cup = _layout(seed, cp, num_seqs, 50)
    table = ring_plan_tables_reference(cu, cup, cp, exact=True)
    assert table.dtype == torch.int32 and list(table.shape) == [3 * cp + 2, num_seqs + 2]
    for r in range(cp):
        for h, (first, second) in enumerate(((True, True), (True, False), (False, True))):
            want = rank_cu_seqlens(cu, cup, cp, r, first_half=first, second_half=second)
            assert table[h * cp + r, 0] == 0 and torch.equal(table[h * cp + r, 1:], want), (h, r)
    local = [x // cp for x in cup.tolist()]
    assert table[3 * cp].tolist() == [0, *local]
    starts = [(a + b) // 2 for a, b in itertools.pairwise(local)]
    assert table[3 * cp + 1].tolist() == [0, *starts, local[-1]]
    fast = ring_plan_tables_reference(cu, cup, cp, exact=False)
    for r in range(cp):
        assert fast[r, 1:].tolist() == [x // cp for x in cu.tolist()]
        assert (
            fast[cp + r, 1:].tolist() == fast[2 * cp + r, 1:].tolist() == [x // (2 * cp) for x in cu.tolist()]
        )


def _devices() -> list[object]:
    return [
        pytest.param("cpu", marks=pytest.mark.skipif(not _INTERPRET, reason="needs TRITON_INTERPRET=1")),
        pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not _CUDA, reason="needs CUDA")]),
    ]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "fast"])
def test_kernel_matches_reference(device: str, exact: bool) -> None:
    sizes = [*CASES, (99, 4, 3000)] if device == "cuda" else CASES  # > one 1024-wide block on GPUs
    for seed, cp, num_seqs in sizes:
        cu, cup = (t.to(device) for t in _layout(seed, cp, num_seqs, 4000 if device == "cuda" else 50))
        got = ring_plan_tables(cu, cup, cp, exact=exact)
        assert got.device == cu.device and got.dtype == torch.int32
        assert torch.equal(got.cpu(), ring_plan_tables_reference(cu.cpu(), cup.cpu(), cp, exact=exact)), (
            seed, cp, num_seqs,
        )  # fmt: skip
