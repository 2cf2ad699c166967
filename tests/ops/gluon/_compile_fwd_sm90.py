"""Compile the Gluon forward for a Hopper target (sm_90) without a GPU: ``python -m`` this module with
configuration names (none: all). Needs only Triton (no torch), so it runs under Triton 3.6 and 3.9.
Prints one ``ok <name> <key>=<count> ...`` line per configuration, counting the PTX instructions the
kernel must use, and exits 1 on the first failure. Run it with ``TRITON_INTERPRET`` unset and a fresh
``TRITON_CACHE_DIR``."""

from __future__ import annotations

import importlib.util
import re
import sys
import types

import triton
from triton.backends.compiler import GPUTarget

if importlib.util.find_spec("torch") is None:
    # The compile-only Triton 3.6 venv has no torch; ``thd.ops.attention``'s package init imports
    # ``torch.Tensor`` for annotations only, and the Gluon kernel modules use nothing of torch.
    sys.modules["torch"] = types.ModuleType("torch")
    sys.modules["torch"].Tensor = type("Tensor", (), {})  # type: ignore[attr-defined]

from thd.ops.attention.gluon.compat import GluonASTSource
from thd.ops.attention.gluon.forward_kernel import attention_fwd_kernel

_FP32 = {"lse_ptr", "sinks_ptr"}
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

# PTX patterns (loose: state-space suffixes differ between 3.6 and 3.9)
PATTERNS = {
    "wgmma": r"wgmma\.mma_async",
    "wgmma_wait1": r"wgmma\.wait_group\.sync\.aligned\s+1",
    "bulk_tensor": r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global\.mbarrier::complete_tx",
    "expect_tx": r"mbarrier\.arrive\.expect_tx",
    "try_wait": r"mbarrier\.try_wait\.parity",
    "setmaxnreg": r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+\d+",
    "sm90a": r"\.target sm_90a",
    "tensormap": r"tensormap\.replace",
}


def _variant(head_dim: int = 128, head_dim_v: int = 128, **flags: object) -> dict[str, object]:
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
    }
    meta.update(flags)
    return meta


# name -> (dtype, constexprs, num_warps of the consumer)
CONFIGS: dict[str, tuple[str, dict[str, object], int]] = {
    "d128-causal-bf16": ("bf16", _variant(), 4),
    "d128-causal-bf16-one-consumer": ("bf16", _variant(NUM_WG=1), 8),
    "d64-fp16": ("fp16", _variant(64, 64, HAS_RIGHT=False, STAGES=3), 4),
    "d128-variants-bf16": (
        "bf16",
        _variant(
            HAS_LEFT=True, HAS_POSITIONS=True, SOFTCAP=True, HAS_SINKS=True, ACCUMULATE=True, FOLD_SCALE=False
        ),
        4,
    ),
}


def _signature(dtype: str) -> dict[str, str]:
    fn = attention_fwd_kernel
    signature = {}
    for index, name in enumerate(fn.arg_names):
        if index in fn.constexprs:
            signature[name] = "constexpr"
        elif name in _FP32:
            signature[name] = "*fp32"
        elif name in _INT:
            signature[name] = "*i32"
        elif name.endswith("_ptr"):
            signature[name] = f"*{dtype}"
        else:
            signature[name] = "fp32" if name in _FLOATS else "i32"
    return signature


def compile_config(name: str):  # type: ignore[no-untyped-def]
    """``triton.compile`` of one configuration as a launch on contiguous tensors specializes it."""
    dtype, constexprs, num_warps = CONFIGS[name]
    fn = attention_fwd_kernel
    signature = _signature(dtype)
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, arg in enumerate(fn.arg_names)
        if signature[arg].startswith("*") or (arg.startswith("stride_") and arg.endswith(("t", "h")))
    }
    source = GluonASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "maxnreg": 168}
    )


def stats(compiled) -> dict[str, int]:  # type: ignore[no-untyped-def]
    ptx = compiled.asm["ptx"]
    counts = {key: len(re.findall(pattern, ptx)) for key, pattern in PATTERNS.items()}
    counts["num_warps"] = compiled.metadata.num_warps
    counts["shared"] = compiled.metadata.shared
    return counts


if __name__ == "__main__":
    names = [arg for arg in sys.argv[1:] if not arg.startswith("--")]
    for config in names or list(CONFIGS):
        result = stats(compile_config(config))
        print("ok", config, *(f"{key}={value}" for key, value in result.items()), flush=True)
