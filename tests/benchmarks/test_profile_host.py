"""``benchmarks/profile_host.py`` runs on CPU with the launches stubbed: it times the ``tl`` path
(one forward launch; three or four forward+backward, by the dQ mode) and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _profile_host(monkeypatch: pytest.MonkeyPatch, family: str = "tl"):  # type: ignore[no-untyped-def]
    """The script's module, imported for an in-process run on ``family``'s stubbed host path (the
    variables the script sets are restored after the test)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.syspath_prepend(str(ROOT))  # the ring's stand-in comm: tests/cp/_thread_ring.py
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # launches are stubbed, not interpreted
    for name, value in (("THD_ATTENTION_BACKEND", "triton"), ("THD_KERNELS", family)):
        monkeypatch.setenv(name, value)
    import profile_host

    return profile_host


def test_profile_host_counts_the_tl_launches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    profile_host = _profile_host(monkeypatch)
    from thd._runtime import tiles

    out = tmp_path / "host.json"
    argv = ["--launcher", "stub", "--calls", "3", "--rounds", "2", "--profile-calls", "2", "--top", "5"]
    assert profile_host.main([*argv, "--heads", "2", "--head-dim", "128", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert results["fwd"]["launches_per_call"] == {"_attention_fwd_kernel": 1}
    backward = ["_attention_bwd_preprocess_kernel", "_attention_bwd_dkdv_kernel"]
    if tiles.FAST_DQ_MODE == 0:  # else dQ is added by atomics (the interpreter's default)
        backward.append("_attention_bwd_dq_kernel")
    expected = {name: 1 for name in ["_attention_fwd_kernel", *backward]}
    assert results["fwd_bwd"]["launches_per_call"] == expected
    assert results["fwd_bwd"]["families"] == {"forward": "tl", "backward": "tl"}
    for mode in ("fwd", "fwd_bwd"):
        assert len(results[mode]["rounds_us"]) == 2 and results[mode]["us_per_call"] > 0
        assert 1 <= len(results[mode]["profile"]) <= 5


def test_profile_host_takes_the_gluon_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--family gluon``: CPU tensors pass for an sm_90 device, so both phases run the Gluon
    wrappers (their launches stubbed), the warm calls make no plans, and the JSON records the family and that
    autograd's multithreading was off (``--autograd-threads off``)."""
    pytest.importorskip("triton.experimental.gluon")
    profile_host = _profile_host(monkeypatch, "gluon")
    out = tmp_path / "host.json"
    argv = ["--launcher", "stub", "--family", "gluon", "--calls", "2", "--rounds", "1", "--top", "0"]
    argv += ["--autograd-threads", "off"]
    assert profile_host.main([*argv, "--heads", "2", "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["env"]["THD_KERNELS"] == "gluon"
    assert written["results"]["autograd_multithreading"] is False
    results = written["results"]
    assert results["fwd_bwd"]["families"] == {"forward": "gluon", "backward": "gluon"}
    assert results["fwd"]["launches_per_call"] == {"attention_fwd_kernel": 1}
    assert {"attention_fwd_kernel", "_dkdv_kernel"} <= set(results["fwd_bwd"]["launches_per_call"])
    for mode in ("fwd", "fwd_bwd"):
        assert results[mode]["plans_made_per_call"] == [0, 0], mode


@pytest.mark.parametrize("family", ["tl", "gluon"])
def test_profile_host_fast_launcher_caches_every_launch(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--launcher fast`` (the default): the warm calls go through the launcher's cached path, each
    compiled kernel replaced by a counting no-op, and none falls back to Triton's normal launch."""
    if family == "gluon":
        pytest.importorskip("triton.experimental.gluon")
    profile_host = _profile_host(monkeypatch, family)
    if family == "tl":
        import triton

        from thd.ops.attention.kernels import _attention_fwd_kernel

        if not isinstance(_attention_fwd_kernel, triton.runtime.JITFunction):
            pytest.skip("the tl kernels were made by the interpreter here: the launcher never caches those")
    out = tmp_path / "host.json"
    argv = ["--launcher", "fast", "--family", family, "--calls", "2", "--rounds", "1", "--top", "0"]
    assert profile_host.main([*argv, "--heads", "2", "--head-dim", "64", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert results["fwd_bwd"]["families"] == {"forward": family, "backward": family}
    for mode in ("fwd", "fwd_bwd"):
        launches = results[mode]["launches_per_call"]
        assert launches and all(count == 1 for count in launches.values()), (mode, launches)
        assert results[mode]["normal_launches_per_call"] == {}, mode
        assert results[mode]["plans_made_per_call"] == [0, 0], mode


@pytest.mark.parametrize("ring", ["0", "2"])
def test_profile_host_fresh_offsets_make_no_plans(
    ring: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new offsets tensor each warm call, single-device or as one rank of a 2-rank ring (two
    launches per phase), finds the cached launch plans."""
    profile_host = _profile_host(monkeypatch)
    out = tmp_path / "host.json"
    argv = ["--launcher", "stub", "--calls", "3", "--rounds", "1", "--top", "0", "--offsets", "fresh"]
    assert profile_host.main([*argv, "--ring", ring, "--heads", "2", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert results["fwd"]["launches_per_call"]["_attention_fwd_kernel"] == max(1, int(ring))
    for mode in ("fwd", "fwd_bwd"):
        assert results[mode]["plans_made_per_call"] == [0, 0], mode


@pytest.mark.parametrize("ring", ["0", "2"])
def test_profile_host_real_launches_run_the_kernels(ring: str, tmp_path: Path) -> None:
    """``--launcher real`` stubs nothing (on CPU the interpreter runs the kernels), single-device and
    as one rank of a 2-rank ring: the calls complete and are timed on the tl family. In a process
    of its own: thd reads ``TRITON_INTERPRET`` once per process, and other tests here unset it."""
    out = tmp_path / "host.json"
    argv = ["--launcher", "real", "--calls", "1", "--rounds", "1", "--top", "0", "--modes", "fwd"]
    argv += ["--ring", ring, "--heads", "2", "--head-dim", "16", "--json", str(out)]
    env = {**os.environ, "TRITON_INTERPRET": "1", "THD_ATTENTION_BACKEND": "triton", "THD_KERNELS": "tl"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    script = str(ROOT / "benchmarks" / "profile_host.py")
    proc = subprocess.run(
        [sys.executable, script, *argv], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())["results"]["fwd"]
    assert result["families"] == {"forward": "tl"} and result["us_per_call"] > 0
    assert result["launches_per_call"] == {}  # nothing stubbed, nothing counted


def test_profile_host_layout_takes_the_benchmark_documents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--layout TOKENS:MIX``: the documents ``bench_attention.py`` makes for that layout (oracle:
    ``_common.document_lengths`` with its seed 0), each call one launch per kernel as on the tiny
    problem; ``--layout`` with ``--ring`` is refused."""
    profile_host = _profile_host(monkeypatch)
    from _common import document_lengths

    out = tmp_path / "host.json"
    argv = ["--launcher", "stub", "--calls", "2", "--rounds", "1", "--top", "0", "--heads", "2"]
    assert profile_host.main([*argv, "--head-dim", "16", "--layout", "4096:64-1024", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    lengths = document_lengths(4096, 64, 1024, seed=0)
    assert (results["documents"], results["tokens"]) == (len(lengths), 4096)
    assert len(lengths) > 2
    assert results["fwd"]["launches_per_call"] == {"_attention_fwd_kernel": 1}
    with pytest.raises(SystemExit):
        profile_host.main([*argv, "--layout", "4096:64-1024", "--ring", "2"])
