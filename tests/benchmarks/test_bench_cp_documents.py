"""benchmarks/bench_cp_documents.py on CPU: its byte count against the ring's own sends, and a
tiny end-to-end run of every part (the GPU numbers are in benchmarks/results)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


class _CountingComm:
    """A loopback ring comm (nothing arrives: compute does not depend on it) counting sent bytes."""

    transport = "counting"

    def __init__(self, size: int, rank: int) -> None:
        self.size, self.rank, self.sent = size, rank, 0

    def send(self, tensor: torch.Tensor, offset: int, tag: int) -> None:
        self.sent += tensor.numel() * tensor.element_size()

    def recv(self, tensor: torch.Tensor, offset: int, tag: int) -> None:
        return None

    def start(self, ops: list) -> _CountingComm:
        return self

    def wait(self) -> None:
        """Nothing is outstanding."""


@pytest.mark.parametrize("cp", [2, 3])
def test_ring_bytes_match_what_the_ring_sends(cp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setenv("THD_ATTENTION_BACKEND", "reference")
    import bench_cp_documents
    import bench_ring_window

    from thd.cp.ring import RingAttentionFunction

    lengths = [13, 2 * cp * 3, 5]
    slots = [-(-n // (2 * cp)) * 2 * cp for n in lengths]
    layout = bench_ring_window.RingLayout(cp, tuple(lengths), tuple(slots))
    heads, dim = 2, 8
    sent = 0
    for rank in range(cp):
        plan = bench_ring_window.rank_plan(layout, rank, "causal", 0, dim**-0.5, torch.device("cpu"))
        rows = layout.rows // cp
        q, k, v, do = (torch.randn(rows, heads, dim, dtype=torch.bfloat16).requires_grad_() for _ in range(4))
        comm = _CountingComm(cp, rank)
        out, _ = RingAttentionFunction.apply(q, k, v, None, plan, comm, True)
        torch.autograd.grad(out, (q, k, v), do)
        sent += comm.sent
    assert sent == bench_cp_documents.ring_bytes(layout.rows // cp, cp, kv_heads=heads, head_dim=dim)
    assert bench_cp_documents.uniform_rows(lengths, cp) == layout.rows // cp


def test_quick_run_writes_every_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setenv("THD_ATTENTION_BACKEND", "reference")
    import bench_cp_documents

    out = tmp_path / "docs.json"
    argv = ["--out", str(out), "--quick", "--device", "cpu", "--parts", "bytes", "planning", "balance",
            "--cp", "2", "--tokens", "128", "--mixes", "64-1024", "--modes", "fwd"]  # fmt: skip
    assert bench_cp_documents.main(argv) == 0
    payload = json.loads(out.read_text())
    parts = {r["part"] for r in payload["records"]}
    tokens = payload["config"]["tokens"]
    assert parts == {"bytes", "planning", "balance"}
    for r in payload["records"]:
        if r["part"] == "bytes":
            lengths = bench_cp_documents.document_lengths(2 * tokens, "64-1024", 0 + 1000 * 2 + r["seed"])
            # 2 ranks x 3 exchanges (forward K/V, backward K/V and dK/dV) x rows x 8 heads x (K + V) x bf16
            assert r["uniform_bytes"] == 2 * 3 * bench_cp_documents.uniform_rows(lengths, 2) * 8 * 256 * 2
        if r["part"] == "balance":
            for rank in r["rank_ms"]:
                assert rank["total"] == pytest.approx(rank["local"] + rank["ring"] + rank["linear"])
            assert r["max_over_mean"] >= 1.0
    assert payload["command"].startswith("bench_cp_documents.py --out")


def test_balance_checkpoints_after_every_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU run cut short by its time limit keeps every finished (mix, cp, plan) case."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setenv("THD_ATTENTION_BACKEND", "reference")
    import bench_cp_documents

    args = bench_cp_documents.parse_args(
        [
            "--out",
            "unused.json",
            "--quick",
            "--device",
            "cpu",
            "--cp",
            "2",
            "--tokens",
            "64",
            "--modes",
            "fwd",
        ]
    )
    seen: list[int] = []
    rows = bench_cp_documents.measure_balance(args, checkpoint=lambda rows: seen.append(len(rows)))
    cases = len(args.mixes) * len(args.cp) * 2  # document and uniform plans
    assert seen == list(range(1, cases + 1)) and len(rows) == cases


def test_overlap_part_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The overlap part on CPU (no side stream there: the numbers are not the point): per rank
    with local and ring documents, the whole call, the serial call and the two parts, and the
    efficiency computed from them; one checkpoint per (mix, cp) case."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setenv("THD_ATTENTION_BACKEND", "reference")
    import bench_cp_documents

    out = tmp_path / "overlap.json"
    argv = ["--out", str(out), "--quick", "--device", "cpu", "--parts", "overlap", "--cp", "2",
            "--tokens", "2048", "--mixes", "long-tail", "64-1024", "--modes", "fwd"]  # fmt: skip
    args = bench_cp_documents.parse_args(argv)
    seen: list[int] = []
    rows = bench_cp_documents.measure_overlap(args, checkpoint=lambda rows: seen.append(len(rows)))
    assert seen == [1, 2] and [r["mix"] for r in rows] == ["long-tail", "64-1024"]
    tail = rows[0]
    timed = [r for r in tail["rank_ms"] if r["timed"]]
    assert tail["ring_documents"] > 0 and tail["ranks_timed"] == len(timed) >= 1
    for rank in timed:
        assert rank["efficiency"] == pytest.approx((rank["local"] + rank["ring"]) / rank["whole"])
    parts = sum(r["local"] + r["ring"] for r in timed)
    assert tail["efficiency"] == pytest.approx(parts / sum(r["whole"] for r in timed))
    assert tail["serial_over_whole"] == pytest.approx(
        sum(r["serial"] for r in timed) / sum(r["whole"] for r in timed)
    )
    for row in rows:  # a rank with no local or no ring document has nothing to overlap: not timed
        for rank in row["rank_ms"]:
            assert rank["timed"] == (row["ring_documents"] > 0 and rank["local_documents"] > 0)
    assert bench_cp_documents.main(argv) == 0
    assert set(json.loads(out.read_text())["summary"]["overlap"]) == {
        "long-tail cp=2 fwd",
        "64-1024 cp=2 fwd",
    }


def test_rank_times_rotate_the_rank_order_and_take_medians(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round starts one rank later (a clock drift over the case is not read as imbalance),
    and each part's time is its median over the rounds."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import argparse
    from types import SimpleNamespace

    import bench_cp_documents as bench

    monkeypatch.setattr(bench, "_local_calls", lambda plan, rank, *a: {"fwd": ("local", rank)})
    monkeypatch.setattr(bench, "_ring_calls", lambda lengths, slots, cp, rank, *a: {"fwd": ("ring", rank)})
    monkeypatch.setattr(bench, "_linear_calls", lambda tokens, hidden, device: {"fwd": ("linear", tokens)})
    order: list[int] = []
    clock = iter(range(1, 1000))

    def fake_time(call: tuple[str, int], args: argparse.Namespace) -> float:
        kind, tag = call
        rank = tag if kind != "linear" else tag - 100
        if kind == "local":
            order.append(rank)
        return 10.0 * rank + next(clock) / 1000  # a rank's own cost plus a slow drift

    monkeypatch.setattr(bench, "_time", fake_time)
    plan = SimpleNamespace(cp_size=3, ring_slots=(), rank_tokens=[100, 101, 102])
    args = argparse.Namespace(heads=1, head_dim=8, hidden=8, modes=["fwd"], rounds=3)
    per_rank = bench._rank_times(plan, [], args, torch.device("cpu"))
    assert order == [0, 1, 2, 1, 2, 0, 2, 0, 1]
    for rank, parts in enumerate(per_rank["fwd"]):
        assert set(parts) == {"local", "ring", "linear", "total"}
        for part in ("local", "ring", "linear"):
            assert 10.0 * rank < parts[part] < 10.0 * rank + 0.03  # the median of its three rounds
        assert parts["total"] == pytest.approx(parts["local"] + parts["ring"] + parts["linear"])
    # rank 0's local part ran at ticks 1, 16 and 22 (first, last, second in its rounds): median 16
    assert per_rank["fwd"][0]["local"] == pytest.approx(0.016)
