"""One forward and one backward of the benchmark's largest mix, for Nsight Compute (``--family
tl|gluon``: the Triton kernels or the Gluon sm_90 kernels, called directly).

Warm-up calls run outside the profiled range; the profiled range holds exactly one call of each
kernel on the table's tiles (32k tokens of 512-8192-token causal documents, 16 heads, bf16):

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis \\
        python3 benchmarks/profile_attention.py --head-dim 128
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.tune_attention import _layout
from thd.ops.attention import launch
from thd.ops.attention.params import AttentionOptions, BackwardCall, ForwardCall, SavedForBackward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--docs", default="512-8192")
    parser.add_argument("--family", choices=("tl", "gluon"), default="tl")
    parser.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the deterministic backward (split dQ kernel; the default here, as in the committed "
        "profiles); --no-deterministic: the default backward users get (dQ added from the dK/dV kernel)",
    )
    args = parser.parse_args()
    if args.family == "gluon":
        from thd.ops.attention.gluon import backward as gluon_backward
        from thd.ops.attention.gluon import forward as gluon_forward

        forward, backward = gluon_forward.forward, gluon_backward.backward
    else:
        forward, backward = launch.forward, launch.backward
    lo, hi = (int(x) for x in args.docs.split("-"))
    layout, rows, _ = _layout(args.tokens, lo, hi, 1, "cuda")
    q, k, v, do = (
        torch.randn(rows, 16, args.head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    )
    options = AttentionOptions(args.head_dim**-0.5, causal=True, deterministic=args.deterministic)
    for _ in range(3):
        out, lse = forward(ForwardCall(q, k, v, layout, options))
        backward(BackwardCall(do, SavedForBackward(q, k, v, out, lse), layout, options))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    out, lse = forward(ForwardCall(q, k, v, layout, options))
    backward(BackwardCall(do, SavedForBackward(q, k, v, out, lse), layout, options))
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
