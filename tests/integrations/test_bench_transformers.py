"""``benchmarks/bench_transformers.py --quick`` runs end to end on a CPU (CI smoke test).

The GPU run (``make bench``) is the one that measures; this keeps the script from rotting:
both providers train on the same documents, agree on the first loss, and the JSON holds the
command, tokens/s, peak memory (``None`` on a CPU), the FLOP count and every step's loss.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.usefixtures("reference_backend")


def test_quick_run_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports its sibling _common
    bench = importlib.import_module("bench_transformers")
    out = tmp_path / "transformers.json"
    argv = ["--out", str(out), "--quick", "--device", "cpu", "--tokens", "512", "--warmup", "0"]
    assert bench.main(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["command"].startswith("bench_transformers.py --out")
    assert payload["config"]["layers"] == bench.QUICK["layers"] and payload["config"]["tokens"] == 512
    assert sum(payload["documents"]["lengths"]) == 512 and payload["step_tflop"] > 0
    records = {r["provider"]: r for r in payload["records"]}
    assert set(records) == {"thd", "sdpa"}
    for name, rec in records.items():
        assert rec["status"] == "ok", (name, rec.get("error"))
        assert rec["tokens_per_s"] > 0 and rec["tflops"] > 0 and rec["peak_memory_gib"] is None
        assert len(rec["losses"]) == bench.QUICK["steps"] and rec["losses"][0] == rec["first_loss"]
    assert records["thd"]["rows"] == 512 and records["sdpa"]["rows"] % 64 == 0  # packed vs padded
    assert payload["summary"]["first_loss_abs_diff"] < 1e-2  # bf16 model, same weights and documents


def test_default_configuration_is_the_documented_gpu_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """8 layers, hidden 2048, 16 heads (bf16: make_model), 64..4096-token documents; --quick
    changes only the defaults."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = importlib.import_module("bench_transformers")
    args = bench.parse_args(["--out", "x.json"])
    assert (args.layers, args.hidden, args.heads, args.min_len, args.max_len) == (8, 2048, 16, 64, 4096)
    quick = bench.parse_args(["--out", "x.json", "--quick", "--layers", "3"])
    assert (quick.layers, quick.hidden) == (3, bench.QUICK["hidden"])  # explicit flags win
