"""``thd.attention`` on a CUDA GPU (``make test-gpu``): realistic sizes against a float64 reference.

Covers head dims 8 to 256 (dims the installed thd refuses are skipped with its reason, so they
light up once supported), ``Dv != D``, bf16/fp16/fp32 (TF32) with per-dtype tolerances, GQA/MQA,
padding layouts, cross attention, both backward modes, bitwise determinism,
``torch.compile(fullgraph=True)``, CUDA-graph capture and replay with new ``cu_seqlens``
values, no host sync when ``max_seqlen_*`` are given and 64-bit row offsets.

The oracle is :func:`thd.ops.attention.reference.attention` run in float64 on the same
(rounded) inputs and differentiated by autograd. Outputs are compared elementwise on real rows
(``lse`` in fp32), every output and gradient also by relative error ``||a - b|| / ||b||`` and
row by row, and padding rows (NaN-poisoned in q, k, v) must hold exact zeros (``-inf`` in lse).

Tile configurations: ``make test-gpu`` runs this file twice. The first process runs every test
but the ``autotuned`` ones with the library's default tiles. The second, with
``THD_AUTOTUNE=1``, runs the benchmark shapes again (the autotuner picks the tiles, as in
``benchmarks/bench_attention.py``) and forces every tile the autotuner may pick, one at a time,
against the reference (``test_attention_gpu_autotuned_every_candidate_tile``).
"""

from __future__ import annotations

import importlib
import math
import os
import pkgutil
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

import thd
from tests._helpers import (
    Layout,
    assert_close,
    assert_rows_equal,
    make_layout,
    make_qkv,
    poison_rows,
    poisoned_allocations,
    reference64,
)
from thd.errors import ThdValueError

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NAMES = ("out", "lse", "dq", "dk", "dv")


@dataclass(frozen=True)
class Tolerance:
    """Bounds against the float64 reference for one input dtype.

    ``out_atol``/``out_rtol``: elementwise, out on real rows. ``lse_atol``: elementwise, lse in
    fp32 on real rows. ``rel_out``/``rel_grad``: ``||a - b|| / ||b||`` over real rows; each row
    (token, head) must also satisfy ``||a_r - b_r|| <= ROW_FACTOR * rel * (||b_r|| + rms_r ||b_r||)``,
    which catches a few wrong rows that a global norm would average away.
    """

    out_atol: float
    out_rtol: float
    lse_atol: float
    rel_out: float
    rel_grad: float


# bf16 keeps 8 mantissa bits, fp16 11; fp32 inputs go through TF32 (11 bits) in tl.dot, so
# they get fp16-like bounds. Expected errors are 3-5x below these (bf16: ~3e-3 out, ~5e-3 grads).
TOLERANCES: dict[torch.dtype, Tolerance] = {
    BF16: Tolerance(out_atol=2.5e-2, out_rtol=2.5e-2, lse_atol=1e-3, rel_out=1e-2, rel_grad=2e-2),
    FP16: Tolerance(out_atol=5e-3, out_rtol=5e-3, lse_atol=1e-3, rel_out=2.5e-3, rel_grad=5e-3),
    FP32: Tolerance(out_atol=5e-3, out_rtol=5e-3, lse_atol=5e-3, rel_out=2.5e-3, rel_grad=5e-3),
}
ROW_FACTOR = 8.0
_DTYPE_NAMES = {BF16: "bf16", FP16: "fp16", FP32: "fp32"}


# --- layouts ----------------------------------------------------------------------------------


def _random_layout(
    name: str, seed: int, count: int, lo: int, hi: int, *, multiple: int = 1, capacity: int = 0
) -> Layout:
    """``count`` random lengths in ``[lo, hi]``, each slot padded up to a multiple of ``multiple``."""
    rng = random.Random(seed)
    lens = [rng.randint(lo, hi) for _ in range(count)]
    return make_layout(name, lens, pad_q=[-n % multiple for n in lens], capacity_q=capacity)


def _bench_layout(tokens: int, lo: int, hi: int, seed: int, *, slot: int = 1, capacity: int = 0) -> Layout:
    """The benchmark's documents (same generator and seed as ``benchmarks/_common.document_lengths``)."""
    rng = random.Random(seed)
    lens: list[int] = []
    while sum(lens) < tokens:
        lens.append(min(rng.randint(lo, hi), tokens - sum(lens)))
    name = f"bench{tokens // 1024}k-{lo}-{hi}" + (f"-slots{slot}" if slot > 1 else "")
    return make_layout(name, lens, pad_q=[-n % slot for n in lens], capacity_q=capacity)


DOCS = _random_layout("docs", 0, 8, 1, 1024, multiple=64, capacity=77)
PACKED = _random_layout("packed", 1, 5, 100, 1500)
SHORT = make_layout("short", [1, 0, 1, 3, 0, 64, 1, 129, 0], pad_q=[0, 2, 1, 1, 0, 0, 7, 0, 3], capacity_q=5)
CROSS = make_layout(
    "cross",
    [300, 1, 0, 700, 65],
    [100, 0, 90, 900, 65],
    pad_q=[4, 0, 16, 3, 0],
    pad_kv=[0, 8, 1, 5, 63],
    capacity_q=9,
    capacity_kv=0,
)
# Benchmark mixes (seed = the mix's index in attention_providers.MIXES), some with slot padding.
BENCH_16K_SHORT = _bench_layout(16384, 64, 1024, seed=0)
BENCH_16K_MID_SLOTS64 = _bench_layout(16384, 256, 4096, seed=1, slot=64, capacity=77)
BENCH_16K_LONG = _bench_layout(16384, 512, 8192, seed=2)
BENCH_32K_LONG_SLOTS128 = _bench_layout(32768, 512, 8192, seed=2, slot=128, capacity=100)


# --- running thd and the reference --------------------------------------------------------------


def _thd(*args: Any, **kwargs: Any) -> Any:
    """``thd.attention``, skipping the test when the installed thd refuses the head dims."""
    try:
        return thd.attention(*args, **kwargs)
    except ThdValueError as exc:
        if "head_dim" in str(exc):
            pytest.skip(f"the installed thd does not take these head dims yet: {exc}")
        raise


def _fwd_bwd(
    fn: Callable[..., Any], inputs: list[Tensor], do: Tensor, kwargs: dict[str, Any]
) -> list[Tensor]:
    """``[out, lse, dq, dk, dv]`` of ``fn`` on fresh leaves made from ``inputs``."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out, lse = fn(*leaves, **kwargs, return_lse=True)
    out.backward(do)
    grads = [t.grad for t in leaves]
    assert all(g is not None for g in grads)
    return [out.detach(), lse.detach(), *(g for g in grads if g is not None)]


def _reference64(
    layout: Layout,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    do: Tensor,
    kwargs: dict[str, Any],
    *,
    budget: int = 8 << 30,
) -> list[Tensor]:
    """Float64 ``[out, lse, dq, dk, dv]`` (:func:`tests._helpers.reference64`)."""
    want = reference64(layout, q, k, v, do, kwargs, budget=budget)
    return [want[name] for name in ("out", "lse", "dq", "dk", "dv")]  # type: ignore[misc]


# --- comparisons ------------------------------------------------------------------------------


def _rel_errors(got: Tensor, want: Tensor) -> tuple[float, float]:
    """``(||a - b|| / ||b||, worst row ||a_r - b_r|| / (||b_r|| + rms_r ||b_r||))`` in float64."""
    a, b = got.double(), want.double()
    diff = (a - b).reshape(-1, a.shape[-1]) if a.dim() else (a - b).reshape(1, 1)
    ref = b.reshape(diff.shape)
    ref_norm = float(ref.norm())
    err_norm = float(diff.norm())
    if ref_norm == 0.0:
        return (0.0 if err_norm == 0.0 else math.inf), (0.0 if err_norm == 0.0 else math.inf)
    rows = ref.norm(dim=-1)
    scale = rows + rows.square().mean().sqrt()
    worst = float((diff.norm(dim=-1) / scale).max()) if rows.numel() else 0.0
    return err_norm / ref_norm, worst


def _assert_rel(name: str, got: Tensor, want: Tensor, bound: float) -> None:
    rel, worst = _rel_errors(got, want)
    if not (rel <= bound and worst <= ROW_FACTOR * bound):
        raise AssertionError(
            f"{name}: ||a-b||/||b|| = {rel:.3e} (bound {bound:.1e}), worst row {worst:.3e} "
            f"(bound {ROW_FACTOR * bound:.1e}); non-finite in result: {int((~torch.isfinite(got)).sum())}"
        )


def _compare(
    layout: Layout, got: list[Tensor], want: list[Tensor], dtype: torch.dtype, *, elementwise: bool = True
) -> None:
    """thd's ``[out, lse, dq, dk, dv]`` against the float64 reference's, on real rows."""
    tol = TOLERANCES[dtype]
    real_q, real_kv = layout.real_rows("q", DEVICE), layout.real_rows("kv", DEVICE)
    out, lse, dq, dk, dv = got
    w_out, w_lse, w_dq, w_dk, w_dv = want
    if elementwise:
        assert_close(out[real_q].float(), w_out[real_q], "out", atol=tol.out_atol, rtol=tol.out_rtol)
        assert_close(lse[:, real_q], w_lse[:, real_q].float(), "lse (fp32)", atol=tol.lse_atol, rtol=0.0)
    _assert_rel("out", out[real_q], w_out[real_q], tol.rel_out)
    finite = torch.isfinite(w_lse[:, real_q])
    _assert_rel("lse", lse[:, real_q][finite], w_lse[:, real_q][finite].float(), tol.rel_out)
    for name, g, w, rows in (("dq", dq, w_dq, real_q), ("dk", dk, w_dk, real_kv), ("dv", dv, w_dv, real_kv)):
        _assert_rel(name, g[rows], w[rows], tol.rel_grad)


def _check_padding(layout: Layout, results: list[Tensor]) -> None:
    """Exact zeros on padding rows of out/dq/dk/dv, ``-inf`` in lse."""
    pad_q, pad_kv = ~layout.real_rows("q", DEVICE), ~layout.real_rows("kv", DEVICE)
    out, lse, dq, dk, dv = results[:5]
    assert_rows_equal(out, pad_q, 0.0, "out")
    assert_rows_equal(lse, pad_q, float("-inf"), "lse", dim=1)
    for name, grad, pad in (("dq", dq, pad_q), ("dk", dk, pad_kv), ("dv", dv, pad_kv)):
        assert_rows_equal(grad, pad, 0.0, name)


def _check_against_reference(
    layout: Layout, hq: int, hkv: int, d: int, dv: int, dtype: torch.dtype, causal: bool
) -> None:
    q, k, v, do = make_qkv(layout, hq, hkv, d, dv, dtype, DEVICE)  # NaN in q, k, v padding rows
    kwargs = {**layout.kwargs(DEVICE), "causal": causal}
    results = {det: _fwd_bwd(_thd, [q, k, v], do, {**kwargs, "deterministic": det}) for det in (False, True)}
    want = _reference64(layout, q, k, v, do, kwargs)
    for det, got in results.items():
        assert got[0].dtype == dtype and got[1].dtype == torch.float32
        try:
            _compare(layout, got, want, dtype)
            _check_padding(layout, got)
        except AssertionError as exc:
            raise AssertionError(f"deterministic={det}: {exc}") from exc


# --- the matrix (default tiles) -----------------------------------------------------------------


def _case(layout: Layout, hq: int, hkv: int, d: int, dv: int, dtype: torch.dtype, causal: bool) -> Any:
    case_id = (
        f"{layout.name}-T{layout.total_q}x{layout.total_kv}-H{hq}x{hkv}-D{d}x{dv}-"
        f"{_DTYPE_NAMES[dtype]}-causal{int(causal)}"
    )
    return pytest.param(layout, hq, hkv, d, dv, dtype, causal, id=case_id)


# Every head-dim class of the kernels (BLOCK_D 16..256) and sizes that are not powers of two.
HEAD_DIMS = (8, 40, 64, 72, 128, 136, 192, 256)
CAUSAL = (False, True)
# The matrix varies one thing at a time around "GQA 8:2, bf16, causal" instead of taking the
# full product: each (D, Dv, dtype, causal, group) combination compiles its own kernels.
CASES = (
    [_case(DOCS, 8, 2, d, d, BF16, True) for d in HEAD_DIMS]  # every head-dim class and odd sizes
    + [_case(DOCS, 8, 2, d, d, BF16, False) for d in (40, 64, 128)]
    + [_case(DOCS, 8, 2, 128, 128, FP16, True), _case(DOCS, 8, 2, 72, 72, FP16, False)]
    + [_case(DOCS, 8, 2, 64, 64, FP32, True), _case(DOCS, 8, 2, 128, 128, FP32, False)]  # TF32
    + [
        _case(DOCS, 8, 2, 192, 128, BF16, True),  # Dv != D
        _case(DOCS, 8, 2, 128, 64, BF16, False),
        _case(DOCS, 8, 2, 64, 256, BF16, True),
        _case(DOCS, 8, 2, 72, 40, BF16, True),
        _case(DOCS, 8, 2, 8, 136, FP16, True),
    ]
    + [_case(DOCS, 8, 1, 128, 128, BF16, True), _case(DOCS, 4, 4, 128, 128, BF16, True)]  # MQA, MHA
    + [_case(lay, 8, 2, 128, 128, BF16, c) for lay in (PACKED, SHORT, CROSS) for c in CAUSAL]
)


@pytest.mark.parametrize(("layout", "hq", "hkv", "d", "dv", "dtype", "causal"), CASES)
def test_attention_gpu_matches_fp64_reference(
    layout: Layout, hq: int, hkv: int, d: int, dv: int, dtype: torch.dtype, causal: bool
) -> None:
    _check_against_reference(layout, hq, hkv, d, dv, dtype, causal)


# --- benchmark shapes: default tiles, and again with the autotuner's picks -----------------------

BENCH_CASES = [
    pytest.param(BENCH_16K_SHORT, 128, id="16k-64-1024-D128"),
    pytest.param(BENCH_32K_LONG_SLOTS128, 128, id="32k-512-8192-slots128-D128"),
    pytest.param(BENCH_16K_MID_SLOTS64, 64, id="16k-256-4096-slots64-D64"),
    pytest.param(BENCH_16K_LONG, 64, id="16k-512-8192-D64"),
]


@pytest.mark.parametrize(("layout", "d"), BENCH_CASES)
def test_attention_gpu_benchmark_shapes(layout: Layout, d: int) -> None:
    """The benchmark's configuration (bf16, 16 heads, causal, default backward) at its sizes.

    Also the forward under ``no_grad``, the path the forward benchmark times.
    """
    q, k, v, do = make_qkv(layout, 16, 16, d, d, BF16, DEVICE)
    kwargs = {**layout.kwargs(DEVICE), "causal": True}
    got = _fwd_bwd(_thd, [q, k, v], do, kwargs)
    with torch.no_grad():
        fwd_only = _thd(q, k, v, **kwargs)
    want = _reference64(layout, q, k, v, do, kwargs)
    _compare(layout, got, want, BF16)
    _check_padding(layout, got)
    real_q = layout.real_rows("q", DEVICE)
    tol = TOLERANCES[BF16]
    assert_close(
        fwd_only[real_q].float(), want[0][real_q], "out (no_grad)", atol=tol.out_atol, rtol=tol.out_rtol
    )
    assert_rows_equal(fwd_only, ~real_q, 0.0, "out (no_grad)")


def _autotuners() -> list[tuple[str, Any]]:
    """Every ``triton.autotune`` wrapper reachable from the modules of ``thd.ops.attention``."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return []
    import thd.ops.attention as package

    found: dict[int, tuple[str, Any]] = {}

    def visit(name: str, obj: object, depth: int) -> None:
        if depth > 3:
            return
        if isinstance(obj, Autotuner):
            base = getattr(obj, "base_fn", None)
            found.setdefault(id(obj), (getattr(base, "__name__", name), obj))
        elif isinstance(obj, dict):
            for key, value in obj.items():
                visit(f"{name}[{key!r}]", value, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                visit(f"{name}[{i}]", value, depth + 1)
        elif type(obj).__module__.startswith("triton"):  # e.g. heuristics around an autotuner
            visit(name, getattr(obj, "fn", None), depth + 1)

    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        module = importlib.import_module(info.name)
        for attr, obj in vars(module).items():
            visit(f"{info.name}.{attr}", obj, 0)
    return list(found.values())


@contextmanager
def _fresh_autotuning(tuners: list[tuple[str, Any]]) -> Iterator[dict[int, list[Any]]]:
    """Forget the tuned choices and record, per autotuner, the configs it considers (after its
    own pruning) while the block runs; the earlier choices are restored afterwards."""
    considered: dict[int, list[Any]] = {}
    saved = []
    for _, tuner in tuners:
        cache = dict(tuner.cache)
        tuner.cache.clear()
        original = tuner.prune_configs

        def prune(*args: Any, _tuner: Any = tuner, _original: Any = original, **kwargs: Any) -> Any:
            pruned = _original(*args, **kwargs)
            seen = considered.setdefault(id(_tuner), [])
            seen += [c for c in pruned if all(c is not s for s in seen)]
            return pruned

        tuner.prune_configs = prune
        saved.append((tuner, cache))
    try:
        yield considered
    finally:
        for tuner, cache in saved:
            del tuner.prune_configs
            tuner.cache.update(cache)


def _is_resource_error(exc: BaseException) -> bool:
    """Errors for which the autotuner drops a config (it never picks one that raises them)."""
    chain: BaseException | None = exc
    while chain is not None:
        if (
            type(chain).__name__ in ("OutOfResources", "PTXASError")
            or "out of resource" in str(chain).lower()
        ):
            return True
        chain = chain.__cause__ or chain.__context__
    return False


SWEEP_CASES = [
    pytest.param(BENCH_16K_SHORT, 128, id="16k-64-1024-D128"),
    pytest.param(BENCH_16K_MID_SLOTS64, 64, id="16k-256-4096-slots64-D64"),
    pytest.param(DOCS, 256, id="docs-D256"),
]


@pytest.mark.parametrize(("layout", "d"), SWEEP_CASES)
def test_attention_gpu_autotuned_every_candidate_tile(layout: Layout, d: int) -> None:
    """Every config each autotuner considers for this shape, forced alone, matches the reference.

    The autotuner picks by speed on the machine at hand, so the tiles a benchmark ends up with
    are not known in advance: all of them are checked, in both backward modes. A config that
    does not fit the GPU (out of shared memory) is one the autotuner skips too; it is reported,
    not failed.
    """
    tuners = _autotuners()
    if not tuners:
        pytest.skip(
            "no Triton autotuner in thd.ops.attention (fixed tiles); make test-gpu sets THD_AUTOTUNE=1"
        )
    q, k, v, do = make_qkv(layout, 16, 16, d, d, BF16, DEVICE)
    kwargs = {**layout.kwargs(DEVICE), "causal": True}
    want = _reference64(layout, q, k, v, do, kwargs)
    modes = (False, True)
    with _fresh_autotuning(tuners) as considered:
        for det in modes:  # autotunes every kernel for this shape, recording its candidates
            got = _fwd_bwd(_thd, [q, k, v], do, {**kwargs, "deterministic": det})
            _compare(layout, got, want, BF16, elementwise=False)
    failures: list[str] = []
    dropped: list[str] = []
    checked = 0
    for name, tuner in tuners:
        configs = considered.get(id(tuner), [])
        if len(configs) < 2:
            continue  # not launched for this shape, or only one choice (checked above)
        saved = tuner.configs
        try:
            for config in configs:
                tuner.configs = [config]
                for det in modes:
                    what = f"{name} {config} deterministic={det}"
                    try:
                        got = _fwd_bwd(_thd, [q, k, v], do, {**kwargs, "deterministic": det})
                        torch.cuda.synchronize()
                    except Exception as exc:
                        if _is_resource_error(exc):
                            dropped.append(what)
                            break
                        failures.append(f"{what}: {type(exc).__name__}: {exc}")
                        continue
                    checked += 1
                    try:
                        _compare(layout, got, want, BF16, elementwise=False)
                        _check_padding(layout, got)
                    except AssertionError as exc:
                        failures.append(f"{what}: {exc}")
        finally:
            tuner.configs = saved
    assert not failures, f"{len(failures)} of {checked} forced configs fail:\n" + "\n".join(failures)
    if dropped:
        print(f"configs that do not fit (the autotuner skips them too): {dropped}")


def test_attention_gpu_autotuned_mode_is_on() -> None:
    """The second ``make test-gpu`` process must really autotune: otherwise the sweep checks nothing."""
    if os.environ.get("THD_AUTOTUNE") != "1":
        pytest.skip("checks the THD_AUTOTUNE=1 process of make test-gpu")
    assert _autotuners(), "THD_AUTOTUNE=1 but no Triton autotuner found in thd.ops.attention"


# --- guarantees (default tiles) -----------------------------------------------------------------


@pytest.mark.parametrize("causal", CAUSAL, ids=["causal0", "causal1"])
def test_attention_gpu_deterministic_is_bitwise_repeatable(causal: bool) -> None:
    """Repeated calls agree bitwise; fresh allocations hold NaN, so unwritten rows cannot agree."""
    q, k, v, do = make_qkv(DOCS, 8, 2, 128, 128, torch.bfloat16, DEVICE)
    kwargs = {**DOCS.kwargs(DEVICE), "causal": causal, "deterministic": True}
    with poisoned_allocations():
        first = _fwd_bwd(thd.attention, [q, k, v], do, kwargs)
    _check_padding(DOCS, first)
    for _ in range(3):
        again = _fwd_bwd(thd.attention, [q, k, v], do, kwargs)
        for name, a, b in zip(NAMES, again, first, strict=True):
            assert torch.equal(a, b), f"{name} differs between repeated deterministic calls"


class _Attention(torch.nn.Module):
    """A module whose forward calls ``thd.attention`` with fixed layout buffers."""

    def __init__(self, layout: Layout) -> None:
        super().__init__()
        kwargs = layout.kwargs(DEVICE)
        for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            self.register_buffer(name, kwargs[name])
        self.max_seqlen_q: int = kwargs["max_seqlen_q"]
        self.max_seqlen_kv: int = kwargs["max_seqlen_kv"]

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return thd.attention(  # type: ignore[return-value]
            q,
            k,
            v,
            self.cu_seqlens_q,
            self.cu_seqlens_kv,
            cu_seqlens_q_padded=self.cu_seqlens_q_padded,
            cu_seqlens_kv_padded=self.cu_seqlens_kv_padded,
            max_seqlen_q=self.max_seqlen_q,
            max_seqlen_kv=self.max_seqlen_kv,
            causal=True,
            return_lse=True,
            deterministic=True,  # bitwise comparison below: no atomics
        )


def test_attention_gpu_torch_compile_fullgraph() -> None:
    q, k, v, do = make_qkv(DOCS, 8, 2, 128, 128, torch.bfloat16, DEVICE)
    module = _Attention(DOCS)
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True)
    eager = _fwd_bwd(lambda *a, return_lse: module(*a), [q, k, v], do, {})
    got = _fwd_bwd(lambda *a, return_lse: compiled(*a), [q, k, v], do, {})
    for name, a, b in zip(NAMES, got, eager, strict=True):
        assert torch.equal(a, b), f"{name}: compiled result differs from eager"


# Same number of sequences (cu shapes) and buffer size, different boundaries: slot padding,
# none, zero-length and one-token sequences, reserved capacity of different sizes.
_GRAPH_ROWS = 2048
_GRAPH_LAYOUTS = [
    make_layout("g0", [300, 5, 700, 1, 0, 420], pad_q=[4, 59, 0, 3, 8, 1], capacity_q=547),
    make_layout("g1", [1000, 0, 0, 1, 640, 333], pad_q=0, capacity_q=74, padded=True),
    make_layout("g2", [1, 1, 1, 2045, 0, 0], pad_q=0, padded=True),
    make_layout("g3", [64, 128, 256, 512, 33, 7], pad_q=[0, 64, 0, 1, 31, 9], capacity_q=943),
]


@pytest.mark.parametrize("captured", [0, 2], ids=["capture-slot-padded", "capture-unpadded"])
def test_attention_gpu_cuda_graph_replay_with_new_cu_seqlens(captured: int) -> None:
    """Capture forward+backward once, replay with other cu_seqlens values: equal to eager, bitwise.

    Captured on a layout with slot padding, or on one without (``cup == cu`` by value), then
    replayed on all others: a padding decision taken on the host at capture time would leave
    the later layouts' slot padding unzeroed.
    """
    assert all(lay.total_q == _GRAPH_ROWS for lay in _GRAPH_LAYOUTS)
    hq, hkv, d = 8, 2, 128
    first = _GRAPH_LAYOUTS[captured]
    static = first.kwargs(DEVICE, max_seqlen=False)
    bounds = {"max_seqlen_q": _GRAPH_ROWS, "max_seqlen_kv": _GRAPH_ROWS}
    call_kwargs = {**static, **bounds, "causal": True, "deterministic": True}
    q, k, v, do = (t.detach().clone() for t in make_qkv(first, hq, hkv, d, d, torch.bfloat16, DEVICE))
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def step() -> tuple[Tensor, Tensor]:
        out, lse = thd.attention(*leaves, **call_kwargs, return_lse=True)
        out.backward(do)
        return out, lse

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: compiles and allocator pools, outside capture
            step()
            for t in leaves:
                t.grad = None
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_lse = step()
    static_grads = [t.grad for t in leaves]

    for layout in _GRAPH_LAYOUTS[captured + 1 :] + _GRAPH_LAYOUTS[: captured + 1]:
        new_q, new_k, new_v, new_do = make_qkv(layout, hq, hkv, d, d, torch.bfloat16, DEVICE)
        new_kwargs = layout.kwargs(DEVICE, max_seqlen=False)
        with torch.no_grad():
            for dst, src in zip((q, k, v, do), (new_q, new_k, new_v, new_do), strict=True):
                dst.copy_(src)
            for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
                static[name].copy_(new_kwargs[name])
        graph.replay()
        torch.cuda.synchronize()
        eager = _fwd_bwd(
            thd.attention,
            [new_q, new_k, new_v],
            new_do,
            {**new_kwargs, **bounds, "causal": True, "deterministic": True},
        )
        replayed = [static_out, static_lse, *static_grads]
        for name, a, b in zip(NAMES, replayed, eager, strict=True):
            assert a is not None
            assert torch.equal(a, b), f"{layout.name}: replayed {name} differs from eager"
        _check_padding(layout, [t for t in replayed if t is not None])


def test_attention_gpu_rejects_capture_without_max_seqlen() -> None:
    q, k, v, _ = make_qkv(DOCS, 4, 4, 64, 64, torch.bfloat16, DEVICE, poison=0.0)
    kwargs = DOCS.kwargs(DEVICE, max_seqlen=False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ThdValueError, match="max_seqlen"), torch.cuda.graph(graph):
        thd.attention(q, k, v, **kwargs, causal=True)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic"])
def test_attention_gpu_no_host_sync_with_max_seqlen(deterministic: bool) -> None:
    q, k, v, do = make_qkv(DOCS, 8, 2, 128, 128, torch.bfloat16, DEVICE)
    kwargs = {**DOCS.kwargs(DEVICE), "causal": True, "deterministic": deterministic}
    _fwd_bwd(thd.attention, [q, k, v], do, kwargs)  # warm-up: compiles (and autotuning) synchronize
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _lse = thd.attention(*leaves, **kwargs, return_lse=True)
        out.backward(do)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic"])
@pytest.mark.parametrize("family", ["tl", "gluon"])
def test_attention_gpu_calls_return_before_the_gpu_is_done(
    family: str, deterministic: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Oracle: a GPU sleep of about 100 ms queued ahead of the call. Issuing a forward and a
    backward on the benchmark's short documents (stated bounds) waits for no GPU work, so the host
    gets its control back long before the sleep ends. ``set_sync_debug_mode`` (the test above) sees
    only torch's synchronizing calls; this sees any wait (an allocator, a pageable copy, a driver
    call). Both families, both dQ modes."""
    monkeypatch.setenv("THD_KERNELS", family)
    layout = BENCH_16K_SHORT
    q, k, v, do = make_qkv(layout, 16, 16, 64, 64, torch.bfloat16, DEVICE)
    kwargs = {**layout.kwargs(DEVICE), "causal": True, "deterministic": deterministic}
    try:
        for _ in range(2):  # compiles, plans, work lists and the allocator's blocks
            _fwd_bwd(thd.attention, [q, k, v], do, kwargs)
    except ThdValueError as exc:
        pytest.skip(f"THD_KERNELS={family} does not take the call here: {exc}")
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch.cuda.synchronize()
    sleep_start, sleep_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sleep_start.record()
    torch.cuda._sleep(200_000_000)  # about 100 ms at Hopper's clocks
    sleep_end.record()
    started = time.perf_counter()
    out = thd.attention(*leaves, **kwargs)
    torch.autograd.grad(out, leaves, do)
    host_ms = (time.perf_counter() - started) * 1e3
    torch.cuda.synchronize()
    slept_ms = sleep_start.elapsed_time(sleep_end)
    assert slept_ms > 20.0, f"the sleep took {slept_ms:.1f} ms: too short to tell"
    assert host_ms < slept_ms / 4, f"the call held the host {host_ms:.1f} ms of a {slept_ms:.1f} ms GPU sleep"


def test_attention_gpu_rows_past_32bit_element_offsets() -> None:
    """Real rows beyond 2**31 elements from the buffer start (64-bit offsets in the kernels)."""
    if torch.cuda.get_device_properties(0).total_memory < 100 * 2**30:
        pytest.skip("needs a GPU with 100 GiB (uses about 60 GiB)")
    heads, d = 16, 128
    _check_far_rows(gap=(2**31) // (heads * d) + 1000, heads=heads, d=d)


def _check_far_rows(gap: int, heads: int, d: int) -> None:
    """A 300-token sequence, ``gap`` padding rows, then a 257-token sequence and a short tail."""
    layout = make_layout("far", [300, 257], pad_q=[gap, 0], capacity_q=3)
    q, k, v, do = make_qkv(layout, heads, heads, d, d, torch.bfloat16, DEVICE, poison=None)
    kwargs = {**layout.kwargs(DEVICE), "causal": True}
    got = _fwd_bwd(thd.attention, [q, k, v], do, kwargs)
    # The reference on the compact (unpadded) copy of the real rows.
    real_q, real_kv = layout.real_rows("q", DEVICE), layout.real_rows("kv", DEVICE)
    compact = make_layout("compact", [300, 257])
    want = _reference64(
        compact, q[real_q], k[real_kv], v[real_kv], do[real_q], {**compact.kwargs(DEVICE), "causal": True}
    )
    picks = (real_q, None, real_q, real_kv, real_kv)
    compact_got = [g[:, real_q] if rows is None else g[rows] for g, rows in zip(got, picks, strict=True)]
    _compare(compact, compact_got, want, torch.bfloat16)
    pad_q = ~real_q
    assert bool((got[0][pad_q] == 0).all()) and bool((got[1][:, pad_q] == float("-inf")).all())
    assert bool((got[2][pad_q] == 0).all())


def test_attention_gpu_poisoned_padding_changes_nothing() -> None:
    q, k, v, do = make_qkv(CROSS, 8, 2, 128, 128, torch.bfloat16, DEVICE)
    kwargs = {**CROSS.kwargs(DEVICE), "causal": True, "deterministic": True}
    with poisoned_allocations():  # NaN in fresh memory as well as in the padding rows
        nan = _fwd_bwd(thd.attention, [q, k, v], do, kwargs)
    _check_padding(CROSS, nan)
    sides = ((q, "q"), (k, "kv"), (v, "kv"))
    garbage = [poison_rows(t, CROSS.real_rows(s, DEVICE), 6e4) for t, s in sides]
    other = _fwd_bwd(thd.attention, garbage, do, kwargs)
    for name, a, b in zip(NAMES, nan, other, strict=True):
        assert torch.equal(a, b), f"{name} depends on the contents of padding rows"
