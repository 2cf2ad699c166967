"""Launchers for the Triton attention kernels: tiles, grids, allocation.

Tiles come from a table measured on the H200 (:data:`TILES`), looked up by kernel and head-dim
class, so the hot path pays no autotuner. ``THD_AUTOTUNE=1`` autotunes over :data:`CANDIDATES`
instead (the benchmark uses it to refresh the table).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
from torch import Tensor
from triton.runtime import _allocation

from thd.errors import ThdValueError
from thd.ops.attention import kernels
from thd.ops.attention.fast_launch import KernelLauncher
from thd.ops.attention.params import AttentionOptions, VarlenLayout

__all__ = ["CANDIDATES", "TILES", "Tile", "backward", "forward", "register_cap", "tile_for"]


def env_int(name: str, default: int, allowed: range) -> int:
    """Integer setting ``name`` from the environment (``default`` when unset or empty);
    :class:`ThdValueError` naming the variable and its value when it is not in ``allowed``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value not in allowed:
        raise ThdValueError(f"{name}={raw!r}: expected an integer from {allowed.start} to {allowed.stop - 1}")
    return value


# Read once at import, as Triton decides interpreter vs compiler when kernels are decorated.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_AUTOTUNE = os.environ.get("THD_AUTOTUNE", "0") == "1" and not _INTERPRET


@dataclass(frozen=True)
class Tile:
    """Rows of queries and keys per tile, the kernel's warps and pipeline stages, whether the inner
    loop reads its tiles through tensor descriptors (``tma``, Hopper's copy engine; only where the
    tensors allow it, see :func:`_tma_capable`) and whether Triton warp-specializes that loop."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False
    warp_specialize: bool = False

    def config(self) -> triton.Config:
        return triton.Config(
            {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n},
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )

    @property
    def name(self) -> str:
        flags = ("-tma" if self.tma else "") + ("-ws" if self.warp_specialize else "")
        return f"{self.block_m}x{self.block_n}w{self.num_warps}s{self.num_stages}{flags}"


# (kernel, head-dim class, long sequences) -> tile. The head-dim class is the padded head dim
# (64, 128 or 256); sequences are long when max_seqlen > 1024. Measured on one H200 with
# benchmarks/tune_attention.py (bf16, 16 heads, causal packed documents; the 64/128 entries are
# benchmarks/results/attention-tiles.json's best_tiles, code 046257b). TMA tiles fall back to
# pointer loads where the tensors do not allow descriptors.
TILES: dict[tuple[str, int, bool], Tile] = {
    ("fwd", 64, False): Tile(64, 64, 4, 3),
    ("fwd", 64, True): Tile(64, 64, 4, 3),
    ("fwd", 128, False): Tile(64, 64, 4, 3),
    ("fwd", 128, True): Tile(64, 64, 4, 3, tma=True),
    ("fwd", 256, False): Tile(64, 32, 4, 2),
    ("fwd", 256, True): Tile(64, 32, 4, 2),
    ("dkdv", 64, False): Tile(32, 128, 4, 3),
    ("dkdv", 64, True): Tile(32, 128, 4, 3),
    ("dkdv", 128, False): Tile(32, 64, 4, 3),
    ("dkdv", 128, True): Tile(32, 64, 4, 3),
    ("dkdv", 256, False): Tile(32, 64, 4, 2),
    ("dkdv", 256, True): Tile(32, 64, 4, 2),
    ("dq", 64, False): Tile(64, 64, 4, 3, tma=True),
    ("dq", 64, True): Tile(64, 64, 4, 3, tma=True),
    ("dq", 128, False): Tile(128, 64, 8, 3),
    ("dq", 128, True): Tile(128, 64, 8, 3),
    ("dq", 256, False): Tile(64, 32, 4, 2),
    ("dq", 256, True): Tile(64, 32, 4, 2),
}
_FP32_256_TILE = Tile(32, 32, 4, 1)  # fp32 with a 256-wide head: the only tile that fits
LONG_SEQUENCES = 1024


def _load_tile_overrides(path: str) -> None:
    """``THD_TILES=file.json``: ``{"fwd,128,long": [block_m, block_n, warps, stages], ...}`` replaces
    entries of :data:`TILES` (``benchmarks/tune_attention.py --emit-tiles`` writes such a file)."""
    import json

    with open(path) as fh:
        for key, value in json.load(fh).items():
            kernel, dim_class, length = key.split(",")
            TILES[(kernel, int(dim_class), length == "long")] = Tile(
                *(int(x) for x in value[:4]), *map(bool, value[4:])
            )


def _tile_entry(tile: Tile) -> list[int]:
    """A tile as written in a ``THD_TILES`` file."""
    return [
        tile.block_m,
        tile.block_n,
        tile.num_warps,
        tile.num_stages,
        int(tile.tma),
        int(tile.warp_specialize),
    ]


if os.environ.get("THD_TILES"):
    _load_tile_overrides(os.environ["THD_TILES"])
_INTERPRETER_TILE = Tile(32, 32, 4, 1)

CANDIDATES: dict[str, list[Tile]] = {
    "fwd": [
        Tile(128, 64, 8, 3),
        Tile(128, 128, 8, 3),
        Tile(128, 64, 4, 3),
        Tile(128, 128, 8, 2),
        Tile(64, 64, 4, 3),
        Tile(128, 32, 4, 3),
        Tile(64, 32, 4, 2),
    ],
    "dkdv": [
        Tile(64, 128, 8, 2),
        Tile(64, 128, 8, 3),
        Tile(64, 64, 4, 2),
        Tile(32, 128, 8, 2),
        Tile(128, 128, 8, 2),
        Tile(128, 64, 8, 2),
        Tile(32, 64, 4, 2),
    ],
    "dq": [
        Tile(128, 64, 8, 3),
        Tile(128, 128, 8, 2),
        Tile(64, 64, 4, 3),
        Tile(64, 32, 4, 2),
        Tile(128, 32, 4, 3),
    ],
}
_MAX_TILE_AREA_256 = {"fwd": 64 * 64, "dkdv": 32 * 64, "dq": 64 * 64}


def _dim_class(meta: dict[str, int | bool]) -> int:
    """The padded head dim in units of 16-bit elements (fp32 tiles take twice the shared memory)."""
    width = max(64, int(meta["BLOCK_D"]), int(meta["BLOCK_DV"]))
    return width * 2 if meta["FP32"] else width


def tile_for(kernel: str, meta: dict[str, int | bool], max_seqlen: int) -> Tile:
    """The tile a launch of ``kernel`` uses for these head dims and sequence lengths."""
    if _INTERPRET:
        return _INTERPRETER_TILE
    dim_class = _dim_class(meta)
    if dim_class > 256:
        return _FP32_256_TILE
    return TILES[(kernel, dim_class, max_seqlen > LONG_SEQUENCES)]


def _prune(kernel: str):  # type: ignore[no-untyped-def]
    def prune(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
        if max(int(kwargs["BLOCK_D"]), int(kwargs["BLOCK_DV"])) <= 128:  # type: ignore[call-overload]
            return configs
        area = _MAX_TILE_AREA_256[kernel]
        kept = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= area and c.num_stages <= 2]
        return kept or [_INTERPRETER_TILE.config()]

    return prune


# How the non-deterministic backward adds dQ (see kernels.py): 0 its own kernel (as the
# deterministic backward always does), 1 per-element atomics, 2 one bulk TMA reduction per tile.
# Mode 0 on the GPU: on the H200 the split kernels beat per-element atomics (f2af2bb) and the TMA
# reductions (046257b: correct, slower on every mix) in benchmarks/tune_attention.py sweeps.
# MEASURED_DQ_MODE is the best_dq_mode of benchmarks/results/attention-tiles.json (a test keeps
# them equal): a sweep that finds the atomic backward faster moves the default with the table.
MEASURED_DQ_MODE = 0
FAST_DQ_MODE = 1 if _INTERPRET else env_int("THD_DQ_MODE", MEASURED_DQ_MODE, range(3))


def _scratch(size: int, alignment: int, stream: int | None) -> Tensor:
    return torch.empty(size, dtype=torch.int8, device="cpu" if _INTERPRET else "cuda")


def _ensure_allocator() -> None:
    """Device-side tensor descriptors live in a global scratch that Triton allocates per launch
    through a per-thread (context-variable) allocator: set one in the launching thread (autograd's
    backward runs in a thread of its own)."""
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def _dq_mode(options: AttentionOptions) -> int:
    if options.deterministic or FAST_DQ_MODE == 0:
        return 0
    if FAST_DQ_MODE == 2:
        _ensure_allocator()
    return FAST_DQ_MODE


_KEY = ["seq_bucket", "HEAD_DIM", "HEAD_DIM_V", "GROUP", "HAS_LEFT", "HAS_RIGHT", "SOFTCAP"]


def _tuned(kernel: str, fn, restore: list[str] | None = None, key: list[str] = _KEY):  # type: ignore[no-untyped-def]
    configs = [t.config() for t in CANDIDATES[kernel]]
    return triton.autotune(
        configs=configs,
        key=key,
        prune_configs_by={"early_config_prune": _prune(kernel)},
        restore_value=restore,
    )(fn)


if _AUTOTUNE:
    _KERNELS = {
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
    _KERNELS = {
        "fwd": kernels._attention_fwd_kernel,
        "dkdv": kernels._attention_bwd_dkdv_kernel,
        "dq": kernels._attention_bwd_dq_kernel,
    }
# Cached launches (fast_launch.py, off with THD_FAST_LAUNCH=0): a specialization's first launch
# takes Triton's path, later ones skip its per-launch Python work; otherwise plain fn[grid].
_LAUNCHERS = {name: KernelLauncher(fn) for name, fn in _KERNELS.items()}
_PREPROCESS = KernelLauncher(kernels._attention_bwd_preprocess_kernel)


_TMA_ENABLED = os.environ.get("THD_TMA", "1") != "0"
_tma_devices: dict[int, bool] = {}


def _tma_capable(*tensors: Tensor) -> bool:
    """Whether the copy engine can read row tiles of these ``[T, H, D]`` tensors: a Hopper or newer
    GPU (or the interpreter), 16-byte aligned data and row and head strides."""
    if not _TMA_ENABLED:
        return False
    first = tensors[0]
    if not _INTERPRET:
        index = first.device.index if first.device.index is not None else torch.cuda.current_device()
        if index not in _tma_devices:
            _tma_devices[index] = torch.cuda.get_device_capability(index)[0] >= 9
        if not _tma_devices[index]:
            return False
    for t in tensors:
        per_16_bytes = 16 // t.element_size()
        if t.data_ptr() % 16 or t.stride(0) % per_16_bytes or t.stride(1) % per_16_bytes:
            return False
    _ensure_allocator()
    return True


def _launch(
    kernel: str,
    rows: int,
    num_heads: int,
    num_seqs: int,
    meta: dict,
    tiled: tuple[Tensor, Tensor],
    *args: object,
) -> None:
    """Launch ``kernel`` on a ``(row blocks, heads, sequences + 1)`` grid. ``tiled``: the tensors
    whose tiles the inner loop reads; a ``tma`` tile uses descriptors only if they pass
    :func:`_tma_capable` (checked only for such tiles)."""
    fn = _KERNELS[kernel]
    constexprs = {name: value for name, value in meta.items() if name != "FP32"}
    if _AUTOTUNE:
        block = "BLOCK_N" if kernel == "dkdv" else "BLOCK_M"
        grid = lambda m: (max(1, triton.cdiv(rows, m[block])), num_heads, num_seqs + 1)
        fn[grid](*args, **constexprs, TMA=False, WARP_SPEC=False)
        return
    tile = tile_for(kernel, meta, rows)
    block = tile.block_n if kernel == "dkdv" else tile.block_m
    _LAUNCHERS[kernel].run(
        (max(1, _cdiv(rows, block)), num_heads, num_seqs + 1),
        *args,
        **constexprs,
        TMA=tile.tma and _tma_capable(*tiled),
        WARP_SPEC=tile.warp_specialize,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **register_cap(kernel, tile, meta),
    )


# A 4-warp forward tile of head dims <= 64 is capped at 168 registers per thread, which keeps
# three blocks on an SM (65536 registers / (168 x 128 threads)). On the H200 (Triton 3.6) the plain
# kernel takes 168 by itself; sinks took 172, a left window 211, softcap 204 (two blocks per SM, the
# forward up to 20% slower). Capped, all four compile to <= 168 without spills there
# (tests/ops/test_attention_registers_gpu.py; benchmarks/results/README.md, session 19). The ring's
# accumulating launches took 208-210, capped 166-168 without spills, and its forward per rank ran
# 0.6-11% faster capped (docs/cp.md; Triton 3.9's ptxas gives them an 8-byte stack frame instead).
# ``THD_FWD_MAX_REGISTERS`` (read at import) replaces the cap; ``0`` compiles without one.
SMALL_FWD_MAX_REGISTERS = env_int("THD_FWD_MAX_REGISTERS", 168, range(256))


def register_cap(kernel: str, tile: Tile, meta: dict) -> dict[str, int]:
    """Extra compile option of a launch: ``{"maxnreg": ...}`` for small-head-dim forward tiles, else {}."""
    small = max(meta["BLOCK_D"], meta["BLOCK_DV"]) <= 64
    if kernel == "fwd" and tile.num_warps == 4 and small and SMALL_FWD_MAX_REGISTERS > 0:
        return {"maxnreg": SMALL_FWD_MAX_REGISTERS}
    return {}


def _cdiv(x: int, y: int) -> int:
    """``triton.cdiv`` without its constexpr-function wrapper (~1.5 us of host time per call)."""
    return (x + y - 1) // y


def _next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for host ints, without its constexpr-function wrapper."""
    return 1 << (n - 1).bit_length() if 1 <= n <= 1 << 62 else triton.next_power_of_2(n)


def _rows_major(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _seq_bucket(max_seqlen: int) -> int:
    return _next_power_of_2(max(int(max_seqlen), 16))


def _positions(layout: VarlenLayout) -> tuple[Tensor, Tensor]:
    if layout.positions_q is None or layout.positions_kv is None:
        return layout.cu_seqlens_q, layout.cu_seqlens_kv  # unused: HAS_POSITIONS is False
    return layout.positions_q, layout.positions_kv


def _meta(
    q: Tensor, k: Tensor, v: Tensor, layout: VarlenLayout, options: AttentionOptions
) -> dict[str, int | bool]:
    """The kernels' shape and variant constexprs (shared, read-only: callers copy before adding)."""
    return _meta_for(
        layout.positions_q is not None,
        q.shape[1] // k.shape[1],
        q.shape[2],
        v.shape[2],
        q.dtype,
        options.window_left >= 0,
        options.window_right >= 0,
        options.softcap > 0.0,
    )


@functools.lru_cache(maxsize=256)
def _meta_for(
    has_positions: bool,
    group: int,
    head_dim: int,
    head_dim_v: int,
    dtype: torch.dtype,
    has_left: bool,
    has_right: bool,
    softcap: bool,
) -> dict[str, int | bool]:
    return {
        "HAS_POSITIONS": has_positions,
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_V": head_dim_v,
        "BLOCK_D": max(16, _next_power_of_2(head_dim)),
        "BLOCK_DV": max(16, _next_power_of_2(head_dim_v)),
        "HAS_LEFT": has_left,
        "HAS_RIGHT": has_right,
        "SOFTCAP": softcap,
        "UPCAST": _INTERPRET and dtype == torch.bfloat16,
        "FP32": dtype == torch.float32,
    }


def _variant_args(options: AttentionOptions) -> tuple[float, float, int, int]:
    softcap = options.softcap if options.softcap > 0.0 else 1.0
    return options.softmax_scale, softcap, max(options.window_left, 0), max(options.window_right, 0)


def forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: VarlenLayout,
    options: AttentionOptions,
    sinks: Tensor | None = None,
    accumulate: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """One kernel launch: ``(out, lse)``, padding rows written as 0 / -inf by the kernel.

    ``layout.max_seqlen_*`` must be ints. ``accumulate=(out, lse)``: fold this launch into that
    normalised partial result in place (only its real rows are read and written) and return it.
    """
    q, k, v = _rows_major(q), _rows_major(k), _rows_major(v)
    num_rows, num_heads = q.shape[0], q.shape[1]
    if accumulate is None:
        out = q.new_empty(num_rows, num_heads, v.shape[2])
        lse = q.new_empty(num_heads, num_rows, dtype=torch.float32)
    else:
        out, lse = accumulate
    if num_rows == 0:
        return out, lse
    meta = _meta(q, k, v, layout, options)
    assert layout.max_seqlen_q is not None
    _launch(
        "fwd",
        layout.max_seqlen_q,
        num_heads,
        layout.num_seqs,
        {
            **meta,
            "HAS_SINKS": sinks is not None,
            "ACCUMULATE": accumulate is not None,
            "FOLD_SCALE": options.softmax_scale > 0.0 and options.softcap <= 0.0,
        },
        (k, v),
        q,
        k,
        v,
        out,
        lse,
        q if sinks is None else sinks,
        layout.cu_seqlens_q,
        layout.cu_seqlens_kv,
        layout.slots_q,
        layout.slots_kv,
        *_positions(layout),
        num_rows,
        k.shape[0],
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        *_variant_args(options),
        _seq_bucket(layout.max_seqlen_q),
    )
    return out, lse


def backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    layout: VarlenLayout,
    options: AttentionOptions,
    sinks: Tensor | None = None,
    accumulate: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Preprocess, dK/dV (and dQ by atomics) launches: ``(dq, dk, dv, dsinks)``, padding rows 0.

    ``options.deterministic`` adds dQ from its own kernel instead of fp32 atomics.
    ``accumulate=(dq, dk, dv)`` (fp32, shaped like q, k, v): add this launch's gradients to those
    buffers on its real rows only (every other row is left as it is) and return them.
    """
    do, q, k, v, out = (_rows_major(t) for t in (do, q, k, v, out))
    lse = lse.contiguous()
    num_heads, num_kv_heads, num_seqs = q.shape[1], k.shape[1], layout.num_seqs
    max_q, max_kv = layout.max_seqlen_q, layout.max_seqlen_kv
    assert max_q is not None and max_kv is not None
    dq_mode = _dq_mode(options)
    atomic = dq_mode > 0
    if accumulate is not None:  # atomics add into the fp32 dq buffer as they would into a fresh one
        dq, dk, dv = accumulate
    elif atomic:
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk, dv = k.new_empty(k.shape), v.new_empty(v.shape)
    else:
        dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    meta = _meta(q, k, v, layout, options)
    delta = torch.empty_like(lse)
    dsink_rows = torch.zeros_like(lse) if sinks is not None else None
    variant = _variant_args(options)
    bucket = _seq_bucket(max(max_q, max_kv))
    if num_seqs > 0 and max_q > 0 and q.shape[0] > 0:
        block = 64
        _PREPROCESS.run(
            (_cdiv(max_q, block), num_heads, num_seqs),
            out,
            do,
            delta,
            lse,
            q if sinks is None else sinks,
            delta if dsink_rows is None else dsink_rows,
            layout.cu_seqlens_q,
            layout.slots_q,
            q.shape[0],
            out.stride(0),
            out.stride(1),
            do.stride(0),
            do.stride(1),
            delta.stride(0),
            HEAD_DIM_V=v.shape[2],
            BLOCK_DV=meta["BLOCK_DV"],
            HAS_SINKS=sinks is not None,
            BLOCK_M=block,
        )
    common = (
        layout.cu_seqlens_q,
        layout.cu_seqlens_kv,
        layout.slots_q,
        layout.slots_kv,
        *_positions(layout),
        q.shape[0],
        k.shape[0],
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        do.stride(0),
        do.stride(1),
    )
    if k.shape[0] > 0:
        _launch(
            "dkdv",
            max_kv,
            num_kv_heads,
            num_seqs,
            {**meta, "DQ_MODE": dq_mode, "ACCUMULATE": accumulate is not None},
            (q, do),
            q,
            k,
            v,
            do,
            lse,
            delta,
            dk,
            dv,
            dq,
            *common,
            dk.stride(0),
            dk.stride(1),
            dv.stride(0),
            dv.stride(1),
            dq.stride(0),
            dq.stride(1),
            lse.stride(0),
            *variant,
            bucket,
        )
    if atomic:
        dq = dq if accumulate is not None else dq.to(q.dtype)
    elif q.shape[0] > 0:
        _launch(
            "dq",
            max_q,
            num_heads,
            num_seqs,
            {**meta, "ACCUMULATE": accumulate is not None},
            (k, v),
            q,
            k,
            v,
            do,
            lse,
            delta,
            dq,
            *common,
            dq.stride(0),
            dq.stride(1),
            lse.stride(0),
            *variant,
            bucket,
        )
    dsinks = None if dsink_rows is None else dsink_rows.sum(1).to(sinks.dtype)  # type: ignore[union-attr]
    return dq, dk, dv, dsinks
