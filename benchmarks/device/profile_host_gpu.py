"""cProfile of thd's eager forward host path on the GPU (the tiny host-time problem), per family.

device: PYTHONPATH=src:. python3 benchmarks/device/profile_host_gpu.py [tl|gluon ...]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

import torch

import thd

CALLS = 300


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", choices=["tl", "gluon"], default=["tl", "gluon"])
    families = parser.parse_args().families
    cu = torch.tensor([0, 64, 128], dtype=torch.int32, device="cuda")
    q = torch.randn(128, 2, 128, device="cuda", dtype=torch.bfloat16)
    k, v = q.clone(), q.clone()
    for family in families:
        os.environ["THD_KERNELS"] = family

        def call() -> None:
            thd.attention(q, k, v, cu, cu, max_seqlen_q=64, max_seqlen_kv=64, causal=True)

        for _ in range(50):
            call()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(CALLS):
            call()
        torch.cuda.synchronize()
        print(f"== {family}: {(time.perf_counter() - start) / CALLS * 1e6:.1f} us per forward call")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(CALLS):
            call()
        profile.disable()
        torch.cuda.synchronize()
        pstats.Stats(profile).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
