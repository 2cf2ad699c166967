"""``benchmarks/device/profile_fwd_bwd_gpu.py``'s host-event listing, on the CPU: the events of a
known call, counted per call."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def profile_script():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(
            "profile_fwd_bwd_gpu", BENCHMARKS / "device" / "profile_fwd_bwd_gpu.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_host_events_count_the_ops_of_one_call(profile_script) -> None:  # type: ignore[no-untyped-def]
    x = torch.ones(64)

    def call() -> torch.Tensor:
        return torch.mul(torch.add(x, 1), 2) + torch.add(x, 3)

    rows = profile_script._host_events(call, top=50)
    counts = {r["event"]: r["count_per_call"] for r in rows}
    assert counts.get("aten::add") == 3  # two torch.add and one `+`
    assert counts.get("aten::mul") == 1
    assert all(r["self_cpu_us_per_call"] > 0 for r in rows)
    ordered = [r["self_cpu_us_per_call"] for r in rows]
    assert ordered == sorted(ordered, reverse=True)


def test_host_events_keep_the_top_rows_only(profile_script) -> None:  # type: ignore[no-untyped-def]
    x = torch.ones(8)
    rows = profile_script._host_events(lambda: (x + 1) * 2 - 3, top=2)
    assert len(rows) == 2


def test_out_file_names_the_command_and_machine(profile_script, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``--out`` writes what the device run found with the command and the machine's fingerprint
    (the timing itself runs only on a GPU: ``measure`` is replaced by one canned row here)."""
    host = {"issue_us": 1.0, "wall_us": 2.0, "calls": 20}
    row = {"row": "64,16384:64-1024", "family": "tl", "fwd_ms": 0.1, "fwd_bwd_ms": 0.5}
    row |= {"fwd_host": host, "fwd_bwd_host": host, "fwd_bwd_kernels": []}
    monkeypatch.setattr(profile_script, "measure", lambda *args: dict(row))
    out = tmp_path / "profile.json"
    monkeypatch.setattr(
        sys, "argv", ["profile_fwd_bwd_gpu.py", "--families", "tl", "--rows", row["row"], "--out", str(out)]
    )
    profile_script.main()
    written = json.loads(out.read_text())
    assert "profile_fwd_bwd_gpu.py" in written["command"] and "--out" in written["command"]
    assert written["env"]["torch"] == torch.__version__
    assert written["results"] == [row]
