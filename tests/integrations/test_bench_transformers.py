"""``benchmarks/bench_transformers.py --quick`` runs end to end on a CPU (CI smoke test).

The GPU run (``make bench``) is the one that measures; this keeps the script from rotting:
every provider trains on the same documents, they agree on the first loss, and the JSON holds
the command, tokens/s, peak memory (``None`` on a CPU), the FLOP count and every step's loss.
The packed baselines (``sdpa_packed``; ``flex_packed`` on the GPU: flex_attention has no CPU
backward, and compiling it on two CPU cores takes about a minute) must mask across documents:
their loss equals thd's, and differs from causal attention over the whole row.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.usefixtures("reference_backend")


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports its sibling _common
    return importlib.import_module("bench_transformers")


def _quick_run(bench: ModuleType, out: Path, device: str, providers: list[str]) -> dict[str, Any]:
    argv = ["--out", str(out), "--quick", "--device", device, "--tokens", "512", "--warmup", "0"]
    assert bench.main([*argv, "--providers", *providers]) == 0
    return json.loads(out.read_text())


def _check_records(bench: ModuleType, payload: dict[str, Any], providers: list[str], on_gpu: bool) -> None:
    assert payload["command"].startswith("bench_transformers.py --out")
    assert payload["config"]["layers"] == bench.QUICK["layers"] and payload["config"]["tokens"] == 512
    assert sum(payload["documents"]["lengths"]) == 512 and payload["step_tflop"] > 0
    records = {r["provider"]: r for r in payload["records"]}
    assert list(records) == providers
    for name, rec in records.items():
        assert rec["status"] == "ok", (name, rec.get("error"))
        assert (
            rec["tokens_per_s"] > 0 and rec["tflops"] > 0 and (rec["peak_memory_gib"] is not None) == on_gpu
        )
        assert len(rec["losses"]) == bench.QUICK["steps"] and rec["losses"][0] == rec["first_loss"]
        assert rec["attn_implementation"] == bench.SETUPS[name][0]
        # bf16 model, same weights and documents: one loss (before and after the first step)
        assert abs(rec["first_loss"] - records["thd"]["first_loss"]) < 1e-2, name
    agree = payload["initial_agreement"]
    assert set(agree) == set(providers) - {"thd"}
    for name, gaps in agree.items():  # bf16 logits of one model: 0.004 apart on a CPU
        assert gaps["initial_loss_abs_diff"] < 1e-2 and gaps["probe_logits_max_abs_diff"] < 5e-2, (name, gaps)
    assert records["thd"]["rows"] == 512 and records["sdpa"]["rows"] % 64 == 0  # packed vs padded
    assert all(records[p]["rows"] == 512 for p in providers if p.endswith("_packed"))
    against = payload["summary"]["against"]
    assert set(against) == set(providers) - {"thd"}
    assert payload["summary"]["speedup_tokens_per_s"] == against["sdpa"]["speedup_tokens_per_s"]  # as before
    for rec in against.values():
        assert rec["speedup_tokens_per_s"] > 0 and rec["first_loss_abs_diff"] < 1e-2


def test_quick_run_on_cpu(bench: ModuleType, tmp_path: Path) -> None:
    providers = ["thd", "sdpa", "sdpa_packed"]
    _check_records(
        bench, _quick_run(bench, tmp_path / "transformers.json", "cpu", providers), providers, False
    )


def test_packed_baseline_masks_across_documents(bench: ModuleType) -> None:
    """Oracle for the probe: the position_ids batch's probe logits are the padded batch's (one
    document per row); with positions 0..T-1 (one long document) they are not."""
    args = bench.parse_args(["--out", "x.json", "--quick", "--tokens", "512"])
    device = torch.device("cpu")
    lengths = bench.document_lengths(512, args.min_len, args.max_len, 0)
    docs = bench.make_documents(lengths, args.vocab, 0)
    model = bench.make_model(args, "sdpa", device)
    batch = bench.provider_batch("sdpa_packed", docs, args, device)
    assert set(batch) == {"input_ids", "labels", "position_ids"}  # no cu_seq_lens: the mask is built
    packed = bench.initial_check(model, batch, "position_ids", lengths)
    padded = bench.initial_check(model, bench.provider_batch("sdpa", docs, args, device), "padded", lengths)
    one_row = bench.initial_check(
        model, {**batch, "position_ids": torch.arange(512)[None]}, "packed", lengths
    )
    assert bench.agreement(padded, packed)["probe_logits_max_abs_diff"] < 5e-2
    assert bench.agreement(padded, one_row)["probe_logits_max_abs_diff"] > 0.1  # 0.4 measured


@pytest.mark.gpu
def test_quick_run_on_gpu_every_provider(bench: ModuleType, tmp_path: Path) -> None:
    providers = list(bench.PROVIDERS)
    payload = _quick_run(bench, tmp_path / "transformers.json", "cuda", providers)
    _check_records(bench, payload, providers, True)


def test_default_configuration_is_the_documented_gpu_one(bench: ModuleType) -> None:
    """8 layers, hidden 2048, 16 heads (bf16: make_model), 64..4096-token documents; --quick
    changes only the defaults; every provider by default."""
    args = bench.parse_args(["--out", "x.json"])
    assert (args.layers, args.hidden, args.heads, args.min_len, args.max_len) == (8, 2048, 16, 64, 4096)
    assert args.providers == ["thd", "sdpa", "sdpa_packed", "flex_packed"]
    quick = bench.parse_args(["--out", "x.json", "--quick", "--layers", "3"])
    assert (quick.layers, quick.hidden) == (3, bench.QUICK["hidden"])  # explicit flags win
