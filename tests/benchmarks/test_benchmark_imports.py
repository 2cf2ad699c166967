"""Every benchmark script imports on the CPU machine (they run only on the GPU host, where a
broken import would cost device time): each is imported as ``make bench`` runs it, with
``benchmarks/`` on the path."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
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


DEVICE_SCRIPTS = sorted(p.name for p in (BENCHMARKS / "device").glob("*.py") if not p.stem.startswith("_"))


@pytest.mark.parametrize("name", DEVICE_SCRIPTS)
def test_device_script_runs_as_the_device_runs_it(name: str) -> None:
    """``python3 benchmarks/device/<name> --help`` from the repository root, in a fresh interpreter
    (imports cached by other tests cannot hide a path the script does not set up)."""
    env = {**os.environ, "PYTHONPATH": str(BENCHMARKS.parent / "src")}
    proc = subprocess.run(
        [sys.executable, f"benchmarks/device/{name}", "--help"],
        cwd=BENCHMARKS.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage" in proc.stdout


@pytest.mark.parametrize("name", sorted(p.name for p in (BENCHMARKS / "device").glob("*.sh")))
def test_device_shell_script_parses(name: str) -> None:
    proc = subprocess.run(["bash", "-n", str(BENCHMARKS / "device" / name)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_pending_checks_usage_names_every_call() -> None:
    """``pending_checks.sh``'s usage line lists exactly the calls its ``case`` has, and each call the
    header describes exists."""
    text = (BENCHMARKS / "device" / "pending_checks.sh").read_text()
    usage = re.search(r"usage: pending_checks\.sh ([0-9|]+)", text)
    assert usage is not None
    listed = set(usage[1].split("|"))
    calls = set(re.findall(r"^(\d+)\)", text, flags=re.MULTILINE))
    assert listed == calls, (sorted(listed - calls), sorted(calls - listed))
    described = set(re.findall(r"^# Call (\d+)", text, flags=re.MULTILINE))
    assert described <= calls, sorted(described - calls)


def test_stage_fa4_refuses_an_unknown_step() -> None:
    """``stage_fa4.sh`` names the step it does not know and exits 1, before it copies anything."""
    proc = subprocess.run(
        ["bash", str(BENCHMARKS / "device" / "stage_fa4.sh"), "stage"], capture_output=True, text=True
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("ERROR: stage_fa4.sh: step 'stage'")
