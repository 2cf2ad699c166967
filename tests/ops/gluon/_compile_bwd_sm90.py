"""Compile the Gluon backward kernels for sm_90 without a GPU and print what their PTX holds.

``python tests/ops/gluon/_compile_bwd_sm90.py [config ...]`` from the repository root, with the
Triton to check (3.6 or 3.9) and ``TRITON_INTERPRET`` unset. Needs no torch: the ``thd`` packages
above ``thd.ops.attention.gluon`` are stood in for, so their torch imports never run. Prints one
JSON line per configuration (marker counts, registers and spills from the bundled ptxas, shared
memory) and exits 1 on the first failure.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _import_kernels() -> types.ModuleType:
    for name in ("thd", "thd.ops", "thd.ops.attention"):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [str(ROOT / "src" / Path(*name.split(".")))]
            sys.modules[name] = module
    from thd.ops.attention.gluon import backward_kernel

    return backward_kernel


MARKERS = {
    "wgmma": r"wgmma\.mma_async",
    "wgmma_wait": r"wgmma\.wait_group\.sync\.aligned \d",
    "tma_load": r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global\.mbarrier::complete_tx",
    "mbarrier_expect": r"mbarrier\.arrive\.expect_tx",
    "mbarrier_wait": r"mbarrier\.try_wait\.parity",
    "setmaxnreg": r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+\d+",
    "sm_90a": r"\.target sm_90a",
    "atomic_f32": r"(?:red|atom)\.global\.\S*add\S*f32",
    "tensormap": r"tensormap\.replace",
}

_DKDV_ARGS = [
    "q_ptr",
    "k_ptr",
    "v_ptr",
    "do_ptr",
    "lse_ptr",
    "delta_ptr",
    "dk_ptr",
    "dv_ptr",
    "dq_ptr",
    "cu_q_ptr",
    "cu_k_ptr",
    "cup_q_ptr",
    "cup_k_ptr",
    "pos_q_ptr",
    "pos_k_ptr",
    "rows_q",
    "rows_k",
    "stride_qt",
    "stride_qh",
    "stride_kt",
    "stride_kh",
    "stride_vt",
    "stride_vh",
    "stride_dot",
    "stride_doh",
    "stride_dkt",
    "stride_dkh",
    "stride_dvt",
    "stride_dvh",
    "stride_dqt",
    "stride_dqh",
    "stride_lse_h",
    "sm_scale",
    "window_left",
    "window_right",
]
_DQ_ARGS = [
    "q_ptr",
    "k_ptr",
    "v_ptr",
    "do_ptr",
    "lse_ptr",
    "delta_ptr",
    "dq_ptr",
    "cu_q_ptr",
    "cu_k_ptr",
    "cup_q_ptr",
    "cup_k_ptr",
    "pos_q_ptr",
    "pos_k_ptr",
    "rows_q",
    "rows_k",
    "stride_qt",
    "stride_qh",
    "stride_kt",
    "stride_kh",
    "stride_vt",
    "stride_vh",
    "stride_dot",
    "stride_doh",
    "stride_dqt",
    "stride_dqh",
    "stride_lse_h",
    "sm_scale",
    "window_left",
    "window_right",
]
_FP32 = {"lse_ptr", "delta_ptr", "dq_ptr"}
_INT = {"cu_q_ptr", "cu_k_ptr", "cup_q_ptr", "cup_k_ptr", "pos_q_ptr", "pos_k_ptr"}


def _signature(args: list[str], dtype: str, constexprs: dict[str, object], fp32: set[str]) -> dict[str, str]:
    signature = {}
    for name in args:
        if name in fp32:
            signature[name] = "*fp32"
        elif name in _INT:
            signature[name] = "*i32"
        elif name.endswith("_ptr"):
            signature[name] = f"*{dtype}"
        else:
            signature[name] = "fp32" if name == "sm_scale" else "i32"
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return signature


def _dkdv(head_dim: int, dtype: str = "bf16", **flags: object) -> tuple[str, list[str], str, dict, set[str]]:
    meta = {
        "GROUP": 1,
        "HEAD_DIM": head_dim,
        "HAS_POSITIONS": False,
        "HAS_LEFT": False,
        "HAS_RIGHT": True,
        "ACCUMULATE": False,
        "DQ_ATOMIC": True,
        "BLOCK_M": 64,
        "BLOCK_N": 128,
        "NUM_STAGES": 2,
        "NUM_WARPS": 8,
        "NUM_CONSUMERS": 1,
        "CONSUMER_REGS": 240,
        "PRODUCER_REGS": 24,
    }
    meta.update(flags)
    fp32 = set(_FP32) if meta["DQ_ATOMIC"] else {"lse_ptr", "delta_ptr"}
    if meta["ACCUMULATE"]:
        fp32 |= {"dk_ptr", "dv_ptr"}
    return "_dkdv_kernel", _DKDV_ARGS, dtype, meta, fp32


def _dq(head_dim: int, dtype: str = "bf16", **flags: object) -> tuple[str, list[str], str, dict, set[str]]:
    meta = {
        "GROUP": 1,
        "HEAD_DIM": head_dim,
        "HAS_POSITIONS": False,
        "HAS_LEFT": False,
        "HAS_RIGHT": True,
        "ACCUMULATE": False,
        "BLOCK_M": 128,
        "BLOCK_N": 64,
        "NUM_STAGES": 2,
        "NUM_WARPS": 8,
        "NUM_CONSUMERS": 1,
        "CONSUMER_REGS": 240,
        "PRODUCER_REGS": 24,
    }
    meta.update(flags)
    fp32 = {"lse_ptr", "delta_ptr"} | ({"dq_ptr"} if meta["ACCUMULATE"] else set())
    return "_dq_kernel", _DQ_ARGS, dtype, meta, fp32


CONFIGS = {
    "dkdv-d128": _dkdv(128),
    "dkdv-d64": _dkdv(64),
    "dkdv-d128-fp16-gqa-window": _dkdv(128, "fp16", GROUP=4, HAS_LEFT=True),
    "dkdv-d64-split": _dkdv(64, DQ_ATOMIC=False, HAS_RIGHT=False),
    "dkdv-d128-split": _dkdv(128, DQ_ATOMIC=False),
    "dkdv-d128-accumulate": _dkdv(128, ACCUMULATE=True, HAS_POSITIONS=True),
    "dq-d128": _dq(128),
    "dq-d64": _dq(64, HAS_RIGHT=False),
    "dkdv-d128-2wg": _dkdv(128, NUM_WARPS=4, NUM_CONSUMERS=2),
    "dkdv-d64-2wg-split": _dkdv(64, NUM_WARPS=4, NUM_CONSUMERS=2, DQ_ATOMIC=False),
    "dkdv-d128-2wg-split": _dkdv(128, NUM_WARPS=4, NUM_CONSUMERS=2, DQ_ATOMIC=False, NUM_STAGES=3),
    "dq-d128-2wg": _dq(128, NUM_WARPS=4, NUM_CONSUMERS=2),
    "dq-d64-2wg": _dq(64, NUM_WARPS=4, NUM_CONSUMERS=2, BLOCK_N=128),
}


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
    text = proc.stderr + proc.stdout
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", text)]
    spills = [
        int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    ]
    return {"registers": max(regs, default=-1), "spill_bytes": sum(spills)}


def compile_config(name: str) -> dict[str, object]:
    import triton
    from triton.backends.compiler import GPUTarget

    kernels = _import_kernels()
    from thd.ops.attention.gluon.compat import GluonASTSource

    kernel, args, dtype, meta, fp32 = CONFIGS[name]
    signature = _signature(args, dtype, meta, fp32)
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, arg in enumerate(args)
        if arg.endswith("_ptr") or (arg.startswith("stride_") and arg != "stride_lse_h")
    }
    source = GluonASTSource(getattr(kernels, kernel), signature, constexprs=meta, attrs=attrs)
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": meta["NUM_WARPS"]}
    )
    ptx = compiled.asm["ptx"]
    stats: dict[str, object] = {key: len(re.findall(rx, ptx)) for key, rx in MARKERS.items()}
    stats.update(_ptxas_stats(ptx))
    stats["shared"] = compiled.metadata.shared
    stats["num_warps"] = compiled.metadata.num_warps
    stats["maxnreg"] = [int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)]
    stats["triton"] = triton.__version__
    return {"name": name, **stats}


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(ROOT / "src"))
    for config in sys.argv[1:] or list(CONFIGS):
        print(json.dumps(compile_config(config)), flush=True)
