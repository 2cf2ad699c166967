"""Tile policy of the attention kernels: the measured tile table, the register cap, the dQ mode and
the TMA switch (all fixed at import from :data:`thd._runtime.config.SETTINGS`).

Tiles come from a table measured on the H200 (:data:`TILES`), looked up by kernel and head-dim
class, so the hot path pays no autotuner. ``THD_AUTOTUNE=1`` autotunes over :data:`CANDIDATES`
instead (the benchmark uses it to refresh the table); ``THD_TILES=file.json`` replaces entries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from thd._runtime.config import kernel_settings
from thd._runtime.launcher import ensure_scratch_allocator

__all__ = [
    "CANDIDATES",
    "FAST_DQ_MODE",
    "INTERPRETER_TILE",
    "LONG_SEQUENCES",
    "MEASURED_DQ_MODE",
    "SETTINGS",
    "SMALL_FWD_MAX_REGISTERS",
    "TILES",
    "TMA_ENABLED",
    "Tile",
    "dq_mode",
    "load_tile_overrides",
    "prune_configs",
    "register_cap",
    "tile_entry",
    "tile_for",
    "tma_capable",
]

SETTINGS = kernel_settings()
"""The kernel settings this module (and the ``tl`` launchers) were imported with."""


@dataclass(frozen=True)
class Tile:
    """Rows of queries and keys per tile, the kernel's warps and pipeline stages, whether the inner
    loop reads its tiles through tensor descriptors (``tma``, Hopper's copy engine; only where the
    tensors allow it, see :func:`tma_capable`) and whether Triton warp-specializes that loop."""

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
FP32_256_TILE = Tile(32, 32, 4, 1)  # fp32 with a 256-wide head: the only tile that fits
LONG_SEQUENCES = 1024
INTERPRETER_TILE = Tile(32, 32, 4, 1)


def load_tile_overrides(path: str) -> None:
    """``THD_TILES=file.json``: ``{"fwd,128,long": [block_m, block_n, warps, stages], ...}`` replaces
    entries of :data:`TILES` (``benchmarks/tune_attention.py --emit-tiles`` writes such a file)."""
    with open(path) as fh:
        for key, value in json.load(fh).items():
            kernel, dim_class, length = key.split(",")
            TILES[(kernel, int(dim_class), length == "long")] = Tile(
                *(int(x) for x in value[:4]), *map(bool, value[4:])
            )


def tile_entry(tile: Tile) -> list[int]:
    """A tile as written in a ``THD_TILES`` file."""
    return [
        tile.block_m,
        tile.block_n,
        tile.num_warps,
        tile.num_stages,
        int(tile.tma),
        int(tile.warp_specialize),
    ]


if SETTINGS.tiles_file:
    load_tile_overrides(SETTINGS.tiles_file)


def _tiles(*shapes: tuple[int, int, int, int]) -> list[Tile]:
    """Pointer-load tiles of ``(block_m, block_n, num_warps, num_stages)`` shapes."""
    return [Tile(*shape) for shape in shapes]


# The autotuner's candidates (THD_AUTOTUNE=1), per kernel.
CANDIDATES: dict[str, list[Tile]] = {
    "fwd": _tiles((128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2))
    + _tiles((64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 2)),
    "dkdv": _tiles((64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 2), (32, 128, 8, 2))
    + _tiles((128, 128, 8, 2), (128, 64, 8, 2), (32, 64, 4, 2)),
    "dq": _tiles((128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 32, 4, 2), (128, 32, 4, 3)),
}
_MAX_TILE_AREA_256 = {"fwd": 64 * 64, "dkdv": 32 * 64, "dq": 64 * 64}


def _dim_class(meta: dict[str, int | bool]) -> int:
    """The padded head dim in units of 16-bit elements (fp32 tiles take twice the shared memory)."""
    width = max(64, int(meta["BLOCK_D"]), int(meta["BLOCK_DV"]))
    return width * 2 if meta["FP32"] else width


def tile_for(kernel: str, meta: dict[str, int | bool], max_seqlen: int) -> Tile:
    """The tile a launch of ``kernel`` uses for these head dims and sequence lengths."""
    if SETTINGS.interpret:
        return INTERPRETER_TILE
    dim_class = _dim_class(meta)
    if dim_class > 256:
        return FP32_256_TILE
    return TILES[(kernel, dim_class, max_seqlen > LONG_SEQUENCES)]


def prune_configs(kernel: str):  # type: ignore[no-untyped-def]
    """The autotuner's ``early_config_prune`` of ``kernel``: small tiles for 256-wide heads."""

    def prune(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
        if max(int(kwargs["BLOCK_D"]), int(kwargs["BLOCK_DV"])) <= 128:  # type: ignore[call-overload]
            return configs
        area = _MAX_TILE_AREA_256[kernel]
        kept = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= area and c.num_stages <= 2]
        return kept or [INTERPRETER_TILE.config()]

    return prune


# How the non-deterministic backward adds dQ (see kernels.py): 0 its own kernel (as the
# deterministic backward always does), 1 per-element atomics, 2 one bulk TMA reduction per tile.
# Mode 0 on the GPU: on the H200 the split kernels beat per-element atomics (f2af2bb) and the TMA
# reductions (046257b: correct, slower on every mix) in benchmarks/tune_attention.py sweeps.
# MEASURED_DQ_MODE is the best_dq_mode of benchmarks/results/attention-tiles.json (a test keeps
# them equal): a sweep that finds the atomic backward faster moves the default with the table.
MEASURED_DQ_MODE = 0
FAST_DQ_MODE = (
    1 if SETTINGS.interpret else (MEASURED_DQ_MODE if SETTINGS.dq_mode is None else SETTINGS.dq_mode)
)


def dq_mode(deterministic: bool) -> int:
    """The backward's ``DQ_MODE`` constexpr: 0 when deterministic, else :data:`FAST_DQ_MODE`."""
    if deterministic or FAST_DQ_MODE == 0:
        return 0
    if FAST_DQ_MODE == 2:
        ensure_scratch_allocator()
    return FAST_DQ_MODE


TMA_ENABLED = SETTINGS.tma
_tma_devices: dict[int, bool] = {}


def tma_capable(*tensors: Tensor) -> bool:
    """Whether the copy engine can read row tiles of these ``[T, H, D]`` tensors: a Hopper or newer
    GPU (or the interpreter), 16-byte aligned data and row and head strides."""
    if not TMA_ENABLED:
        return False
    first = tensors[0]
    if not SETTINGS.interpret:
        if not first.is_cuda:  # CPU tensors outside the interpreter (host-time stubs): no copy engine
            return False
        index = first.device.index if first.device.index is not None else torch.cuda.current_device()
        if index not in _tma_devices:
            _tma_devices[index] = torch.cuda.get_device_capability(index)[0] >= 9
        if not _tma_devices[index]:
            return False
    for t in tensors:
        per_16_bytes = 16 // t.element_size()
        if t.data_ptr() % 16 or t.stride(0) % per_16_bytes or t.stride(1) % per_16_bytes:
            return False
    ensure_scratch_allocator()
    return True


# A 4-warp forward tile of head dims <= 64 is capped at 168 registers per thread, which keeps
# three blocks on an SM (65536 registers / (168 x 128 threads)). On the H200 (Triton 3.6) the plain
# kernel takes 168 by itself; sinks took 172, a left window 211, softcap 204 (two blocks per SM, the
# forward up to 20% slower). Capped, all four compile to <= 168 without spills there
# (tests/ops/test_attention_registers_gpu.py; benchmarks/results/README.md, session 19). The ring's
# accumulating launches took 208-210, capped 166-168 without spills, and its forward per rank ran
# 0.6-11% faster capped (docs/cp.md; Triton 3.9's ptxas gives them an 8-byte stack frame instead).
# ``THD_FWD_MAX_REGISTERS`` (read at import) replaces the cap; ``0`` compiles without one.
SMALL_FWD_MAX_REGISTERS = SETTINGS.fwd_max_registers


def register_cap(kernel: str, tile: Tile, meta: dict) -> dict[str, int]:
    """Extra compile option of a launch: ``{"maxnreg": ...}`` for small-head-dim forward tiles, else {}."""
    small = max(meta["BLOCK_D"], meta["BLOCK_DV"]) <= 64
    if kernel == "fwd" and tile.num_warps == 4 and small and SMALL_FWD_MAX_REGISTERS > 0:
        return {"maxnreg": SMALL_FWD_MAX_REGISTERS}
    return {}
