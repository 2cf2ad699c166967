"""The ``tl`` kernel family: launchers of the Triton attention kernels (grids, allocation, arguments).

Tiles, register caps, the dQ mode and the TMA switch come from :mod:`thd._runtime.tiles`; every
launch goes through :class:`thd._runtime.launcher.KernelLauncher`. Each kernel's non-constexpr
parameters are listed once, in order, in its :class:`ArgSpec` (:data:`FWD_ARGS`, ...), built from
shared groups; the host builds a launch's argument tuple group by group in that order
(:func:`forward_args`, ...), and a test checks every spec against the kernel's ``arg_names``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
from torch import Tensor

from thd._runtime import tiles
from thd._runtime.launcher import KernelLauncher
from thd._runtime.tiles import SETTINGS
from thd.ops.attention import kernels
from thd.ops.attention.buffers import delta_buffer, forward_outputs, gradient_buffers
from thd.ops.attention.params import AttentionOptions, BackwardCall, ForwardCall, VarlenLayout
from thd.ops.attention.plan_keys import inputs_key

__all__ = [
    "DKDV_ARGS",
    "DQ_ARGS",
    "FWD_ARGS",
    "KERNELS",
    "PREPROCESS_ARGS",
    "backward",
    "backward_args",
    "backward_shared_args",
    "forward",
    "forward_args",
    "supports_backward",
    "supports_every_call",
    "supports_forward",
]

# ----------------------------------------------------------------------------- argument specs
# A group's names and the host function giving its values sit together; every spec is a
# concatenation of groups, and so is every argument tuple.

ArgSpec = tuple[str, ...]

LAYOUT_ARGS: ArgSpec = (
    "cu_q_ptr",
    "cu_k_ptr",
    "cup_q_ptr",
    "cup_k_ptr",
    "pos_q_ptr",
    "pos_k_ptr",
    "rows_q",
    "rows_k",
)


def layout_tensors(layout: VarlenLayout) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The tensors of :data:`LAYOUT_ARGS` (positions default to the offsets: unused without them)."""
    cu_q, cu_k = layout.cu_seqlens_q, layout.cu_seqlens_kv
    cup_q, cup_k = layout.cu_seqlens_q_padded, layout.cu_seqlens_kv_padded
    pos_q, pos_k = layout.positions_q, layout.positions_kv
    if pos_q is None or pos_k is None:
        pos_q, pos_k = cu_q, cu_k  # unused: HAS_POSITIONS is False
    return cu_q, cu_k, cu_q if cup_q is None else cup_q, cu_k if cup_k is None else cup_k, pos_q, pos_k


def layout_args(layout: VarlenLayout, rows_q: int, rows_k: int) -> tuple:
    """Values of :data:`LAYOUT_ARGS`."""
    return (*layout_tensors(layout), rows_q, rows_k)


VARIANT_ARGS: ArgSpec = ("sm_scale", "softcap", "window_left", "window_right", "seq_bucket")


def variant_args(options: AttentionOptions, max_seqlen: int) -> tuple:
    """Values of :data:`VARIANT_ARGS`; ``seq_bucket`` (an autotune key only) from ``max_seqlen``."""
    softcap = options.softcap if options.softcap > 0.0 else 1.0
    bucket = _next_power_of_2(max(int(max_seqlen), 16))
    return options.softmax_scale, softcap, max(options.window_left, 0), max(options.window_right, 0), bucket


def stride_names(*labels: str) -> ArgSpec:
    """``stride_<x>t, stride_<x>h`` per label: the row and head strides of a ``[T, H, D]`` tensor."""
    return tuple(f"stride_{label}{dim}" for label in labels for dim in "th")


def strides(*tensors: Tensor) -> tuple[int, ...]:
    """Values of :func:`stride_names` for tensors given in the labels' order."""
    values: tuple[int, ...] = ()
    for t in tensors:
        values += t.stride()[:2]
    return values


FWD_ARGS: ArgSpec = (
    *("q_ptr", "k_ptr", "v_ptr", "out_ptr", "lse_ptr", "sinks_ptr"),
    *LAYOUT_ARGS,
    *stride_names("q", "k", "v", "o"),
    "stride_lse_h",
    *VARIANT_ARGS,
)
PREPROCESS_ARGS: ArgSpec = (
    *("out_ptr", "do_ptr", "delta_ptr", "lse_ptr", "sinks_ptr", "dsink_rows_ptr", "cu_q_ptr", "cup_q_ptr"),
    "rows_q",
    *stride_names("o", "do"),
    "stride_lse_h",
)
_BWD_INPUTS: ArgSpec = ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "lse_ptr", "delta_ptr")
DKDV_ARGS: ArgSpec = (
    *_BWD_INPUTS,
    *("dk_ptr", "dv_ptr", "dq_acc_ptr"),
    *LAYOUT_ARGS,
    *stride_names("q", "k", "v", "do", "dk", "dv", "dq"),
    "stride_lse_h",
    *VARIANT_ARGS,
)
DQ_ARGS: ArgSpec = (
    *_BWD_INPUTS,
    "dq_ptr",
    *LAYOUT_ARGS,
    *stride_names("q", "k", "v", "do", "dq"),
    "stride_lse_h",
    *VARIANT_ARGS,
)


def forward_args(call: ForwardCall, out: Tensor, lse: Tensor) -> tuple:
    """The forward kernel's arguments, in :data:`FWD_ARGS` order (``out``/``lse``: where it writes)."""
    q, k, v, layout, options, sinks, _ = call
    assert layout.max_seqlen_q is not None
    return (
        *(q, k, v, out, lse, q if sinks is None else sinks),
        *layout_args(layout, q.shape[0], k.shape[0]),
        *strides(q, k, v, out),
        lse.stride(0),
        *variant_args(options, layout.max_seqlen_q),
    )


def backward_args(
    inputs: tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor],
    grads: tuple[Tensor, ...],
    layout: VarlenLayout,
    options: AttentionOptions,
    shared: tuple[tuple, tuple] | None = None,
) -> tuple:
    """The dK/dV kernel's arguments in :data:`DKDV_ARGS` order (``grads = (dk, dv, dq)``) or the dQ
    kernel's in :data:`DQ_ARGS` order (``grads = (dq,)``); ``inputs = (q, k, v, do, lse, delta)``.
    ``shared``: :func:`backward_shared_args` of the same call, when the caller has it."""
    middle, tail = backward_shared_args(inputs, layout, options) if shared is None else shared
    return (*inputs, *grads, *middle, *strides(*grads), *tail)


def backward_shared_args(
    inputs: tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor],
    layout: VarlenLayout,
    options: AttentionOptions,
) -> tuple[tuple, tuple]:
    """The groups both backward kernels take alike: the layout and the input strides, then the lse
    stride and the variant (computed once per backward)."""
    q, k, v, do, lse, _ = inputs
    max_q, max_kv = layout.max_seqlen_q, layout.max_seqlen_kv
    assert max_q is not None and max_kv is not None
    middle = (*layout_args(layout, q.shape[0], k.shape[0]), *strides(q, k, v, do))
    return middle, (lse.stride(0), *variant_args(options, max(max_q, max_kv)))


def preprocess_args(
    out: Tensor,
    do: Tensor,
    delta: Tensor,
    lse: Tensor,
    sinks: Tensor | None,
    dsink_rows: Tensor | None,
    layout: VarlenLayout,
) -> tuple:
    """The backward preprocess kernel's arguments, in :data:`PREPROCESS_ARGS` order."""
    return (
        *(out, do, delta, lse, out if sinks is None else sinks, delta if dsink_rows is None else dsink_rows),
        *(layout.cu_seqlens_q, layout.slots_q, out.shape[0]),
        *strides(out, do),
        delta.stride(0),
    )


# ----------------------------------------------------------------------------- kernels

_KEY = ["seq_bucket", "HEAD_DIM", "HEAD_DIM_V", "GROUP", "HAS_LEFT", "HAS_RIGHT", "SOFTCAP"]


def _tuned(kernel: str, fn, restore: list[str], key: list[str]):  # type: ignore[no-untyped-def]
    configs = [t.config() for t in tiles.CANDIDATES[kernel]]
    return triton.autotune(
        configs=configs,
        key=key,
        prune_configs_by={"early_config_prune": tiles.prune_configs(kernel)},
        restore_value=restore,
    )(fn)


if SETTINGS.autotune:
    KERNELS = {
        "fwd": _tuned("fwd", kernels._attention_fwd_kernel, ["out_ptr", "lse_ptr"], [*_KEY, "ACCUMULATE"]),
        "dkdv": _tuned(
            "dkdv",
            kernels._attention_bwd_dkdv_kernel,
            ["dq_acc_ptr", "dk_ptr", "dv_ptr"],  # accumulated into: restored between trial runs
            [*_KEY, "DQ_MODE", "ACCUMULATE"],
        ),
        "dq": _tuned("dq", kernels._attention_bwd_dq_kernel, ["dq_ptr"], [*_KEY, "ACCUMULATE"]),
    }
else:
    KERNELS = {
        "fwd": kernels._attention_fwd_kernel,
        "dkdv": kernels._attention_bwd_dkdv_kernel,
        "dq": kernels._attention_bwd_dq_kernel,
    }
KERNELS["preprocess"] = kernels._attention_bwd_preprocess_kernel
# Cached launches (thd._runtime.launcher, off with THD_FAST_LAUNCH=0): a specialization's first
# launch takes Triton's path, later ones skip its per-launch Python work; otherwise plain fn[grid].
LAUNCHERS = {name: KernelLauncher(fn) for name, fn in KERNELS.items()}


def _launch(
    kernel: str,
    rows: int,
    num_heads: int,
    num_seqs: int,
    meta: dict,
    tiled: tuple[Tensor, Tensor],
    args: tuple,
) -> None:
    """Launch ``kernel`` on a ``(row blocks, heads, sequences + 1)`` grid through the autotuner
    (``THD_AUTOTUNE=1``; every other launch takes a :class:`_Launch` of a cached plan). ``meta``: its
    constexprs (from :func:`_meta`)."""
    constexprs = {name: value for name, value in meta.items() if name != "FP32"}
    block = "BLOCK_N" if kernel == "dkdv" else "BLOCK_M"
    grid = lambda m: (max(1, triton.cdiv(rows, m[block])), num_heads, num_seqs + 1)
    KERNELS[kernel][grid](*args, **constexprs, TMA=False, WARP_SPEC=False)


class _Launch(NamedTuple):
    """One launch of a cached plan: everything but the call's tensors (its inputs, outputs and
    layout tensors). ``tail``: the arguments after them (sizes, strides, variant: no tensor), fixed
    by the plan's key; ``tma_keywords``: the keywords when the tile reads through descriptors and
    the tensors allow it (None: no TMA tile)."""

    kernel: str
    meta: dict
    tile: tiles.Tile
    rows: int
    grid: tuple[int, int, int]
    keywords: dict
    tma_keywords: dict | None
    tail: tuple

    def run(self, head: tuple, tiled: tuple[Tensor, Tensor], reused: bool) -> None:
        """Launch with ``head`` (the call's tensors) before :attr:`tail`; ``tiled``: the tensors
        whose tiles the inner loop reads (checked by :func:`thd._runtime.tiles.tma_capable`).
        ``reused``: the plan served an earlier call (a plan made for this call launches by the
        whole argument list: a key seen once does not take a record of the launcher's)."""
        tma = self.tma_keywords
        keywords = tma if tma is not None and tiles.tma_capable(*tiled) else self.keywords
        if reused:
            LAUNCHERS[self.kernel].run_fixed(self, self.grid, head, self.tail, keywords)
        else:
            LAUNCHERS[self.kernel].run(self.grid, *head, *self.tail, **keywords)

    def current(self) -> bool:
        """Whether the tile table still gives this launch's tile (tests and the tuner change it)."""
        return tiles.tile_for(self.kernel, self.meta, self.rows) is self.tile


def _plan_launch(kernel: str, rows: int, num_heads: int, num_seqs: int, meta: dict, tail: tuple) -> _Launch:
    """The :class:`_Launch` of ``kernel`` on a ``(row blocks, heads, sequences + 1)`` grid."""
    tile = tiles.tile_for(kernel, meta, rows)
    cap = tiles.SMALL_FWD_MAX_REGISTERS
    entry = _KEYWORDS.get((kernel, id(meta), id(tile), cap))
    if entry is None or entry[0] is not tile:  # the identity check: a dead tile's id may be reused
        entry = _keywords(kernel, meta, tile, cap)
    block = tile.block_n if kernel == "dkdv" else tile.block_m
    grid = (max(1, _cdiv(rows, block)), num_heads, num_seqs + 1)
    return _Launch(kernel, meta, tile, rows, grid, entry[1], entry[2] if tile.tma else None, tail)


_KEYWORDS: dict[tuple[str, int, int, int], tuple[tiles.Tile, dict, dict]] = {}


def _keywords(kernel: str, meta: dict, tile: tiles.Tile, max_registers: int) -> tuple[tiles.Tile, dict, dict]:
    """``(tile, keywords without TMA, keywords with TMA)`` of a launch (its constexprs and compile
    options), remembered in :data:`_KEYWORDS` by the ids of ``meta`` (a :func:`_meta` dict: they
    live as long as the process) and ``tile`` and by the register cap (a changed cap is never
    served stale)."""
    constexprs = {name: value for name, value in meta.items() if name != "FP32"}
    keywords = {
        **constexprs,
        "WARP_SPEC": tile.warp_specialize,
        "BLOCK_M": tile.block_m,
        "BLOCK_N": tile.block_n,
        "num_warps": tile.num_warps,
        "num_stages": tile.num_stages,
        **tiles.register_cap(kernel, tile, meta),
    }
    if len(_KEYWORDS) >= 4096:
        _KEYWORDS.clear()
    entry = tile, {**keywords, "TMA": False}, {**keywords, "TMA": True}
    _KEYWORDS[(kernel, id(meta), id(tile), max_registers)] = entry
    return entry


@functools.cache
def _preprocess_keywords(head_dim_v: int, block_dv: int, has_sinks: bool, block_m: int) -> dict:
    """The backward preprocess kernel's constexprs."""
    return {"HEAD_DIM_V": head_dim_v, "BLOCK_DV": block_dv, "HAS_SINKS": has_sinks, "BLOCK_M": block_m}


def _cdiv(x: int, y: int) -> int:
    """``triton.cdiv`` without its constexpr-function wrapper (~1.5 us of host time per call)."""
    return (x + y - 1) // y


def _next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for host ints, without its constexpr-function wrapper."""
    return 1 << (n - 1).bit_length() if 1 <= n <= 1 << 62 else triton.next_power_of_2(n)


def _rows_major(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _meta(kernel: str, call: ForwardCall | BackwardCall, *flags: int | bool) -> dict[str, int | bool]:
    """The constexprs of a launch of ``kernel`` for ``call``, with the kernel's own ``flags``
    (:data:`_FLAGS`). One dict per distinct set, made once and shared (read-only)."""
    layout, options = call.layout, call.options
    q, k, v = call[:3] if kernel == "fwd" else call.saved[:3]
    return _meta_for(
        kernel,
        layout.positions_q is not None,
        q.shape[1] // k.shape[1],
        q.shape[2],
        v.shape[2],
        q.dtype,
        options.window_left >= 0,
        options.window_right >= 0,
        options.softcap > 0.0,
        flags,
    )


_FLAGS = {
    "fwd": ("HAS_SINKS", "ACCUMULATE", "FOLD_SCALE"),
    "dkdv": ("DQ_MODE", "ACCUMULATE"),
    "dq": ("ACCUMULATE",),
}
_METAS: list[dict[str, int | bool]] = []  # every dict _meta_for made, kept alive: their ids stay unique


@functools.cache
def _meta_for(
    kernel: str,
    has_positions: bool,
    group: int,
    head_dim: int,
    head_dim_v: int,
    dtype: torch.dtype,
    has_left: bool,
    has_right: bool,
    softcap: bool,
    flags: tuple[int | bool, ...],
) -> dict[str, int | bool]:
    meta = {
        "HAS_POSITIONS": has_positions,
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_V": head_dim_v,
        "BLOCK_D": max(16, _next_power_of_2(head_dim)),
        "BLOCK_DV": max(16, _next_power_of_2(head_dim_v)),
        "HAS_LEFT": has_left,
        "HAS_RIGHT": has_right,
        "SOFTCAP": softcap,
        "UPCAST": SETTINGS.interpret and dtype == torch.bfloat16,
        "FP32": dtype == torch.float32,
        **dict(zip(_FLAGS.get(kernel, ()), flags, strict=True)),
    }
    _METAS.append(meta)
    return meta


# ----------------------------------------------------------------------------- cached plans
# What a launch needs besides the call's tensors (grids, constexprs, compile options, sizes,
# strides, the variant's scalars) depends only on the layout's shape (the offsets' length, which
# tensors are given, the bounds), the options' values and the tensors' shapes, strides and dtype:
# it is computed once per such key and kept in a plan, which holds no tensor. The layout's tensors
# are the call's, passed with its inputs and outputs at every launch (a new offsets tensor per
# batch, or the ring's per call, finds the same plan); their values are read by the kernels, and
# what Triton specializes on (dtype, 16-byte alignment) is keyed by KernelLauncher.run_fixed with
# every other tensor's. Every call still checks its arguments before it gets here, reads the
# current tile table and TMA capability, and launches through KernelLauncher.

PLAN_LIMIT = 256
"""Plans kept per phase; all are dropped when a new one would exceed it."""
_FORWARD_PLANS: dict[tuple, _Launch] = {}
_BACKWARD_PLANS: dict[tuple, _BackwardPlan] = {}
_DELTA_PLANS: dict[tuple, _Preprocess] = {}
# Each kernel's head (the call's tensors, layout tensors last) ends where its sizes begin.
_FWD_HEAD = FWD_ARGS.index("rows_q")
_PREPROCESS_HEAD = PREPROCESS_ARGS.index("rows_q")
_DKDV_HEAD = DKDV_ARGS.index("rows_q")
_DQ_HEAD = DQ_ARGS.index("rows_q")


def clear_plans() -> None:
    """Forget every cached plan (the next call of each key builds its plan again)."""
    _FORWARD_PLANS.clear()
    _BACKWARD_PLANS.clear()
    _DELTA_PLANS.clear()


def plan_counts() -> tuple[int, int]:
    """How many forward and backward plans are cached."""
    return len(_FORWARD_PLANS), len(_BACKWARD_PLANS)


def _remember(plans: dict, key: tuple, plan: object, options: AttentionOptions) -> None:
    if options.softmax_scale == 0.0:
        return  # 0.0 and -0.0 are equal options but not one scale: such a plan serves its call only
    if len(plans) >= PLAN_LIMIT:
        plans.clear()
    plans[key] = plan


def _forward_plan(call: ForwardCall, out: Tensor, lse: Tensor) -> tuple[_Launch, bool]:
    """The forward's launch, and whether it was cached (else made now)."""
    q, k, v, layout, options, sinks, accumulate = call
    key = inputs_key(layout, options, q, k, v) + (
        out.stride(),
        lse.stride(),
        q.dtype,
        sinks is None,
        accumulate is None,
        tiles.SMALL_FWD_MAX_REGISTERS,
    )
    found = _FORWARD_PLANS.get(key)
    if found is not None and found.current():
        return found, True
    fold_scale = options.softmax_scale > 0.0 and options.softcap <= 0.0
    meta = _meta("fwd", call, sinks is not None, accumulate is not None, fold_scale)
    assert layout.max_seqlen_q is not None
    tail = forward_args(call, out, lse)[_FWD_HEAD:]
    launch = _plan_launch("fwd", layout.max_seqlen_q, q.shape[1], layout.num_seqs, meta, tail)
    _remember(_FORWARD_PLANS, key, launch, options)
    return launch, False


class _Preprocess(NamedTuple):
    """The backward preprocess launch of a plan (no tile: its block is fixed)."""

    grid: tuple[int, int, int]
    keywords: dict
    tail: tuple

    def run(self, head: tuple, reused: bool) -> None:
        """As :meth:`_Launch.run`."""
        if reused:
            LAUNCHERS["preprocess"].run_fixed(self, self.grid, head, self.tail, self.keywords)
        else:
            LAUNCHERS["preprocess"].run(self.grid, *head, *self.tail, **self.keywords)


class _BackwardPlan(NamedTuple):
    """The launches of one backward key (None: not launched) and whether dQ is added by atomics."""

    atomic: bool
    preprocess: _Preprocess | None
    dkdv: _Launch | None
    dq: _Launch | None

    def current(self) -> bool:
        return all(launch is None or launch.current() for launch in (self.dkdv, self.dq))


def _backward_plan(
    call: BackwardCall,
    inputs: tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor],
    grads: tuple[Tensor, Tensor, Tensor],
    dq_mode: int,
) -> tuple[_BackwardPlan, bool]:
    """The backward's launches, and whether they were cached (else made now)."""
    q, k, v, do, lse, delta = inputs
    out, sinks = call.saved.out, call.saved.sinks
    layout, options, accumulate = call.layout, call.options, call.accumulate
    key = inputs_key(layout, options, q, k, v) + (
        do.stride(),
        out.shape,
        out.stride(),
        lse.stride(),
        q.dtype,
        sinks is None,
        None if accumulate is None else tuple(g.stride() for g in grads),
        dq_mode,
    )
    found = _BACKWARD_PLANS.get(key)
    if found is not None and found.current():
        return found, True
    dq, dk, dv = grads
    num_heads, num_seqs = q.shape[1], layout.num_seqs
    max_q, max_kv = layout.max_seqlen_q, layout.max_seqlen_kv
    assert max_q is not None and max_kv is not None
    accumulating = accumulate is not None
    dq_meta = _meta("dq", call, accumulating)
    preprocess = None
    if num_seqs > 0 and max_q > 0 and q.shape[0] > 0:
        preprocess = _preprocess_plan(layout, out, do, delta, lse, sinks)
    shared = backward_shared_args(inputs, layout, options)
    dkdv = None
    if k.shape[0] > 0:
        dkdv_meta = _meta("dkdv", call, dq_mode, accumulating)
        tail = backward_args(inputs, (dk, dv, dq), layout, options, shared)[_DKDV_HEAD:]
        dkdv = _plan_launch("dkdv", max_kv, k.shape[1], num_seqs, dkdv_meta, tail)
    dq_launch = None
    atomic = dq_mode > 0
    if not atomic and q.shape[0] > 0:
        tail = backward_args(inputs, (dq,), layout, options, shared)[_DQ_HEAD:]
        dq_launch = _plan_launch("dq", max_q, num_heads, num_seqs, dq_meta, tail)
    plan = _BackwardPlan(atomic, preprocess, dkdv, dq_launch)
    _remember(_BACKWARD_PLANS, key, plan, options)
    return plan, False


# ----------------------------------------------------------------------------- the family


def supports_every_call(call: ForwardCall | BackwardCall) -> bool:
    """The ``tl`` kernels take every checked call."""
    return True


supports_forward = supports_backward = supports_every_call


def forward(call: ForwardCall) -> tuple[Tensor, Tensor]:
    """One kernel launch: ``(out, lse)``, padding rows written as 0 / -inf by the kernel.

    ``layout.max_seqlen_*`` must be ints. ``accumulate=(out, lse)``: fold this launch into that
    normalised partial result in place (only its real rows are read and written) and return it.
    """
    q, k, v, layout, options, sinks, accumulate = call
    q, k, v = _rows_major(q), _rows_major(k), _rows_major(v)
    out, lse = forward_outputs(call)
    if q.shape[0] == 0:
        return out, lse
    assert layout.max_seqlen_q is not None
    if q is not call.q or k is not call.k or v is not call.v:
        call = call._replace(q=q, k=k, v=v)
    if SETTINGS.autotune:
        fold_scale = options.softmax_scale > 0.0 and options.softcap <= 0.0
        meta = _meta("fwd", call, sinks is not None, accumulate is not None, fold_scale)
        args = forward_args(call, out, lse)
        _launch("fwd", layout.max_seqlen_q, q.shape[1], layout.num_seqs, meta, (k, v), args)
        return out, lse
    plan, reused = _forward_plan(call, out, lse)
    head = (q, k, v, out, lse, q if sinks is None else sinks, *layout_tensors(layout))
    plan.run(head, (k, v), reused)
    return out, lse


def backward(call: BackwardCall) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Preprocess, dK/dV (and dQ by atomics) launches: ``(dq, dk, dv, dsinks)``, padding rows 0.

    ``options.deterministic`` adds dQ from its own kernel instead of fp32 atomics.
    ``accumulate=(dq, dk, dv)`` (fp32, shaped like q, k, v): add this launch's gradients to those
    buffers on its real rows only (every other row is left as it is) and return them.
    """
    do, (q, k, v, out, lse, sinks), _, options, accumulate, _ = call
    do, q, k, v, out = (_rows_major(t) for t in (do, q, k, v, out))
    lse = lse.contiguous()
    if SETTINGS.autotune:
        return _autotuned_backward(call, do, q, k, v, out, lse)
    dq_mode = tiles.dq_mode(options.deterministic)
    # atomics add into an accumulated fp32 dq buffer as they would into a fresh one
    dq, dk, dv = gradient_buffers(call, atomic_dq=dq_mode > 0)
    delta, shared_delta = delta_buffer(call, lse)
    dsink_rows = torch.zeros_like(lse) if sinks is not None else None
    inputs = (q, k, v, do, lse, delta)
    plan, reused = _backward_plan(call, inputs, (dq, dk, dv), dq_mode)
    offsets = layout_tensors(call.layout)
    if plan.preprocess is not None and not shared_delta:
        rows = delta if dsink_rows is None else dsink_rows
        head = (out, do, delta, lse, out if sinks is None else sinks, rows, offsets[0], offsets[2])
        plan.preprocess.run(head, reused)
    if plan.dkdv is not None:
        plan.dkdv.run((*inputs, dk, dv, dq, *offsets), (q, do), reused)
    if plan.atomic:
        dq = dq if accumulate is not None else dq.to(q.dtype)
    elif plan.dq is not None:
        plan.dq.run((*inputs, dq, *offsets), (k, v), reused)
    dsinks = None if dsink_rows is None else dsink_rows.sum(1).to(sinks.dtype)  # type: ignore[union-attr]
    return dq, dk, dv, dsinks


def _preprocess_plan(
    layout: VarlenLayout, out: Tensor, do: Tensor, delta: Tensor, lse: Tensor, sinks: Tensor | None
) -> _Preprocess:
    """The preprocess launch of a backward plan or of :func:`backward_delta` (``max_seqlen_q`` set)."""
    block, head_dim_v = 64, out.shape[2]
    assert layout.max_seqlen_q is not None
    return _Preprocess(
        (_cdiv(layout.max_seqlen_q, block), out.shape[1], layout.num_seqs),
        _preprocess_keywords(head_dim_v, max(16, _next_power_of_2(head_dim_v)), sinks is not None, block),
        preprocess_args(out, do, delta, lse, sinks, None, layout)[_PREPROCESS_HEAD:],
    )


def backward_delta(call: BackwardCall) -> Tensor:
    """``rowsum(dO * out)`` on ``call.layout``'s real query rows, by the preprocess kernel alone
    (see :func:`thd.ops.attention.dispatch.backward_delta`)."""
    layout, out, lse = call.layout, _rows_major(call.saved.out), call.saved.lse.contiguous()
    do = _rows_major(call.do)
    delta = torch.empty_like(lse)
    key = (*inputs_key(layout, call.options, out, do, lse), out.dtype)
    plan = _DELTA_PLANS.get(key)
    reused = plan is not None
    if plan is None:
        if layout.num_seqs == 0 or not layout.max_seqlen_q or out.shape[0] == 0:
            return delta  # no real row
        plan = _preprocess_plan(layout, out, do, delta, lse, None)
        _remember(_DELTA_PLANS, key, plan, call.options)
    offsets = layout_tensors(layout)
    plan.run((out, do, delta, lse, out, delta, offsets[0], offsets[2]), reused)
    return delta


def _autotuned_backward(
    call: BackwardCall, do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """:func:`backward` through the autotuner (``THD_AUTOTUNE=1``): no plans."""
    sinks, layout, options, accumulate = call.saved.sinks, call.layout, call.options, call.accumulate
    num_heads, num_kv_heads, num_seqs = q.shape[1], k.shape[1], layout.num_seqs
    max_q, max_kv = layout.max_seqlen_q, layout.max_seqlen_kv
    assert max_q is not None and max_kv is not None
    dq_mode = tiles.dq_mode(options.deterministic)
    atomic = dq_mode > 0
    dq, dk, dv = gradient_buffers(call, atomic_dq=atomic)
    delta, shared_delta = delta_buffer(call, lse)
    dsink_rows = torch.zeros_like(lse) if sinks is not None else None
    accumulating = accumulate is not None
    dq_meta = _meta("dq", call, accumulating)
    if num_seqs > 0 and max_q > 0 and q.shape[0] > 0 and not shared_delta:
        block = 64
        LAUNCHERS["preprocess"].run(
            (_cdiv(max_q, block), num_heads, num_seqs),
            *preprocess_args(out, do, delta, lse, sinks, dsink_rows, layout),
            **_preprocess_keywords(v.shape[2], int(dq_meta["BLOCK_DV"]), sinks is not None, block),
        )
    inputs = (q, k, v, do, lse, delta)
    shared = backward_shared_args(inputs, layout, options)
    if k.shape[0] > 0:
        dkdv_meta = _meta("dkdv", call, dq_mode, accumulating)
        args = backward_args(inputs, (dk, dv, dq), layout, options, shared)
        _launch("dkdv", max_kv, num_kv_heads, num_seqs, dkdv_meta, (q, do), args)
    if atomic:
        dq = dq if accumulating else dq.to(q.dtype)
    elif q.shape[0] > 0:
        args = backward_args(inputs, (dq,), layout, options, shared)
        _launch("dq", max_q, num_heads, num_seqs, dq_meta, (k, v), args)
    dsinks = None if dsink_rows is None else dsink_rows.sum(1).to(sinks.dtype)  # type: ignore[union-attr]
    return dq, dk, dv, dsinks
