"""thd's own host work per eager attention call, on CPU, with the kernel launches stubbed.

The problem of ``bench_host.py`` (2 documents of 64 tokens, bf16, 16 heads, head dim 128,
causal, ``max_seqlen_*`` given) on CPU tensors, forced onto the ``tl`` kernel family
(``THD_ATTENTION_BACKEND=triton``, ``THD_KERNELS=tl``), with no kernel run. ``--launcher``:

- ``fast`` (default): every launch goes through :class:`thd._runtime.launcher.KernelLauncher`'s
  cached path as on the GPU (its key of the arguments, its cache lookup, the call of the compiled
  kernel's launcher), with a stand-in for Triton's CUDA driver (device 0, stream 0) and a no-op in
  place of the compiled kernel's launcher: the first launch of a key records a no-op entry where
  the GPU would record the compiled kernel. It needs a Triton the launcher reviewed (3.6 / 3.9).
- ``stub``: ``KernelLauncher.run`` itself is a no-op (what is left is thd's work above the launcher).
- ``real``: nothing is stubbed. On a GPU the tensors live there and every kernel runs (each timed
  loop ends with a sync): the GPU machine's own host time, and with ``--ring`` the ring's against
  the single call's on one GPU (issue 22's ring goal) where no second GPU is lent. On CPU it needs
  ``TRITON_INTERPRET=1`` (the kernels interpreted: a smoke test, not a timing). Launches are not
  counted.

``--family gluon`` takes the Gluon kernels' host path instead (``THD_KERNELS=gluon``): CPU tensors
pass for an sm_90 device of 132 SMs (the wrappers' device checks are replaced), which needs a
Triton with Gluon; the work-list kernel's launch is stubbed like the others.

``--offsets fresh`` passes a new copy of the offsets each call (as a data loader does per batch).
``--layout TOKENS:MIX`` takes a benchmark layout's packed documents instead of the two of 64 tokens
(with ``--launcher real`` on a GPU: the host's work per call on the rows ``bench_attention.py`` times).

``--ring CP`` times ``thd.cp.ring_attention`` instead, as rank 0 of a ``CP``-rank ring run alone
(``tests/cp/_thread_ring.py``'s one-rank ring, on this rank's ``1/CP`` of the rows, the offsets
also as slots), its exchanges doing nothing, like the launches: the ring's own host work per call
(its plan, per-step layouts and launches) beside the single-device call's.

Modes: ``fwd`` (forward under ``no_grad``) and ``fwd_bwd`` (forward, then ``torch.autograd.grad``
of q, k, v), as ``bench_host.py`` times them. Per mode: ``us_per_call``, the median over
``--rounds`` loops of ``--calls`` calls (``time.perf_counter``), and a cProfile breakdown of one
more loop (functions by own time per call; profiling inflates small functions, so read it for the
shares, the timing loops for the totals). Kernel launches per call are counted and printed, with
the launch plans one warm call adds (forward, backward: the plans it missed). On a GPU autograd
runs the backward on its device thread; ``--autograd-threads off`` keeps it on the calling thread.

    PYTHONPATH=src:. python benchmarks/profile_host.py                  # both modes, table + profile
    PYTHONPATH=src:. python benchmarks/profile_host.py --json /tmp/host-cpu.json --top 0
    PYTHONPATH=src:benchmarks:. python benchmarks/profile_host.py --ring 2 --offsets fresh
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace
from typing import Any

import torch
from _common import (
    add_autograd_threads_argument,
    autograd_multithreading,
    autograd_threads,
    document_lengths,
    offsets_tensor,
)
from attention_measure import timed_fn
from attention_providers import MIXES, LayoutSpec

MODES = ("fwd", "fwd_bwd")
ENV = {"THD_ATTENTION_BACKEND": "triton", "THD_KERNELS": "tl"}
LAUNCHES: Counter[str] = Counter()
NORMAL_LAUNCHES: Counter[str] = Counter()  # --launcher fast: the launches that took Triton's normal path


def _kernel_name(launcher: Any) -> str:
    return str(getattr(launcher.fn, "__name__", launcher.fn))


@contextmanager
def stubbed_launches(mode: str) -> Iterator[None]:
    """Kernel launches replaced by no-ops (see the module docstring), undone on exit."""
    from thd._runtime import launcher as launcher_mod

    cls = launcher_mod.KernelLauncher
    names = ("run", "run_fixed", "_normal", "_remember")  # run_fixed: not in every version measured
    saved = {name: cls.__dict__[name] for name in names if name in cls.__dict__}
    if mode == "real":
        yield
        return
    if mode == "stub":

        def run(self: Any, grid: Sequence[int], *args: Any, **kwargs: Any) -> None:
            LAUNCHES[_kernel_name(self)] += 1

        def run_fixed(self: Any, token: object, grid: Sequence[int], *rest: Any) -> None:
            LAUNCHES[_kernel_name(self)] += 1

        cls.run, cls.run_fixed = run, run_fixed  # type: ignore[method-assign]
    else:
        state = launcher_mod._resolve()
        if state is None:
            raise SystemExit("profile_host: the launcher's fast path is off here (THD_FAST_LAUNCH, Triton)")
        active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 0)
        state.jit_module = SimpleNamespace(driver=SimpleNamespace(active=active))

        def normal(self: Any, grid: Any, args: tuple, kwargs: dict) -> object:
            self.normal_launches += 1
            LAUNCHES[_kernel_name(self)] += 1
            NORMAL_LAUNCHES[_kernel_name(self)] += 1
            return None

        def remember(self: Any, state: Any, key: tuple, *rest: Any) -> None:
            name = _kernel_name(self)

            def noop_launch(*args: Any) -> None:  # where the GPU calls the compiled kernel
                LAUNCHES[name] += 1

            self._cache[key] = [noop_launch, None, None, None, False, self._layout(state)[1]]

        cls._normal, cls._remember = normal, remember  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(cls, name, value)
        launcher_mod.reload_settings()


def problem(
    heads: int, head_dim: int, lengths: Sequence[int], dtype: torch.dtype, device: str = "cpu"
) -> SimpleNamespace:
    """Packed documents of ``lengths`` tokens, ``max_seqlen_*`` their longest."""
    gen = torch.Generator().manual_seed(0)
    rows = sum(lengths)
    q, k, v, do = (
        torch.randn(rows, heads, head_dim, dtype=dtype, generator=gen).to(device) for _ in range(4)
    )
    cu = offsets_tensor(lengths, device)
    return SimpleNamespace(q=q, k=k, v=v, do=do, cu=cu, max_len=max(lengths))


def document_lengths_of(layout: LayoutSpec | None) -> list[int]:
    """``bench_host.py``'s two documents of 64 tokens, or the packed documents of a benchmark
    layout (``bench_attention.py``'s lengths with its default seed)."""
    if layout is None:
        return [64, 64]
    return document_lengths(layout.tokens, *MIXES[layout.mix], seed=layout.seed(0))


def call_fn(p: SimpleNamespace, mode: str, fresh_offsets: bool, ring: int = 0) -> Callable[[], object]:
    """One eager call of ``mode`` as ``bench_host.py`` makes it (``fresh_offsets``: with a new copy
    of the offsets each call, as a data loader gives every batch). ``ring``: the ring's call on
    rank 0's shard of a ring of that many ranks instead (run inside :func:`alone_in_ring`)."""
    import thd
    import thd.cp

    bounds = {"max_seqlen_q": p.max_len, "max_seqlen_kv": p.max_len}

    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        cu = p.cu.clone() if fresh_offsets else p.cu
        if ring:
            return thd.cp.ring_attention(q, k, v, cu, cu, cu, cu, **bounds, causal=True)
        return thd.attention(q, k, v, cu, cu, **bounds, causal=True)

    if ring:
        rows = p.q.shape[0] // ring
        p = SimpleNamespace(**{**vars(p), **{n: getattr(p, n)[:rows].clone() for n in ("q", "k", "v", "do")}})
    return timed_fn(attn, p, mode)  # type: ignore[arg-type]  # p: q, k, v, do as it needs


@contextmanager
def as_gluon_device() -> Iterator[None]:
    """The Gluon wrappers take CPU tensors as on an sm_90 GPU of 132 SMs (``--family gluon``); the
    plans and work lists made for that stand-in device are forgotten after the block."""
    import pytest

    from thd.ops.attention.gluon import backward as gluon_backward
    from thd.ops.attention.gluon import forward as gluon_forward
    from thd.ops.attention.gluon import host as gluon_host
    from thd.ops.attention.gluon.work_lists import clear_work_lists

    with pytest.MonkeyPatch.context() as patch:
        for module in (gluon_forward, gluon_host):  # the backward asks ``host.on_gluon_device``
            patch.setattr(module, "on_gluon_device", lambda t: True)
        patch.setattr(gluon_forward, "num_sms", lambda index: 132)
        patch.setattr(gluon_forward, "device_index", lambda device: 0)
        patch.setattr(gluon_backward, "device_sms", lambda t: 132)
        try:
            yield
        finally:
            gluon_forward.PLANS.clear()
            gluon_backward.PLANS.clear()
            clear_work_lists()


@contextmanager
def alone_in_ring(cp: int) -> Iterator[None]:
    """``thd.cp.ring_attention`` runs as rank 0 of ``cp`` ranks in this thread, with no process
    group, no validation reads and exchanges that move nothing (the launches are stubbed too)."""
    import pytest

    from tests.cp._thread_ring import SelfComm, one_rank_ring

    class Idle(SelfComm):
        def start(self, ops: list[tuple[bool, torch.Tensor, int]]) -> SelfComm:
            return self

    comm = Idle(cp, 0)
    with pytest.MonkeyPatch.context() as patch:
        one_rank_ring(patch, lambda: comm)
        yield


def plan_counts(family: str) -> tuple[int, int]:
    """The family's cached forward and backward plans (a warm call that adds some missed)."""
    if family == "gluon":
        from thd.ops.attention.gluon import backward, forward

        return len(forward.PLANS), len(backward.PLANS)
    from thd.ops.attention import launch

    return launch.plan_counts()


def time_loop(fn: Callable[[], object], calls: int, cuda: bool = False) -> float:
    """Wall µs per call over ``calls`` back-to-back calls (``cuda``: synced before and after)."""
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


def profile_rows(fn: Callable[[], object], calls: int, top: int) -> list[dict[str, Any]]:
    """The ``top`` functions by own time per call under cProfile (µs, calls per call)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = []
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in stats.items():
        where = f"{os.path.basename(path)}:{line}" if line else path
        rows.append(
            {
                "function": f"{where}({name})",
                "calls": ncalls / calls,
                "own_us": tottime * 1e6 / calls,
                "cum_us": cumtime * 1e6 / calls,
            }
        )
    rows.sort(key=lambda r: r["own_us"], reverse=True)
    return rows[:top]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.launcher == "real" and torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda or args.launcher != "real" else torch.float32  # the interpreter: fp32
    lengths = document_lengths_of(args.layout)
    p = problem(args.heads, args.head_dim, lengths, dtype, "cuda" if cuda else "cpu")
    results: dict[str, Any] = {"documents": len(lengths), "tokens": sum(lengths)}
    with stubbed_launches(args.launcher), ExitStack() as stack:
        if args.ring:
            stack.enter_context(alone_in_ring(args.ring))
        if args.family == "gluon" and args.launcher != "real":
            stack.enter_context(as_gluon_device())
        fns = {mode: call_fn(p, mode, args.offsets == "fresh", args.ring) for mode in args.modes}
        for mode, fn in fns.items():
            for _ in range(20):  # first calls: imports, caches, first launches
                fn()
            LAUNCHES.clear()
            NORMAL_LAUNCHES.clear()
            plans = plan_counts(args.family)
            fn()
            made = [after - before for before, after in zip(plans, plan_counts(args.family), strict=True)]
            results[mode] = {
                "launches_per_call": dict(LAUNCHES),
                "normal_launches_per_call": dict(NORMAL_LAUNCHES),
                "plans_made_per_call": made,
                "rounds_us": [],
            }
        for _ in range(args.rounds):  # the modes take turns
            for mode, fn in fns.items():
                results[mode]["rounds_us"].append(time_loop(fn, args.calls, cuda))
        for mode, fn in fns.items():
            results[mode]["us_per_call"] = statistics.median(results[mode]["rounds_us"])
            if args.top:
                results[mode]["profile"] = profile_rows(fn, args.profile_calls, args.top)
    from thd.ops.attention import kernel_choice

    for mode in args.modes:
        phases = ("forward", "backward") if mode == "fwd_bwd" else ("forward",)
        results[mode]["families"] = {ph: getattr(kernel_choice(ph), "family", None) for ph in phases}
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--launcher", default="fast", choices=("fast", "stub", "real"))
    parser.add_argument(
        "--family", default="tl", choices=("tl", "gluon"), help="the kernel family whose host path runs"
    )
    parser.add_argument(
        "--offsets", default="same", choices=("same", "fresh"), help="fresh: new offset tensors each call"
    )
    parser.add_argument(
        "--ring",
        type=int,
        default=0,
        metavar="CP",
        help="time thd.cp.ring_attention as rank 0 of CP ranks, alone",
    )
    parser.add_argument("--calls", type=int, default=400, help="calls per timed loop")
    parser.add_argument("--rounds", type=int, default=7, help="timed loops per mode (median)")
    parser.add_argument("--profile-calls", type=int, default=200, help="calls in the cProfile loop")
    parser.add_argument("--top", type=int, default=25, help="profile rows per mode (0: no profile)")
    parser.add_argument(
        "--layout",
        default=None,
        type=LayoutSpec.parse,
        metavar="TOKENS:MIX",
        help="a benchmark layout's packed documents (e.g. 16384:64-1024) instead of two of 64 tokens",
    )
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    add_autograd_threads_argument(parser)
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.layout and args.ring:
        parser.error("--layout with --ring: the ring's shards need lengths divisible by 2 * CP")
    if args.layout and args.layout.slot > 1:
        parser.error(f"--layout {args.layout.text}: packed layouts only (no slot size)")
    if os.environ.get("TRITON_INTERPRET") == "1" and args.launcher != "real":
        raise SystemExit("profile_host: unset TRITON_INTERPRET (the launches are stubbed, not interpreted)")
    env = {**ENV, "THD_KERNELS": args.family}
    os.environ.update(env)
    with autograd_threads(args.autograd_threads):
        results = measure(args)
        results["autograd_multithreading"] = autograd_multithreading()
    print(f"{results['documents']} documents, {results['tokens']} tokens")
    for mode in args.modes:
        r = results[mode]
        rounds = " ".join(f"{t:.1f}" for t in r["rounds_us"])
        print(
            f"{mode:<8} {r['us_per_call']:8.1f} us/call (median; rounds {rounds}) "
            f"launches {r['launches_per_call']} plans made {r['plans_made_per_call']} "
            f"families {r['families']}"
        )
        for row in r.get("profile", []):
            print(
                f"    {row['own_us']:7.2f} own {row['cum_us']:8.2f} cum {row['calls']:5.1f}x"
                f"  {row['function']}"
            )
    if args.json:
        with open(args.json, "w") as fh:
            config = {**vars(args), "layout": args.layout.text if args.layout else None}
            json.dump({"config": config, "env": env, "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
