"""Where a forward+backward call's time goes on the GPU, per kernel family: the GPU time per call
(back to back between CUDA events, as ``bench_attention.py`` times it), the host time to issue one
call (no sync inside the loop), and the kernels one call runs (torch profiler, device time each).

Written for the short-document rows, where the Gluon family's forward+backward in the goal table
is slower than its forward and its backward timed alone (``bench_gluon_bwd.py``) add up to.

device: PYTHONPATH=src:benchmarks:. python3 benchmarks/device/profile_fwd_bwd_gpu.py \
            --rows 64,16384:64-1024 128,16384:64-1024 --families tl gluon --out prof.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its modules import _common

from _common import bench_back_to_back, command_line, env_fingerprint, host_time_us, sync, write_json
from attention_measure import environment, timed_fn
from attention_providers import LayoutSpec, make_problem, thd_provider

HEADS = 16
PROFILED_CALLS = 5
ISSUED_CALLS = 20


def _per_call_events(fn: Callable[[], object], activity: ProfilerActivity, time_total: str) -> list[tuple]:
    """``(name, count, microseconds)`` per call of the profiler's events of ``activity`` over
    :data:`PROFILED_CALLS` calls, by the events' ``time_total`` attribute, longest first."""
    sync()
    with profile(activities=[activity]) as prof:
        for _ in range(PROFILED_CALLS):
            fn()
        sync()
    rows = [
        (event.key[:90], event.count / PROFILED_CALLS, getattr(event, time_total) / PROFILED_CALLS)
        for event in prof.key_averages()
        if getattr(event, time_total) > 0
    ]
    return sorted(rows, key=lambda r: -r[2])


def _kernels(fn: Callable[[], object]) -> list[dict[str, Any]]:
    """The kernels of one call: name, launches and device microseconds per call, longest first."""
    cuda = torch.cuda.is_available()
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    total = "self_device_time_total" if cuda else "self_cpu_time_total"
    return [
        {"kernel": name, "launches_per_call": count, "device_us_per_call": us}
        for name, count, us in _per_call_events(fn, activity, total)
    ]


def _host_events(fn: Callable[[], object], top: int) -> list[dict[str, Any]]:
    """Where the host's time to issue one call goes: the ``top`` events (Python-visible ops and
    CUDA runtime/driver calls such as ``cuLaunchKernelEx``) by their own CPU time per call."""
    rows = _per_call_events(fn, ProfilerActivity.CPU, "self_cpu_time_total")[:top]
    return [{"event": name, "count_per_call": count, "self_cpu_us_per_call": us} for name, count, us in rows]


def measure(row: str, family: str, heads: int, host_events: int) -> dict[str, Any]:
    dim, layout = row.split(",")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke test (interpreter)
    problem = make_problem(LayoutSpec.parse(layout), heads, int(dim), seed=0, device=device)
    call = thd_provider(problem).call
    result: dict[str, Any] = {"row": row, "family": family}
    with environment({"THD_KERNELS": family}):
        for mode in ("fwd", "fwd_bwd"):
            fn = timed_fn(call, problem, mode)
            result[f"{mode}_ms"] = bench_back_to_back(fn, rep_ms=40, trials=3)["median_ms"]
            # issue_us: the host's time to issue one call (no sync in the loop); wall_us: with the sync
            result[f"{mode}_host"] = host_time_us(fn, calls=ISSUED_CALLS, warmup_calls=2)
            result[f"{mode}_kernels"] = _kernels(fn)
            if host_events:
                result[f"{mode}_host_events"] = _host_events(fn, host_events)
        if host_events:  # the forward+backward's parts on their own: the forward recording its graph,
            # then the backward alone (one graph kept and run again)
            leaves = [t.detach().clone().requires_grad_() for t in (problem.q, problem.k, problem.v)]
            out = call(*leaves)
            result["fwd_grad_host"] = host_time_us(lambda: call(*leaves), calls=ISSUED_CALLS, warmup_calls=2)
            result["bwd_host"] = host_time_us(
                lambda: torch.autograd.grad(out, leaves, problem.do, retain_graph=True),
                calls=ISSUED_CALLS,
                warmup_calls=2,
            )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=["64,16384:64-1024", "128,16384:64-1024"])
    parser.add_argument("--families", nargs="+", default=["tl", "gluon"], choices=["tl", "gluon"])
    parser.add_argument("--heads", type=int, default=HEADS)
    parser.add_argument("--host-events", type=int, default=0, help="also list this many host events per call")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = []
    for row in args.rows:
        for family in args.families:
            r = measure(row, family, args.heads, args.host_events)
            results.append(r)
            print(
                f"{row:22} {family:6} fwd {r['fwd_ms'] * 1e3:7.1f} us (host {r['fwd_host']['issue_us']:6.1f})"
                f"  f+b {r['fwd_bwd_ms'] * 1e3:7.1f} us (host {r['fwd_bwd_host']['issue_us']:6.1f})"
            )
            for k in r["fwd_bwd_kernels"][:8]:
                print(f"    {k['device_us_per_call']:8.1f} us x{k['launches_per_call']:.0f}  {k['kernel']}")
            if "bwd_host" in r:
                print(
                    f"    issue: forward with graph {r['fwd_grad_host']['issue_us']:.1f} us, backward alone"
                    f" {r['bwd_host']['issue_us']:.1f} us"
                )
            for e in r.get("fwd_bwd_host_events", []):
                print(
                    f"    host {e['self_cpu_us_per_call']:8.1f} us x{e['count_per_call']:.0f}  {e['event']}"
                )
    if args.out:
        payload = {
            "command": command_line(),
            "env": env_fingerprint(),
            "config": vars(args),
            "results": results,
        }
        write_json(args.out, payload)


if __name__ == "__main__":
    main()
