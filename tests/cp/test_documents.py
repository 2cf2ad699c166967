"""Document-aware CP attention (thd.cp.document_attention) on spawned gloo ranks.

Each rank checks its buffer against :func:`thd.reference.attention` on the global batch
(forward, backward, variants, GQA, NaN-poisoned padding; see :mod:`tests.cp._documents_worker`).
CI runs 2 and 3 ranks; ``THD_TEST_CP_WORLDS=2,3,4,8`` runs more (8 processes on 2 cores take
minutes).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest
import torch

from tests._helpers import assert_close, assert_rows_equal, tolerance
from tests.cp._dist import spawn
from tests.cp._documents_worker import Batch, make_inputs, oracle, worker

WORLDS = [int(w) for w in os.environ.get("THD_TEST_CP_WORLDS", "2,3").split(",")]


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLDS)
def test_document_attention_matches_reference_gloo(world: int) -> None:
    # 3 batches x every variant; at 3 ranks in CI 2 batches x 2 variants (every variant locally)
    many = world == 2 or "THD_TEST_CP_WORLDS" in os.environ
    variants = (0, 1, 2, 3) if many else (1, 3)
    spawn(worker, world, 11 * world, 3 if many else 2, variants, True, timeout_s=150 + 60 * world)


# ----------------------------------------------------------------------------- ranks as threads


def _thread_batch(cp: int, tokens: int, seed: int) -> Batch:
    """1-8k-token documents (scaled by ``tokens``), one as long as all of them together (it
    rides the ring), slot padding between documents."""
    rng = random.Random(seed)
    lo, hi = max(1, tokens // 32), max(2, tokens // 4)
    short: list[int] = []
    while sum(short) < cp * tokens // 2:
        short.append(rng.randint(lo, hi))
    lengths = [*short[: len(short) // 2], sum(short), *short[len(short) // 2 :]]
    pads = [rng.choice([0, 0, 1, 7]) for _ in lengths]
    return Batch(f"threads cp={cp}", tuple(lengths), tuple(pads))


def _check_threads(
    cp: int, batch: Batch, variant, heads, device: str, dtype: torch.dtype, monkeypatch
) -> None:
    """Every rank as a thread (:mod:`tests.cp._thread_ring`): the forward through
    :func:`thd.cp.document_attention` itself (no autograd: the threads would share autograd's
    device thread), the backward as its two parts, the ring documents through the ring's own
    backward loop and the local documents through ``thd.attention``; all against the oracle."""
    import threading

    import thd
    import thd.cp.ring as ring_mod
    from tests.cp._thread_ring import run_ranks, run_ring
    from thd.cp import document_attention, document_layout, partition_documents, plan_documents
    from thd.cp.checks import check_scores
    from thd.cp.plan import PlanRequest, build_plan
    from thd.ops.attention.params import VarlenLayout

    causal, window, softcap, with_sinks = variant
    here = threading.local()
    monkeypatch.setattr(ring_mod, "resolve_group", lambda fn, group: group)
    monkeypatch.setattr(ring_mod, "ring_comm", lambda group, like: here.comm)
    monkeypatch.setattr(ring_mod, "_host_reads_allowed", lambda *args: False)  # no collectives
    plan = plan_documents(batch.lengths, cp)
    assert plan.ring_documents and any(plan.local_documents), plan
    layouts = [document_layout(plan, r, device=device, offsets=batch.offsets) for r in range(cp)]
    (q, k, v, do), sinks = make_inputs(batch, heads, 7, device, dtype)
    sinks = sinks if with_sinks else None
    want = oracle(batch, (q, k, v), do, sinks, variant, thd.attention if device == "cuda" else None)
    shards = [[partition_documents(t, lay) for t in (q, k, v, do)] for lay in layouts]
    for rank_shards, lay in zip(shards, layouts, strict=True):
        for t in rank_shards:
            t[~lay.valid] = float("nan")  # the buffer's padding is never read
    kw = {"causal": causal, "window_size": window, "softcap": softcap, "sinks": sinks}

    def forward(rank: int, comm: object) -> tuple[torch.Tensor, torch.Tensor]:
        here.comm = comm
        with torch.no_grad():
            return document_attention(*shards[rank][:3], layouts[rank], return_lse=True, **kw)

    outs, lses = zip(*run_ranks(cp, forward), strict=True)
    options = check_scores(q, {"causal": causal, "window_size": window, "softcap": softcap, "sinks": sinks})
    lay0 = layouts[0]
    ring_layout = VarlenLayout(
        lay0.ring_cu_seqlens,
        lay0.ring_cu_seqlens,
        lay0.ring_cu_seqlens_padded,
        lay0.ring_cu_seqlens_padded,
        lay0.ring_max_seqlen,
        lay0.ring_max_seqlen,
    )
    ring_plans = [
        build_plan(
            PlanRequest(
                ring_layout,
                options,
                cp_size=cp,
                cp_rank=r,
                pad_between_seqs=lay0.ring_pad_between_seqs,
                sinks=sinks is not None,
            )
        )
        for r in range(cp)
    ]
    split = plan.ring_rows
    ring = run_ring(ring_plans, [[t[:split] for t in s] for s in shards], sinks)
    dsinks = []
    for rank, lay in enumerate(layouts):
        label = f"{batch.name} rank={rank} variant={variant}"
        grads = list(ring[rank][2:5])
        if ring[rank][5] is not None:
            dsinks.append(ring[rank][5])
        if lay.has_local:
            leaves = [t[split:].detach().clone().requires_grad_() for t in shards[rank][:3]]
            s = None if sinks is None else sinks.detach().clone().requires_grad_()
            cu = lay.local_cu_seqlens
            out = thd.attention(
                *leaves, cu, cu, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                max_seqlen_q=lay.local_max_seqlen, max_seqlen_kv=lay.local_max_seqlen, **{**kw, "sinks": s},
            )  # fmt: skip
            out.backward(shards[rank][3][split:])  # NaN on its padding rows too
            grads = [torch.cat((g, leaf.grad)) for g, leaf in zip(grads, leaves, strict=True)]
            if s is not None:
                dsinks.append(s.grad)
        else:
            grads = [torch.cat((g, g.new_zeros(lay.rows - split, *g.shape[1:]))) for g in grads]
        real = lay.valid
        mine = lambda t, lay=lay: torch.where(lay.valid.view(-1, 1, 1), t[lay.index], 0.0)
        for name, g, w in zip(("out", "dq", "dk", "dv"), (outs[rank], *grads), want[:4], strict=True):
            assert_close(
                g, mine(w), f"{label}: {name}", **tolerance(dtype, "grad" if name != "out" else "out")
            )
            assert_rows_equal(g, ~real, 0.0, f"{label}: {name} padding rows")
        want_lse = torch.where(real.view(1, -1), want[5][:, lay.index], float("-inf"))
        assert_close(lses[rank], want_lse, f"{label}: lse", **tolerance(torch.float32))
    if sinks is not None:
        parts = torch.stack([d.float() for d in dsinks])
        total = parts.sum(0)
        # Each part is rounded to the sinks' dtype before the sum, and the parts cancel (a sum of
        # -p_sink * delta over rows of either sign): the error scale is sum |part|, not |total|.
        tol = tolerance(dtype, "grad")
        bound = tol["atol"] + tol["rtol"] * (want[4].float().abs() + parts.abs().sum(0))
        err = (total - want[4].float()).abs()
        assert bool((err <= bound).all()), (
            f"{batch.name}: dsinks: max error {float(err.max()):.3e}, bound there "
            f"{float(bound[err.argmax()]):.3e}; got {total.tolist()}, want {want[4].float().tolist()}"
        )


THREAD_VARIANTS = ((True, (-1, -1), 0.0, False), (True, (5, 0), 2.0, True), (False, (-1, -1), 0.0, True))


@pytest.mark.parametrize(("cp", "variant"), [(2, THREAD_VARIANTS[1]), (4, THREAD_VARIANTS[2])])
def test_document_attention_as_threads(cp: int, variant, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check on the CPU at tiny sizes (torch reference attention)."""
    monkeypatch.setenv("THD_ATTENTION_BACKEND", "reference")
    batch = _thread_batch(cp, 40, seed=cp)
    _check_threads(cp, batch, variant, (4, 2, 8, 8), "cpu", torch.float32, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_document_attention_as_threads_gpu(cp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Realistic sizes on one GPU: 16k tokens per rank, half in a document on the ring, GQA, bf16."""
    variants = ((True, (-1, -1), 0.0, False), (True, (4096, 0), 0.0, True))
    for i, variant in enumerate(variants):
        batch = _thread_batch(cp, 16384, seed=cp + i)
        _check_threads(cp, batch, variant, (16, 4, 128, 128), "cuda", torch.bfloat16, monkeypatch)


# ----------------------------------------------------------------------------- overlap


def _check_overlap_is_exact(
    cp: int, batch: Batch, variant, heads, device: str, dtype: torch.dtype, monkeypatch
) -> None:
    """Every rank's :func:`thd.cp.document_attention` forward + backward through autograd, with
    and without ``overlap`` (on CUDA: the local documents on a side stream), bitwise equal to its
    two parts run apart (``thd.cp.ring_attention`` on the ring region, ``thd.attention`` on the
    local one) under deterministic kernels; NaN-poisoned buffer padding; on CUDA the overlapped
    call synchronizes nothing with the host."""
    import thd
    from tests.cp._thread_ring import SelfComm, one_rank_ring
    from thd.cp import (
        document_attention,
        document_layout,
        partition_documents,
        plan_documents,
        ring_attention,
    )

    causal, window, softcap, with_sinks = variant
    comm: list[SelfComm] = []
    one_rank_ring(monkeypatch, lambda: comm[-1])
    plan = plan_documents(batch.lengths, cp)
    assert plan.ring_documents and any(plan.local_documents), plan
    (q, k, v, do), sinks = make_inputs(batch, heads, 5, device, dtype)
    sinks = sinks if with_sinks else None
    kw = {"causal": causal, "window_size": window, "softcap": softcap}
    split = plan.ring_rows

    def whole(lay, shards, overlap: bool) -> list[torch.Tensor | None]:
        leaves = [t.detach().clone().requires_grad_() for t in shards[:3]]
        s = None if sinks is None else sinks.detach().clone().requires_grad_()
        out, lse = document_attention(*leaves, lay, return_lse=True, overlap=overlap, sinks=s, **kw)
        grads = torch.autograd.grad(out, [*leaves, *([s] if s is not None else [])], shards[3])
        return [out, lse, *grads]

    def parts(lay, shards) -> list[torch.Tensor | None]:
        ring_leaves = [t[:split].detach().clone().requires_grad_() for t in shards[:3]]
        local_leaves = [t[split:].detach().clone().requires_grad_() for t in shards[:3]]
        s_ring = None if sinks is None else sinks.detach().clone().requires_grad_()
        s_local = None if sinks is None else sinks.detach().clone().requires_grad_()
        cu, cup, longest = lay.ring_cu_seqlens, lay.ring_cu_seqlens_padded, lay.ring_max_seqlen
        ring_out, ring_lse = ring_attention(
            *ring_leaves, cu, cu, cup, cup, pad_between_seqs=lay.ring_pad_between_seqs,
            max_seqlen_q=longest, max_seqlen_kv=longest, return_lse=True, sinks=s_ring, **kw,
        )  # fmt: skip
        cu, longest = lay.local_cu_seqlens, lay.local_max_seqlen
        local_out, local_lse = thd.attention(
            *local_leaves, cu, cu, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu, max_seqlen_q=longest,
            max_seqlen_kv=longest, return_lse=True, sinks=s_local, **kw,
        )  # fmt: skip
        ring_grads = torch.autograd.grad(ring_out, ring_leaves + [s_ring] * with_sinks, shards[3][:split])
        local_grads = torch.autograd.grad(local_out, local_leaves + [s_local] * with_sinks, shards[3][split:])
        out = [torch.cat((ring_out, local_out)), torch.cat((ring_lse, local_lse), 1)]
        out += [torch.cat((a, b)) for a, b in zip(ring_grads[:3], local_grads[:3], strict=True)]
        return out + ([ring_grads[3] + local_grads[3]] if with_sinks else [])

    for rank in range(cp):
        lay = document_layout(plan, rank, device=device, offsets=batch.offsets)
        if not (lay.has_local and lay.has_ring):
            continue
        comm.append(SelfComm(cp, rank))
        shards = [partition_documents(t, lay) for t in (q, k, v, do)]
        for t in shards:
            t[~lay.valid] = float("nan")  # the buffer's padding is never read
        want = parts(lay, shards)  # also compiles: the overlapped call below runs warm
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            overlapped = whole(lay, shards, overlap=True)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode(0)
        serial = whole(lay, shards, overlap=False)
        names = ("out", "lse", "dq", "dk", "dv", "dsinks")
        for name, w, a, b in zip(names, want, overlapped, serial, strict=False):
            label = f"{batch.name} rank={rank} variant={variant}: {name}"
            assert not w.isnan().any(), f"{label}: NaN (a padding row was read)"
            assert torch.equal(a, w), f"{label}: overlap=True differs from the parts run apart"
            assert torch.equal(b, w), f"{label}: overlap=False differs from the parts run apart"
        # padding rows: dk/dv of the ring region hold what this rank's blocks got as another
        # rank's (whose real rows they are); the real ring's are checked by the tests above
        padding = ~lay.valid
        local_padding = padding & (torch.arange(lay.rows, device=device) >= split)
        for name, g, rows in zip(
            ("out", "dq", "dk", "dv"),
            (overlapped[0], *overlapped[2:5]),
            (padding, padding, local_padding, local_padding),
            strict=True,
        ):
            assert_rows_equal(g, rows, 0.0, f"{batch.name} rank={rank}: {name} padding rows")
    assert comm, "no rank had both local and ring documents"


@pytest.fixture
def deterministic() -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` for the test (thd's kernels follow it)."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield None
    torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize(("cp", "variant"), [(2, THREAD_VARIANTS[1]), (3, THREAD_VARIANTS[2])])
def test_document_attention_equals_its_parts(cp: int, variant, deterministic, monkeypatch) -> None:
    monkeypatch.setenv("THD_ATTENTION_BACKEND", "reference")
    batch = _thread_batch(cp, 40, seed=cp)
    _check_overlap_is_exact(cp, batch, variant, (4, 2, 8, 8), "cpu", torch.float32, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("variant", [THREAD_VARIANTS[0], (True, (4096, 0), 0.0, True)])
def test_document_attention_overlap_is_exact_gpu(variant, deterministic, monkeypatch) -> None:
    """The side stream at realistic sizes: 4 ranks, 16k tokens each, GQA 16/4, bf16."""
    batch = _thread_batch(4, 16384, seed=9)
    _check_overlap_is_exact(4, batch, variant, (16, 4, 128, 128), "cuda", torch.bfloat16, monkeypatch)
