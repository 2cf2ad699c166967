"""Every benchmark script imports on the CPU machine (they run only on the GPU host, where a
broken import would cost device time): each is imported as ``make bench`` runs it, with
``benchmarks/`` on the path."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if not p.stem.startswith("_"))


def test_the_scripts_are_found() -> None:
    assert {"bench_attention", "bench_gluon", "bench_gluon_bwd", "run_all"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_script_imports(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module(name)
    if "__main__" in (BENCHMARKS / f"{name}.py").read_text():  # a script, not a shared module
        assert callable(getattr(module, "main", None)), f"benchmarks/{name}.py has no main()"
