"""thd.cp.document_layout / partition_documents / unpartition_documents, single process."""

from __future__ import annotations

import pytest
import torch

from tests._helpers import capture_graph
from thd.cp import (
    document_attention,
    document_layout,
    partition_documents,
    plan_documents,
    unpartition_documents,
)
from thd.errors import ThdTypeError, ThdValueError

LENGTHS = [5, 0, 40, 3, 9, 1, 17]
PADS = [2, 1, 0, 3, 0, 0, 4]


def _global(cp: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    offsets, row = [], 0
    for n, p in zip(LENGTHS, PADS, strict=True):
        offsets.append(row)
        row += n + p
    x = torch.randn(row, 3, 2)
    real = torch.zeros(row, dtype=torch.bool)
    for o, n in zip(offsets, LENGTHS, strict=True):
        real[o : o + n] = True
    x[~real] = float("nan")
    return x, offsets, real


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_round_trip_and_rows(cp: int) -> None:
    x, offsets, real = _global(cp)
    plan = plan_documents(LENGTHS, cp, capacity=None)
    layouts = [document_layout(plan, r, offsets=offsets) for r in range(cp)]
    shards = [partition_documents(x, lay) for lay in layouts]
    for r, (lay, shard) in enumerate(zip(layouts, shards, strict=True)):
        assert shard.shape == (plan.rows, 3, 2) and not shard.isnan().any()
        assert torch.equal(shard[~lay.valid], torch.zeros_like(shard[~lay.valid]))
        for doc, start, stop in plan.pieces(r):  # every piece's tokens and positions, in buffer order
            rows = (lay.index >= offsets[doc] + start) & (lay.index < offsets[doc] + stop) & lay.valid
            assert int(rows.sum()) == stop - start
            assert lay.positions[rows].tolist() == list(range(start, stop))
            assert torch.equal(shard[rows], x[offsets[doc] + start : offsets[doc] + stop])
    back = unpartition_documents(shards, plan, num_rows=x.shape[0], offsets=offsets)
    assert torch.equal(back[real], x[real]) and not back[~real].any()


def test_partition_reads_nothing_on_the_host(no_host_reads: None) -> None:
    x, offsets, _ = _global(2)
    layout = document_layout(plan_documents(LENGTHS, 2), 1, offsets=offsets)
    out = partition_documents(x, layout, padding_value=-1.0)
    assert out.shape[0] == layout.rows


def test_errors() -> None:
    x, offsets, _ = _global(2)
    plan = plan_documents(LENGTHS, 2)
    layout = document_layout(plan, 0, offsets=offsets)
    with pytest.raises(ThdValueError, match="offsets"):
        document_layout(plan, 0, offsets=[0, 1])
    with pytest.raises(ThdValueError, match="cp_rank"):
        document_layout(plan, 2)
    with pytest.raises(ThdTypeError, match="plan"):
        document_layout("plan", 0)  # type: ignore[arg-type]
    with pytest.raises(ThdTypeError, match="layout"):
        partition_documents(x, plan)  # type: ignore[arg-type]
    with pytest.raises(ThdValueError, match="cp_size = 2"):
        unpartition_documents([x], plan)
    shard = partition_documents(x, layout)
    with pytest.raises(ThdValueError, match=r"shards\[1\]"):
        unpartition_documents([shard, shard[:-1]], plan)
    with pytest.raises(ThdValueError, match="num_rows"):
        unpartition_documents([shard, shard], plan, num_rows=3)
    q = torch.randn(layout.rows + 1, 2, 8)
    with pytest.raises(ThdValueError, match=r"q shape: expected \[" + str(layout.rows)):
        document_attention(q, q, q, layout)
    with pytest.raises(ThdTypeError, match="layout"):
        document_attention(q, q, q, plan)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_partition_and_local_attention_under_cuda_graph_gpu() -> None:
    """A fixed buffer (``capacity``): the gather and the local attention are captured once and
    replayed for another batch's plan by copying its index and cu_seqlens into the captured ones."""
    import thd

    first, second = [700, 300, 24, 1000], [1000, 999, 25, 24]  # same document count, longest 1000
    plans = [plan_documents(lengths, 1, capacity=2048) for lengths in (first, second)]
    layouts = [document_layout(p, 0, device="cuda") for p in plans]
    x = torch.randn(2048, 4, 64, device="cuda", dtype=torch.bfloat16)
    static = layouts[0]

    def step() -> torch.Tensor:
        q = partition_documents(x, static)
        return document_attention(q, q, q, static, causal=True)

    graph, out = capture_graph(step)
    for layout in layouts:
        static.index.copy_(layout.index)
        static.valid.copy_(layout.valid)
        static.local_cu_seqlens.copy_(layout.local_cu_seqlens)
        graph.replay()
        q = partition_documents(x, layout)
        cu = layout.local_cu_seqlens
        want = thd.attention(q, q, q, cu, cu, max_seqlen_q=1000, max_seqlen_kv=1000, causal=True)
        assert torch.equal(out, want), "the replay differs from the eager call on the same plan"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_overlapped_document_attention_under_cuda_graph_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The overlapped call (local documents on the side stream beside the ring) captured in a
    CUDA graph: replays equal the eager call, for the captured inputs and for new values copied
    into them (one rank alone; its exchanges hand it back its own blocks, copies the graph
    captures). Last in this file: a failed capture can leave the device unusable."""
    from tests.cp._thread_ring import SelfComm, one_rank_ring

    comm = SelfComm(2, 0)
    one_rank_ring(monkeypatch, lambda: comm)
    plan = plan_documents([3000, 700, 300, 1000, 24], 2)  # 3000 > a rank's share: it rides the ring
    layout = document_layout(plan, 0, device="cuda")
    assert layout.has_ring and layout.has_local, plan
    q, k, v = (torch.randn(plan.rows, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def step() -> torch.Tensor:
        with torch.no_grad():
            return document_attention(q, k, v, layout, causal=True)

    graph, out = capture_graph(step)
    for seed in (0, 1):
        if seed:
            for t in (q, k, v):
                t.copy_(torch.randn_like(t))
        graph.replay()
        want = step()
        assert not torch.equal(out, torch.zeros_like(out))
        assert torch.equal(out, want), f"replay {seed} differs from the eager call"
