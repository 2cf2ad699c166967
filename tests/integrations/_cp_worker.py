"""Rank body of the context-parallel training-step tests (spawned by ``tests.cp._dist.spawn``).

Every rank runs the single-process packed step itself (``attn_implementation="thd"``, the whole
batch) and its CP shard (``"thd_cp"``, ring attention over the world group), then checks that
the summed CP losses and gradients, and the reassembled logits, equal the single-process ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch
import torch.distributed as dist
from torch import Tensor

from tests._helpers import assert_close
from tests.integrations._models import documents, make_model, packed_batch

__all__ = ["cp_training_step"]


def _check(got: Tensor, want: Tensor, name: str, rel: float | None) -> None:
    """fp32: elementwise; bf16 (``rel`` given): relative Frobenius error below ``rel``."""
    if rel is None:
        assert_close(got, want, name, atol=2e-5, rtol=2e-4)
        return
    err = (got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-6)
    assert err <= rel, f"{name}: relative error {err:.3e} > {rel:g}"


def cp_training_step(
    rank: int,
    world: int,
    families: Sequence[str],
    layouts: Sequence[Sequence[int]],
    dtype_name: str,
    mode: str = "uniform",
) -> None:
    from thd.cp import unpartition, unpartition_documents
    from thd.integrations.transformers import register, shard_batch

    device = f"cuda:{rank}" if dist.get_backend() == "nccl" else "cpu"
    dtype = getattr(torch, dtype_name)
    rel = None if dtype == torch.float32 else 3e-2
    register("thd")
    register("thd_cp", group=dist.group.WORLD)
    for family in families:
        for lengths in layouts:
            docs = documents(lengths, seed=7)
            batch = packed_batch(docs, flash_kwargs=True, device=device)
            base = make_model(family, "thd", dtype=dtype, device=device)
            want = base(**batch, use_cache=False)
            want.loss.backward()

            model = make_model(family, "thd_cp", dtype=dtype, device=device)
            shard = shard_batch(batch, dist.group.WORLD, mode=mode)
            out = model(**shard)
            out.loss.backward()
            loss = out.loss.detach().clone()
            dist.all_reduce(loss)  # each rank holds (its token-loss sum) / (global label count)
            where = f"{family} {list(lengths)} {mode} rank {rank}"
            _check(loss, want.loss.detach(), f"{where}: loss", rel)
            for (name, p), (_, q) in zip(model.named_parameters(), base.named_parameters(), strict=True):
                dist.all_reduce(p.grad)
                _check(p.grad, q.grad, f"{where}: grad {name}", rel)

            layout = shard["thd_cp_layout"]
            shards = [torch.empty_like(out.logits[0]) for _ in range(world)]
            dist.all_gather(shards, out.logits[0].detach().contiguous())
            cu = [0, *accumulate(lengths)]
            if mode == "documents":
                if world > 1 and max(lengths) > sum(lengths) / world:
                    assert layout.plan.ring_documents, f"{where}: expected a document on the ring"
                logits = unpartition_documents(shards, layout.plan)
                cup = cu
            else:
                logits = unpartition(shards, layout.cu_seqlens_padded, world)
                cup = layout.cu_seqlens_padded.tolist()
            for d in range(len(lengths)):
                got = logits[cup[d] : cup[d] + cu[d + 1] - cu[d]]
                _check(got, want.logits[0, cu[d] : cu[d + 1]].detach(), f"{where}: logits of doc {d}", rel)
