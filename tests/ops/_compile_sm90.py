"""Compile the attention kernels for a Hopper target (sm_90) without a GPU: ``python -m`` this module
with configuration names, or none for all. Prints one ``ok <name> wgmma=N bulk_tensor=N cp_async_16=N`` line
per configuration (instruction counts in its PTX) and exits 1 on the first failure. Run it with
``TRITON_INTERPRET`` unset: the interpreter replaces ``@triton.jit`` functions with Python ones."""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from thd.ops.attention import kernels

_FP32_POINTERS = {"lse_ptr", "delta_ptr", "dq_acc_ptr", "dsink_rows_ptr", "sinks_ptr"}
_INT_POINTERS = {"cu_q_ptr", "cu_k_ptr", "cup_q_ptr", "cup_k_ptr", "pos_q_ptr", "pos_k_ptr"}
_FLOATS = {"sm_scale", "softcap"}


def _signature(
    fn: triton.JITFunction, dtype: str, fp32_pointers: frozenset[str] = frozenset()
) -> dict[str, str]:
    signature = {}
    for index, name in enumerate(fn.arg_names):
        if index in fn.constexprs:
            signature[name] = "constexpr"
        elif name in _FP32_POINTERS or name in fp32_pointers:
            signature[name] = "*fp32"
        elif name in _INT_POINTERS:
            signature[name] = "*i32"
        elif name.endswith("_ptr"):
            signature[name] = f"*{dtype}"
        else:
            signature[name] = "fp32" if name in _FLOATS else "i32"
    return signature


def _aligned(fn: triton.JITFunction, signature: dict[str, str]) -> dict[tuple[int, ...], list[list[object]]]:
    """What a real launch tells the compiler about contiguous tensors: pointers and row/head
    strides divisible by 16 (as Triton specializes them), so loads vectorize as they would."""
    attrs: dict[tuple[int, ...], list[list[object]]] = {}
    for index, name in enumerate(fn.arg_names):
        if signature[name].startswith("*") or (name.startswith("stride_") and name.endswith(("t", "h"))):
            attrs[(index,)] = [["tt.divisibility", 16]]
    return attrs


def _variant(head_dim: int = 128, head_dim_v: int = 128, **flags: bool) -> dict[str, int | bool]:
    meta: dict[str, int | bool] = {
        "GROUP": 1,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_V": head_dim_v,
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        "BLOCK_DV": max(16, triton.next_power_of_2(head_dim_v)),
        "HAS_POSITIONS": False,
        "HAS_LEFT": False,
        "HAS_RIGHT": True,
        "SOFTCAP": False,
        "UPCAST": False,
        "TMA": False,
        "WARP_SPEC": False,
        "ACCUMULATE": False,
    }
    meta.update(flags)
    return meta


_ALL = {"HAS_LEFT": True, "SOFTCAP": True, "HAS_POSITIONS": True}
# name -> (kernel, dtype, constexprs, (block_m, block_n, warps, stages))
CONFIGS = {
    "fwd": (
        "_attention_fwd_kernel",
        "bf16",
        _variant(HAS_SINKS=False, ACCUMULATE=False, FOLD_SCALE=True),
        (128, 64, 8, 3),
    ),
    "fwd-tma": (
        "_attention_fwd_kernel",
        "bf16",
        _variant(HAS_SINKS=False, ACCUMULATE=False, FOLD_SCALE=True, TMA=True),
        (128, 64, 8, 3),
    ),
    "fwd-tma-ws": (
        "_attention_fwd_kernel",
        "bf16",
        _variant(HAS_SINKS=False, ACCUMULATE=False, FOLD_SCALE=True, TMA=True, WARP_SPEC=True),
        (128, 64, 8, 3),
    ),
    "fwd-variants-tma": (
        "_attention_fwd_kernel",
        "bf16",
        _variant(72, 136, HAS_SINKS=True, ACCUMULATE=True, FOLD_SCALE=False, TMA=True, **_ALL),
        (64, 64, 4, 3),
    ),
    "fwd-fp32-tma": (
        "_attention_fwd_kernel",
        "fp32",
        _variant(HAS_SINKS=False, ACCUMULATE=False, FOLD_SCALE=True, TMA=True),
        (32, 32, 4, 2),
    ),
    "dkdv": ("_attention_bwd_dkdv_kernel", "bf16", _variant(DQ_MODE=0), (32, 64, 4, 2)),
    "dkdv-tma": ("_attention_bwd_dkdv_kernel", "bf16", _variant(DQ_MODE=0, TMA=True), (32, 64, 4, 3)),
    "dkdv-variants-tma-atomic": (
        "_attention_bwd_dkdv_kernel",
        "bf16",
        _variant(40, 24, DQ_MODE=1, TMA=True, ACCUMULATE=True, **_ALL),
        (32, 64, 4, 2),
    ),
    "dkdv-tma-reduce": ("_attention_bwd_dkdv_kernel", "bf16", _variant(DQ_MODE=2, TMA=True), (64, 64, 4, 2)),
    "dq": ("_attention_bwd_dq_kernel", "bf16", _variant(), (128, 64, 8, 3)),
    "dq-tma": (
        "_attention_bwd_dq_kernel",
        "bf16",
        _variant(TMA=True, ACCUMULATE=True, **_ALL),
        (128, 64, 8, 3),
    ),
}


def compile_kernel(  # type: ignore[no-untyped-def]
    kernel: str,
    dtype: str,
    constexprs: dict,
    options: dict,
    target: GPUTarget,
    fp32_pointers: frozenset[str] = frozenset(),
):
    """``triton.compile`` of ``kernels.<kernel>`` as a launch with contiguous tensors specializes it
    (``constexprs`` not among its parameters are dropped; ``fp32_pointers`` name further fp32 tensors,
    such as the ring's fp32 running output)."""
    fn = getattr(kernels, kernel)
    constexprs = {key: value for key, value in constexprs.items() if key in fn.arg_names}
    signature = _signature(fn, dtype, fp32_pointers)
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=_aligned(fn, signature))
    return triton.compile(source, target=target, options=options)


def compile_config(name: str) -> dict[str, int]:
    """Compile one configuration; counts of Hopper instructions in its PTX."""
    kernel, dtype, meta, (block_m, block_n, warps, stages) = CONFIGS[name]
    constexprs = {**meta, "BLOCK_M": block_m, "BLOCK_N": block_n}
    compiled = compile_kernel(
        kernel, dtype, constexprs, {"num_warps": warps, "num_stages": stages}, GPUTarget("cuda", 90, 32)
    )
    ptx = compiled.asm["ptx"]
    return {
        "wgmma": ptx.count("wgmma.mma_async"),
        "bulk_tensor": ptx.count("cp.async.bulk.tensor"),
        "cp_async_16": ptx.count("cp.async.cg.shared.global"),
    }


if __name__ == "__main__":
    names = [arg for arg in sys.argv[1:] if not arg.startswith("--")]
    for config in names or list(CONFIGS):
        stats = compile_config(config)
        print("ok", config, *(f"{key}={value}" for key, value in stats.items()), flush=True)
