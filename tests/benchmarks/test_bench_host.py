"""``benchmarks/bench_host.py`` runs end to end on CPU (tiny shapes; the GPU numbers come from the
GPU run) and writes the JSON the issue asks for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_host_cpu_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the script imports _common as a script
    monkeypatch.setenv("THD_ATTENTION_BACKEND", "reference")  # no kernels on CPU: the host path only
    import bench_host

    out = tmp_path / "host.json"
    argv = ["--device", "cpu", "--quick", "--heads", "2", "--head-dim", "16", "--out", str(out)]
    argv += ["--providers", "thd", "varlen_attn"]
    assert bench_host.main(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["command"].endswith(" ".join(argv)) and payload["env"]["torch"]
    by = {(r["provider"], r["mode"]): r for r in payload["records"]}
    assert set(by) == {(p, m) for p in ("thd", "varlen_attn") for m in ("fwd", "fwd_bwd")}
    for mode in ("fwd", "fwd_bwd"):
        thd = by[("thd", mode)]
        assert thd["status"] == "ok" and thd["wall_us"] > 0 and thd["calls"] == 20
        assert thd["forward_family"] == "reference"
        assert by[("varlen_attn", mode)]["status"] in ("ok", "error", "unavailable")  # CPU: no flash kernel
    assert by[("thd", "fwd_bwd")]["backward_family"] == "reference"


@pytest.mark.parametrize("threads", ["on", "off"])
def test_bench_host_autograd_threads_and_the_elementwise_floor(
    threads: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--autograd-threads off`` takes its loops with autograd's multithreading off (each record
    says what was in force while it was timed), and the ``elementwise`` floor times both modes."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_host

    out = tmp_path / "host.json"
    argv = ["--device", "cpu", "--quick", "--heads", "2", "--head-dim", "16", "--out", str(out)]
    assert bench_host.main([*argv, "--providers", "elementwise", "--autograd-threads", threads]) == 0
    records = json.loads(out.read_text())["records"]
    assert {r["mode"] for r in records} == {"fwd", "fwd_bwd"}
    for record in records:
        assert record["status"] == "ok" and record["wall_us"] > 0
        assert record["autograd_multithreading"] is (threads == "on")
