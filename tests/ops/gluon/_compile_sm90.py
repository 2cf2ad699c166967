"""Compile the Gluon kernels (forward and backward) for sm_90 without a GPU and print what their PTX holds.

``python tests/ops/gluon/_compile_sm90.py [--ptxas] [config ...]`` (none: all) from the
repository root (a config: a name of :data:`CONFIGS` or a backward tile as :func:`config_for` reads it),
with the Triton to check (3.6 or 3.9) and ``TRITON_INTERPRET`` unset. Needs no torch: the ``thd``
packages above ``thd.ops.attention.gluon`` are stood in for, so their torch imports never run. Prints
one JSON line per configuration (PTX marker counts, shared memory, warps, ``setmaxnreg`` values; with
``--ptxas`` registers, spills, the waits ptxas injected and whether it serialised the wgmma, from the
bundled ptxas) and exits 1 on the first failure.
:func:`compile_in_subprocess` runs it as the tests do: another interpreter, a fresh Triton cache.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import types
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

MARKERS = {
    "wgmma": r"wgmma\.mma_async",
    "wgmma_wait": r"wgmma\.wait_group\.sync\.aligned \d",
    "wgmma_wait1": r"wgmma\.wait_group\.sync\.aligned\s+1",
    "tma_load": r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global\.mbarrier::complete_tx",
    "mbarrier_expect": r"mbarrier\.arrive\.expect_tx",
    "mbarrier_wait": r"mbarrier\.try_wait\.parity",
    "setmaxnreg": r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+\d+",
    "sm_90a": r"\.target sm_90a",
    "atomic_f32": r"(?:red|atom)\.global\.\S*add\S*f32",
    "ticket_add": r"atom\.global\.gpu\.(?:relaxed|acq_rel)\.add\.u32",  # the dynamic order's ticket
    "tensormap": r"tensormap\.replace",
    "clock64": r"%clock64",
}
_INT = {
    "cu_q_ptr",
    "cu_k_ptr",
    "cup_q_ptr",
    "cup_k_ptr",
    "pos_q_ptr",
    "pos_k_ptr",
    "seq_ptr",
    "blk_ptr",
    "count_ptr",
}
_FLOATS = {"sm_scale", "softcap"}


@dataclass(frozen=True)
class Config:
    """One kernel specialization as a launch on contiguous tensors makes it: ``fp32`` names the
    fp32 pointers (the rest ``dtype``, offsets int32); every pointer and stride is 16-divisible
    except ``stride_lse_h`` unless ``lse_stride_divisible``."""

    module: str
    kernel: str
    dtype: str
    constexprs: dict[str, object]
    fp32: frozenset[str]
    num_warps: int
    options: dict[str, int] = field(default_factory=dict)
    lse_stride_divisible: bool = False


def _forward(head_dim: int = 128, head_dim_v: int = 128, dtype: str = "bf16", **flags: object) -> Config:
    meta: dict[str, object] = {
        "GROUP": 1,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_V": head_dim_v,
        "HAS_POSITIONS": False,
        "HAS_LEFT": False,
        "HAS_RIGHT": True,
        "SOFTCAP": False,
        "HAS_SINKS": False,
        "ACCUMULATE": False,
        "FOLD_SCALE": True,
        "BLOCK_M": 128,
        "BLOCK_N": 128,
        "STAGES": 2,
        "PRODUCER_REGS": 24,
        "NUM_WG": 2,
        "CONSUMER_REGS": 240,
        "SLOTS": True,
        "PACK": 1,
        "DYNAMIC": max(head_dim, head_dim_v) >= 128,  # as the tile table (forward.TILES) has it
        "PROFILE": False,
    }
    meta.update(flags)
    if not meta["PROFILE"]:
        meta["prof_ptr"] = None
    num_warps = 4 if meta["NUM_WG"] > 1 else 8
    fp32 = frozenset({"lse_ptr", "sinks_ptr"})
    return Config(
        "forward_kernel",
        "attention_fwd_kernel",
        dtype,
        meta,
        fp32,
        num_warps,
        {"maxnreg": 128 if meta["NUM_WG"] == 3 else 168},
        True,
    )


_BACKWARD = {
    "GROUP": 1,
    "HAS_POSITIONS": False,
    "HAS_LEFT": False,
    "HAS_RIGHT": True,
    "SOFTCAP": False,
    "ACCUMULATE": False,
}
_RING = {"NUM_STAGES": 2, "NUM_WARPS": 8, "NUM_CONSUMERS": 1, "CONSUMER_REGS": 240, "PRODUCER_REGS": 24}


def _dkdv(head_dim: int, dtype: str = "bf16", persistent: bool = False, **flags: object) -> Config:
    meta = {
        **_BACKWARD, "HEAD_DIM": head_dim, "DQ_ATOMIC": True, "DQ_ROWS": False, "BLOCK_M": 64, "BLOCK_N": 128,
        **_RING,
    }  # fmt: skip
    if persistent:
        meta["SLOTS"] = True
        meta["DYNAMIC"] = False
    meta.update(flags)
    fp32 = {"lse_ptr", "delta_ptr"} | ({"dq_ptr"} if meta["DQ_ATOMIC"] else set())
    if meta["ACCUMULATE"]:
        fp32 |= {"dk_ptr", "dv_ptr"}
    kernel = "_dkdv_persistent_kernel" if persistent else "_dkdv_kernel"
    return Config("backward_kernel", kernel, dtype, meta, frozenset(fp32), int(meta["NUM_WARPS"]))


def _dq(head_dim: int, dtype: str = "bf16", **flags: object) -> Config:
    meta = {**_BACKWARD, "HEAD_DIM": head_dim, "BLOCK_M": 128, "BLOCK_N": 64, **_RING}
    meta.update(flags)
    fp32 = {"lse_ptr", "delta_ptr"} | ({"dq_ptr"} if meta["ACCUMULATE"] else set())
    return Config("backward_kernel", "_dq_kernel", dtype, meta, frozenset(fp32), int(meta["NUM_WARPS"]))


# The two-partition dK/dV tiles of backward.TWO_CONSUMER_TILES (this script imports no torch, so it
# cannot read them there): three Q/dO stages at head dim 128, 128-query tiles at 64 with dQ split by
# query rows (GluonTile.dq_rows; the plan passes DQ_ROWS only with the atomic dQ).
_DKDV_2WG = {
    128: {"NUM_WARPS": 4, "NUM_CONSUMERS": 2, "NUM_STAGES": 3},
    64: {"NUM_WARPS": 4, "NUM_CONSUMERS": 2, "BLOCK_M": 128, "DQ_ROWS": True},
}
_DQ_BY_COLUMNS = {"DQ_ROWS": False}

_VARIANTS = {  # every score option at once: window, positions, softcap, sinks, accumulate
    "HAS_LEFT": True,
    "HAS_POSITIONS": True,
    "SOFTCAP": True,
    "HAS_SINKS": True,
    "ACCUMULATE": True,
    "FOLD_SCALE": False,
}

CONFIGS: dict[str, Config] = {
    # forward
    "d128-causal-bf16": _forward(),
    "d128-causal-bf16-one-consumer": _forward(NUM_WG=1),
    "d128-causal-bf16-profile": _forward(PROFILE=True, PRODUCER_REGS=32),
    "d64-causal-bf16-profile": _forward(
        64, 64, BLOCK_M=192, STAGES=3, NUM_WG=3, CONSUMER_REGS=160, PROFILE=True, PRODUCER_REGS=32
    ),
    "d64-fp16": _forward(
        64, 64, "fp16", HAS_RIGHT=False, STAGES=3, SLOTS=False, BLOCK_M=192, NUM_WG=3, CONSUMER_REGS=160
    ),
    "d64-two-consumers": _forward(64, 64, STAGES=3),
    "d64-causal-bf16": _forward(64, 64, BLOCK_M=192, STAGES=3, NUM_WG=3, CONSUMER_REGS=160, DYNAMIC=False),
    "d128-variants-bf16": _forward(**_VARIANTS),
    "d256-causal-bf16": _forward(256, 256, BLOCK_N=32),
    "d256-variants-fp16": _forward(256, 256, "fp16", BLOCK_N=32, **_VARIANTS),
    "d256-dv128-gqa": _forward(256, 128, BLOCK_N=32, GROUP=4, HAS_RIGHT=False, SLOTS=False),
    "d128-gqa-pack": _forward(GROUP=2, PACK=2, PRODUCER_REGS=32),  # as the host launches it
    "d128-static": _forward(DYNAMIC=False),
    "d128-accumulate": _forward(ACCUMULATE=True),
    "d128-softcap-sinks-window": _forward(SOFTCAP=True, HAS_SINKS=True, HAS_LEFT=True, FOLD_SCALE=False),
    "d128-gqa-pack-variants": _forward(
        GROUP=4,
        PACK=2,
        PRODUCER_REGS=32,
        HAS_LEFT=True,
        HAS_POSITIONS=True,
        HAS_SINKS=True,
        ACCUMULATE=True,
        SLOTS=False,
    ),
    # backward
    "dkdv-d128": _dkdv(128),
    "dkdv-d64": _dkdv(64),
    "dkdv-d128-fp16-gqa-window": _dkdv(128, "fp16", GROUP=4, HAS_LEFT=True),
    "dkdv-d64-split": _dkdv(64, DQ_ATOMIC=False, HAS_RIGHT=False),
    "dkdv-d128-split": _dkdv(128, DQ_ATOMIC=False),
    "dkdv-d128-accumulate": _dkdv(128, ACCUMULATE=True, HAS_POSITIONS=True),
    "dq-d128": _dq(128),
    "dq-d64": _dq(64, HAS_RIGHT=False),
    "dkdv-d128-2wg": _dkdv(128, **_DKDV_2WG[128]),
    "dkdv-d64-2wg": _dkdv(64, **_DKDV_2WG[64]),
    "dkdv-d128-2wg-gqa-window-accumulate": _dkdv(
        128, **_DKDV_2WG[128], GROUP=4, HAS_LEFT=True, ACCUMULATE=True, HAS_POSITIONS=True
    ),
    "dkdv-d64-2wg-split": _dkdv(64, **_DKDV_2WG[64] | _DQ_BY_COLUMNS, DQ_ATOMIC=False),
    "dkdv-d128-2wg-split": _dkdv(128, **_DKDV_2WG[128], DQ_ATOMIC=False),
    "dkdv-d128-2wg-persistent": _dkdv(128, persistent=True, **_DKDV_2WG[128]),
    "dkdv-d64-2wg-persistent": _dkdv(64, persistent=True, **_DKDV_2WG[64], SLOTS=False),
    "dkdv-d128-2wg-persistent-gqa-window-accumulate": _dkdv(
        128, persistent=True, **_DKDV_2WG[128], GROUP=4, HAS_LEFT=True, ACCUMULATE=True, HAS_POSITIONS=True
    ),
    "dkdv-d64-persistent-split": _dkdv(64, persistent=True, DQ_ATOMIC=False),
    "dkdv-d64-2wg-persistent-dynamic": _dkdv(64, persistent=True, **_DKDV_2WG[64], SLOTS=False, DYNAMIC=True),
    "dkdv-d128-2wg-persistent-dynamic": _dkdv(128, persistent=True, **_DKDV_2WG[128], DYNAMIC=True),
    "dkdv-d64-persistent-dynamic-split": _dkdv(64, persistent=True, DQ_ATOMIC=False, DYNAMIC=True),
    # softcap: the tiles backward.tiles_for gives it (64-query dK/dV tiles at head dim 64)
    "dkdv-d128-2wg-softcap": _dkdv(128, **_DKDV_2WG[128], SOFTCAP=True),
    "dkdv-d64-2wg-softcap": _dkdv(64, **_DKDV_2WG[64] | {"BLOCK_M": 64} | _DQ_BY_COLUMNS, SOFTCAP=True),
    "dkdv-d64-2wg-persistent-softcap": _dkdv(
        64, persistent=True, **_DKDV_2WG[64] | {"BLOCK_M": 64} | _DQ_BY_COLUMNS, SOFTCAP=True, HAS_LEFT=True
    ),
    "dq-d128-2wg-softcap": _dq(128, NUM_WARPS=4, NUM_CONSUMERS=2, SOFTCAP=True),
    # dQ split by columns between the two partitions (the head-dim-64 default before dq_rows)
    "dkdv-d64-2wg-dqcols": _dkdv(64, **_DKDV_2WG[64] | _DQ_BY_COLUMNS),
    "dq-d128-2wg": _dq(128, NUM_WARPS=4, NUM_CONSUMERS=2),
    "dq-d64-2wg": _dq(64, NUM_WARPS=4, NUM_CONSUMERS=2, BLOCK_N=128),
}


_TILE_NAME = re.compile(r"(dkdv|dq)-d(\d+)-(\d+)x(\d+)s(\d+)c([12])(?:r(\d+))?(-split)?")


def config_for(name: str) -> Config:
    """A name of :data:`CONFIGS`, or a backward tile named ``KERNEL-dD-BMxBNsSTAGEScCONSUMERS[rREGS]``
    (``rREGS``: the second consumer partition's registers, default 240) with ``-split`` for a dK/dV
    kernel without the atomic dQ, e.g. ``dkdv-d128-64x128s3c2r232``; otherwise as the table's
    backward configs (bf16, causal, one head per group)."""
    if name in CONFIGS:
        return CONFIGS[name]
    match = _TILE_NAME.fullmatch(name)
    if match is None:
        raise KeyError(f"{name!r}: neither a configuration nor KERNEL-dD-BMxBNsSTAGEScCONSUMERS[rREGS]")
    kernel, dim, block_m, block_n, stages, consumers, regs, split = match.groups()
    if kernel == "dq" and split:
        raise KeyError(f"{name!r}: -split names a dK/dV kernel")
    tile = {
        "BLOCK_M": int(block_m),
        "BLOCK_N": int(block_n),
        "NUM_STAGES": int(stages),
        "NUM_CONSUMERS": int(consumers),
        "NUM_WARPS": 8 if consumers == "1" else 4,
        "CONSUMER_REGS": int(regs or 240),
    }
    if kernel == "dq":
        return _dq(int(dim), **tile)
    return _dkdv(int(dim), DQ_ATOMIC=not split, **tile)


def _import_kernels(module: str) -> types.ModuleType:
    for name in ("thd", "thd.ops", "thd.ops.attention"):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(ROOT / "src" / Path(*name.split(".")))]
            sys.modules[name] = package
    import importlib

    return importlib.import_module(f"thd.ops.attention.gluon.{module}")


def _signature(fn, config: Config) -> dict[str, str]:  # type: ignore[no-untyped-def]
    signature = {}
    for index, name in enumerate(fn.arg_names):
        if index in fn.constexprs or (name == "prof_ptr" and name in config.constexprs):
            signature[name] = "constexpr"
        elif name == "prof_ptr":
            signature[name] = "*i64"
        elif name in config.fp32:
            signature[name] = "*fp32"
        elif name in _INT:
            signature[name] = "*i32"
        elif name.endswith("_ptr"):
            signature[name] = f"*{config.dtype}"
        else:
            signature[name] = "fp32" if name in _FLOATS else "i32"
    return signature


def _ptxas_stats(ptx: str) -> dict[str, int]:
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        proc = subprocess.run(
            [get_ptxas(90).path, "-arch=sm_90a", "-v", str(path), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
        sass = subprocess.run(
            [str(Path(get_ptxas(90).path).with_name("nvdisasm")), "-c", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    text = proc.stderr + proc.stdout
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", text)]
    spills = [
        int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    ]
    # C7517: "warpgroup.wait is injected ... to allow use of registers defined by GMMA" (a wait the
    # kernel did not ask for, which serialises its async products)
    injected = len(re.findall(r"C7517", text))
    return {
        "registers": max(regs, default=-1),
        "spill_bytes": sum(spills),
        "injected_waits": injected,
        # C7512: "wgmma.mma_async instructions are serialized due to insufficient register resources"
        # (every product waited for at once: no wgmma overlaps another or the softmax)
        "wgmma_serialized": len(re.findall(r"C7512", text)),
        "exp2_before_last_wait": exp2_before_last_wait(sass),
        "mufu_ex2": len(re.findall(r"MUFU\.EX2", sass)),
        "fadd": len(re.findall(r"\bFADD\b", sass)),
    }


def exp2_before_last_wait(sass: str) -> list[int]:
    """Per block that starts at a ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` (scores in, one product still in
    flight) and ends at the next ``WARPGROUP.ARRIVE``: how many ``MUFU.EX2`` come before the block's
    first ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` (the wait for that product). In the forward's key loop this
    is the softmax that overlaps the in-flight ``P V``; 0 means ptxas put that wait first."""
    counts: list[int] = []
    current: int | None = None
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            current = 0
        elif current is None:
            continue
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line or "WARPGROUP.ARRIVE" in line:
            counts.append(current)
            current = None
        elif "MUFU.EX2" in line:
            current += 1
    return counts


def compile_config(name: str, ptxas: bool = False) -> dict[str, object]:
    """``triton.compile`` of one configuration for sm_90 and what its PTX holds."""
    import triton
    from triton.backends.compiler import GPUTarget

    config = config_for(name)
    fn = getattr(_import_kernels(config.module), config.kernel)
    from thd.ops.attention.gluon.compat import GluonASTSource

    signature = _signature(fn, config)
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, arg in enumerate(fn.arg_names)
        if signature[arg].startswith("*")
        or (arg.startswith("stride_") and (config.lse_stride_divisible or arg != "stride_lse_h"))
    }
    source = GluonASTSource(fn, signature, constexprs=config.constexprs, attrs=attrs)
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": config.num_warps, **config.options}
    )
    ptx = compiled.asm["ptx"]
    stats: dict[str, object] = {key: len(re.findall(rx, ptx)) for key, rx in MARKERS.items()}
    if ptxas:
        stats.update(_ptxas_stats(ptx))
    stats["shared"] = compiled.metadata.shared
    stats["num_warps"] = compiled.metadata.num_warps
    stats["maxnreg"] = [int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)]
    stats["triton"] = triton.__version__
    return {"name": name, **stats}


def compile_in_subprocess(python: str, configs: tuple[str, ...], ptxas: bool = False) -> dict[str, dict]:
    """This script's stats of ``configs`` compiled by ``python`` (without ``TRITON_INTERPRET``, a
    fresh Triton cache); asserts that it succeeded."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = env.get("TRITON_DEFAULT_FP_FUSION", "1")
    with tempfile.TemporaryDirectory() as cache:
        env["TRITON_CACHE_DIR"] = cache
        proc = subprocess.run(
            [python, __file__, *(["--ptxas"] if ptxas else []), *configs],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    stats = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {s["name"]: s for s in stats}


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(ROOT / "src"))
    args = sys.argv[1:]
    with_ptxas = "--ptxas" in args
    for config_name in [arg for arg in args if not arg.startswith("--")] or list(CONFIGS):
        print(json.dumps(compile_config(config_name, ptxas=with_ptxas)), flush=True)
