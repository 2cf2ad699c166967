"""Spawn ``world_size`` processes with a process group (gloo on CPU, nccl on GPU), bounded in time.

Rendezvous goes through a ``file://`` store in a fresh temporary directory, so no TCP port is
ever reserved or raced for. Each rank runs ``fn(rank, world_size, *args)``; the first failure
(or the timeout) terminates the other ranks and fails the caller with the rank's traceback.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["cuda_devices", "spawn"]


def cuda_devices() -> int:
    """Number of visible CUDA devices (0 on CPU-only builds)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _entry(
    rank: int,
    fn: Callable[..., None],
    world_size: int,
    init_method: str,
    backend: str,
    pg_timeout_s: float,
    bind_device: bool,
    args: tuple[Any, ...],
) -> None:
    if backend == "gloo":
        # CPU lane: attention through the torch reference, padding cleanup through its torch path.
        os.environ["THD_ATTENTION_BACKEND"] = "reference"
        os.environ.pop("TRITON_INTERPRET", None)
        torch.set_num_threads(1)
    else:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size,
        timeout=timedelta(seconds=pg_timeout_s),
        device_id=torch.device("cuda", rank) if bind_device else None,
    )  # fmt: skip
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Passed: leave without interpreter finalization. Under CPU load a rank that had passed was
    # seen aborting there ("terminate called without an active exception", a gloo thread still
    # joinable at exit), which failed the test after every check had run.
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def spawn(
    fn: Callable[..., None],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 150.0,
    bind_device: bool = False,
) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; raise on failure/timeout.

    ``bind_device``: the default group is created bound to the rank's GPU (``device_id=``).

    ``fn`` must be importable (module level) because the processes are started with ``spawn``.
    """
    with tempfile.TemporaryDirectory(prefix="thd-dist-") as tmp:
        init_method = f"file://{os.path.join(tmp, 'rendezvous')}"
        ctx = mp.start_processes(
            _entry,
            args=(fn, world_size, init_method, backend, max(30.0, timeout_s / 2), bind_device, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                for proc in ctx.processes:
                    if proc.is_alive():
                        proc.kill()
                raise TimeoutError(f"{world_size} spawned ranks did not finish within {timeout_s:.0f} s")
