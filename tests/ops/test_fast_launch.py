"""``thd._runtime.launcher``: cached kernel launches.

CPU tests drive the real ``JITFunction.run`` of the installed Triton with a stand-in driver and
compiler (kernels that record their launches instead of running), so the fast path is compared
with Triton's own binder, specialization and cache on many argument sets: it must pick the same
compiled kernel and pass the same arguments. They also cover the key (alignment, divisibility,
constexprs, options), the switches (``THD_FAST_LAUNCH=0``, the interpreter) and every fallback.
The ``gpu`` tests launch a real kernel through both paths and time them.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.compiler.compiler import CompiledKernel
from triton.runtime import jit as triton_jit

from tests._helpers import shortcut_agrees
from thd._runtime import launcher as fast_launch
from thd._runtime import tiles
from thd._runtime.launcher import KernelLauncher


def _scale(x_ptr, y_ptr, extra_ptr, n, stride, scale, flag, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    """``y[i] = x[i * stride] * scale + SHIFT`` for ``i < n`` (``extra_ptr``, ``flag``: key tests)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs * stride, mask=mask)
    tl.store(y_ptr + offs, x * scale + SHIFT, mask=mask)


# ----------------------------------------------------------------------------- a stand-in GPU


class _Driver:
    """What JITFunction.run and the fast path ask the active driver."""

    def __init__(self) -> None:
        self.device = 0

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device: int) -> int:
        return 7000 + device

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


class _DriverConfig:
    def __init__(self) -> None:
        self.active = _Driver()


class _Kernel(CompiledKernel):
    """A compiled kernel whose launcher records its calls."""

    def __init__(self, key: str, launches: list, fail: list) -> None:  # no super(): nothing compiled
        self.key = key
        self.module = object()  # handles "initialized"
        self._module_pid = None  # Triton 3.9's __del__ then unloads nothing
        self.function = 1000 + len(launches)
        self.packed_metadata = (4, 1, 0)
        self.src = None
        self.name = "fake"

        def launch(*args: object) -> None:
            if fail:
                raise RuntimeError("launch failed")
            launches.append((self, args))

        self._run = launch


class FakeGPU:
    def __init__(self, fn: Any, driver: _DriverConfig) -> None:
        self.fn = fn
        self.driver = driver
        self.launches: list[tuple[_Kernel, tuple]] = []
        self.compiled: list[str] = []
        self.fail_launch: list[bool] = []

        def compile_(key, signature, device, constexprs, options, attrs, warmup):  # type: ignore[no-untyped-def]
            kernel = _Kernel(key, self.launches, self.fail_launch)
            fn.device_caches[device][0][key] = kernel
            self.compiled.append(key)
            return kernel

        fn._do_compile = compile_

    def normal(self, grid: tuple, *args: object, **kwargs: object) -> tuple[_Kernel, tuple]:
        """Triton's own path: which kernel it launches and with which arguments."""
        kernel = self.fn[grid](*args, **kwargs)
        launched, call = self.launches[-1]
        assert launched is kernel
        return kernel, call


def _jit_classes() -> list[Any]:
    """``@triton.jit``'s class and, where this Triton has it, ``@gluon.jit``'s."""
    try:
        from triton.experimental.gluon._runtime import GluonJITFunction
    except ImportError:
        return [triton_jit.JITFunction]
    return [triton_jit.JITFunction, GluonJITFunction]


@pytest.fixture(params=_jit_classes(), ids=lambda cls: cls.__name__)
def fake_gpu(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[FakeGPU]:
    """The installed Triton's JITFunction.run on a stand-in driver; the fast path switched on; the
    kernel a ``@triton.jit`` and a ``@gluon.jit`` function (both launch through ``JITFunction.run``)."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when it is unset
    driver = _DriverConfig()
    monkeypatch.setattr(triton_jit, "driver", driver)
    state = fast_launch._Triton(force=False, verify_all=False)
    monkeypatch.setattr(fast_launch, "_state", state)
    monkeypatch.setattr(fast_launch, "_state_ready", True)
    yield FakeGPU(request.param(_scale), driver)


def _tensor(dtype: torch.dtype, offset: int, n: int = 64) -> torch.Tensor:
    return torch.zeros(n + 16, dtype=dtype)[offset : offset + n]


def _launched_args(call: tuple) -> tuple:
    """A launcher call without the launch metadata and hooks (the fast path passes None)."""
    return call[:6] + call[9:]


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(
        x is y or (type(x) is type(y) and x == y) for x, y in zip(a, b, strict=True)
    )


# ----------------------------------------------------------------------------- the key


def _values() -> list[object]:
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 1, -(2**31)]
    ints += [-(2**31) - 1, -(2**31) - 16, 2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 1]
    tensors = [
        _tensor(dtype, offset)
        for dtype in (torch.float16, torch.bfloat16, torch.float32)
        for offset in (0, 1, 4, 8)
    ]
    tensors += [torch.zeros(0), torch.nn.Parameter(torch.zeros(4))]
    return [*ints, *tensors, 0.0, 1.0, -2.5, True, False, None]


def test_arg_key_refines_triton_specialization() -> None:
    """Equal keys imply equal specializations by Triton's own native specializer (NVIDIA backend)."""
    from triton.backends.nvidia.compiler import CUDABackend

    specialize = triton_jit.native_specialize_impl
    values = _values()
    seen: dict[tuple, tuple] = {}
    for value in values:
        key = (type(value), fast_launch._make_arg_key((type(value),))(value))  # type: ignore[misc]
        spec = specialize(CUDABackend, value, False, True, True)
        assert seen.setdefault(key, spec) == spec, (value, key)
    # and the key tells apart what Triton tells apart, and a little more (never less)
    assert len(seen) >= len({specialize(CUDABackend, v, False, True, True) for v in values})


def test_arg_key_changes_with_alignment_divisibility_dtype_and_range() -> None:
    def key(*args: object) -> tuple:
        make = fast_launch._make_arg_key(tuple(map(type, args)))
        assert make is not None
        return (tuple(map(type, args)), make(*args))

    x = torch.zeros(64, dtype=torch.float16)
    assert key(x[8:]) == key(x) != key(x[1:])  # 16 bytes in: aligned; 2 bytes in: not
    assert key(x[1:]) == key(x[4:]) == key(x[3:])
    assert key(x) != key(x.to(torch.bfloat16))
    assert key(16) == key(32) != key(17) != key(1)
    assert key(1) != key(True) and key(1) != key(1.0) and key(17) == key(3)
    assert key(2**31 - 1) != key(2**31) != key(2**63)
    assert key(0.5) == key(2.0) and key(None) != key(0)
    assert fast_launch._make_arg_key((np.int64,)) is None  # other types take the normal path
    assert fast_launch._make_arg_key((tuple,)) is None


def test_key_changes_with_constexprs_options_debug_and_device(fake_gpu: FakeGPU) -> None:
    launcher = KernelLauncher(fake_gpu.fn)
    state = fast_launch._state
    assert state is not None
    x, y = _tensor(torch.float16, 0), _tensor(torch.float16, 0)
    args = (x, y, None, 64, 2, 1.5, False)
    base = {"BLOCK": 32, "SHIFT": 0, "num_warps": 4}
    key = launcher.key(state, 0, args, base)
    assert key is not None
    assert key == launcher.key(state, 0, (x, y, None, 48, 4, 2.5, True), base)  # same specialization
    others = [
        launcher.key(state, 0, args, {**base, "BLOCK": 64}),
        launcher.key(state, 0, args, {**base, "SHIFT": 1}),
        launcher.key(state, 0, args, {**base, "SHIFT": False}),  # equal to 0, another type
        launcher.key(state, 0, args, {**base, "num_warps": 8}),
        launcher.key(state, 0, args, {**base, "num_stages": 2}),
        launcher.key(state, 0, args, {**base, "debug": True}),
        launcher.key(state, 1, args, base),
        launcher.key(state, 0, (x[1:], *args[1:]), base),
        launcher.key(state, 0, (x, y, y, *args[3:]), base),
        launcher.key(state, 0, (x, y, None, 64, 1, 1.5, False), base),
        launcher.key(state, 0, (x, y, None, 63, 2, 1.5, False), base),
    ]
    assert None not in others and len({key, *others}) == len(others) + 1
    assert launcher.key(state, 0, args[:-1], base) is None  # arguments by keyword: normal path
    assert launcher.key(state, 0, (*args[:3], np.int64(64), *args[4:]), base) is None


# ----------------------------------------------------------------------------- against Triton


_OFFSETS = {True: [0, 8, 16], False: [1, 3, 4]}  # fp16 elements: 16-byte aligned or not
_INTS = {"one": [1], "d16": [16, 48, 64], "odd": [17, 33, 2], "i64": [2**31 + 16, 2**32]}


def _random_call(rng: np.random.Generator, configs: list[tuple]) -> tuple[tuple, tuple, dict]:
    """A call of one of ``configs`` (specialization classes) with fresh values inside each class."""
    dtype, x_aligned, y_aligned, extra, n_class, stride_class, block, shift, stages = configs[
        int(rng.integers(len(configs)))
    ]
    x = _tensor(dtype, int(rng.choice(_OFFSETS[x_aligned])))
    y = _tensor(dtype, int(rng.choice(_OFFSETS[y_aligned])))
    n, stride = (int(rng.choice(_INTS[c])) for c in (n_class, stride_class))
    kwargs = {"BLOCK": block, "SHIFT": shift, "num_warps": 4, **({"num_stages": stages} if stages else {})}
    args = (x, y, x if extra else None, n, stride, float(rng.random()), bool(rng.integers(2)))
    return (int(rng.integers(1, 5)), int(rng.integers(1, 3))), args, kwargs


def _configs(rng: np.random.Generator, count: int) -> list[tuple]:
    choices = (
        [torch.float16, torch.float32],
        [True, False],
        [True, False],
        [True, False],
        list(_INTS),
        list(_INTS),
        [16, 32],
        [0, 1],
        [None, 2],
    )
    return [tuple(c[int(rng.integers(len(c)))] for c in choices) for _ in range(count)]


def test_fast_path_launches_what_triton_launches(fake_gpu: FakeGPU) -> None:
    """Many random argument sets: the fast path picks Triton's kernel and passes its arguments."""
    launcher = KernelLauncher(fake_gpu.fn)
    rng = np.random.default_rng(0)
    configs = _configs(rng, 40)
    for _ in range(1000):
        grid, args, kwargs = _random_call(rng, configs)
        fake_gpu.driver.active.device = int(rng.integers(2))
        kernel, call = fake_gpu.normal(grid, *args, **kwargs)
        assert launcher.run(grid, *args, **kwargs) is kernel
        fast_kernel, fast_call = fake_gpu.launches[-1]
        assert fast_kernel is kernel
        assert _same(_launched_args(fast_call), _launched_args(call))
    assert launcher.fallbacks == 0
    assert launcher.fast_launches > 800  # the rest: first calls of a key
    assert launcher.normal_launches == len(launcher._cache)


def test_every_key_is_checked_against_triton_once(fake_gpu: FakeGPU, monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = KernelLauncher(fake_gpu.fn)
    checks: list[int] = []
    real = launcher._check

    def counting(*args: Any, **kwargs: Any) -> bool:
        checks.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(launcher, "_check", counting)
    x, y = _tensor(torch.float16, 0), _tensor(torch.float16, 0)
    for _ in range(5):
        launcher.run((1,), x, y, None, 64, 2, 1.0, False, BLOCK=32, SHIFT=0, num_warps=4)
    assert len(checks) == 2  # when cached, and at its first fast launch
    assert (launcher.normal_launches, launcher.fast_launches) == (1, 4)
    state = fast_launch._state
    assert state is not None
    monkeypatch.setattr(state, "verify_all", True)  # THD_FAST_LAUNCH=verify
    launcher.run((1,), x, y, None, 64, 2, 1.0, False, BLOCK=32, SHIFT=0, num_warps=4)
    assert len(checks) == 3


def test_triton_cache_mismatch_takes_the_normal_path(fake_gpu: FakeGPU) -> None:
    """If Triton's cache no longer holds the cached kernel for these arguments, never launch it."""
    launcher = KernelLauncher(fake_gpu.fn)
    x, y = _tensor(torch.float16, 0), _tensor(torch.float16, 0)
    args = (x, y, None, 64, 2, 1.0, False)
    first = launcher.run((1,), *args, BLOCK=32, SHIFT=0, num_warps=4)
    kernel_cache = fake_gpu.fn.device_caches[0][0]
    kernel_cache.clear()  # Triton recompiles: a new kernel object
    second = launcher.run((1,), *args, BLOCK=32, SHIFT=0, num_warps=4)
    assert second is not first and fake_gpu.launches[-1][0] is second
    assert launcher.fallbacks == 1 and launcher.fast_launches == 0
    launcher.run((1,), *args, BLOCK=32, SHIFT=0, num_warps=4)
    assert launcher.fast_launches == 0 and launcher.normal_launches == 3


def test_failed_fast_launch_falls_back_for_good(fake_gpu: FakeGPU) -> None:
    launcher = KernelLauncher(fake_gpu.fn)
    x, y = _tensor(torch.float16, 0), _tensor(torch.float16, 0)
    args = (x, y, None, 64, 2, 1.0, False)
    launcher.run((1,), *args, BLOCK=32, SHIFT=0, num_warps=4)
    fake_gpu.fail_launch.append(True)
    with pytest.raises(RuntimeError, match="launch failed"):  # the normal path raises it too
        launcher.run((1,), *args, BLOCK=32, SHIFT=0, num_warps=4)
    fake_gpu.fail_launch.clear()
    launcher.run((1,), *args, BLOCK=32, SHIFT=0, num_warps=4)
    assert (launcher.fallbacks, launcher.fast_launches, launcher.normal_launches) == (1, 0, 3)
    assert len(fake_gpu.launches) == 2  # the failed launch launched nothing, then one normal launch


@pytest.mark.parametrize("what", ["enter_hook", "exit_hook", "pre_run_hook", "instrumentation", "global"])
def test_hooks_and_instrumentation_take_the_normal_path(
    fake_gpu: FakeGPU, monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    from triton import knobs

    launcher = KernelLauncher(fake_gpu.fn)
    x, y = _tensor(torch.float16, 0), _tensor(torch.float16, 0)
    args = (x, y, None, 64, 2, 1.0, False)
    for _ in range(2):
        launcher.run((1,), *args, BLOCK=32, SHIFT=0, num_warps=4)
    assert launcher.fast_launches == 1
    seen: list[object] = []
    hook = lambda metadata: seen.append(metadata)
    if what == "enter_hook":
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    elif what == "exit_hook":
        monkeypatch.setattr(knobs.runtime, "launch_exit_hook", hook)
    elif what == "pre_run_hook":
        fake_gpu.fn.add_pre_run_hook(lambda *a, **k: seen.append(a))
    elif what == "instrumentation":
        monkeypatch.setattr(knobs.compilation, "instrumentation_mode", "consan")
    else:  # a global the kernel uses changed: the normal path raises about it
        fake_gpu.fn.used_global_vals[("SOME_GLOBAL", 0)] = (1, {"SOME_GLOBAL": 2})
    try:
        launcher.run((1,), *args, BLOCK=32, SHIFT=0, num_warps=4)
    except RuntimeError as error:
        assert what in ("global", "instrumentation"), error
    assert launcher.fast_launches == 1
    if what == "pre_run_hook":
        assert seen
    elif what.endswith("_hook"):  # the normal path hands the hook to the launcher (which calls it)
        assert fake_gpu.launches[-1][1][7 if what == "enter_hook" else 8] is hook


# ----------------------------------------------------------------------------- run_fixed


def test_run_fixed_launches_what_triton_launches(fake_gpu: FakeGPU) -> None:
    """One token per (grid, tail, keywords); heads of changing dtype and alignment, a tail tensor
    whose alignment changes in place: every launch picks Triton's kernel and passes its arguments."""
    launcher = KernelLauncher(fake_gpu.fn)
    rng = np.random.default_rng(1)
    configs = _configs(rng, 30)
    fixed: dict[tuple, tuple] = {}  # the caller's side: one token and tail per config and grid
    for _ in range(600):
        grid, args, kwargs = _random_call(rng, configs)
        tail_key = (grid, args[0].dtype, args[2] is None, tuple(kwargs.items()))  # the first call's
        token, tail, kw = fixed.setdefault(tail_key, (object(), args[1:], kwargs))  # tail, kept
        head = args[:1]
        if rng.random() < 0.3:  # y, a tail tensor, moved in place: the key sees its alignment
            tail[0].set_(_tensor(tail[0].dtype, int(rng.choice([0, 1, 8, 3]))))
        fake_gpu.driver.active.device = int(rng.integers(2))
        kernel, call = fake_gpu.normal(grid, *head, *tail, **kw)
        assert launcher.run_fixed(token, grid, head, tail, kw) is kernel
        fast_kernel, fast_call = fake_gpu.launches[-1]
        assert fast_kernel is kernel and _same(_launched_args(fast_call), _launched_args(call))
    assert launcher.fallbacks == 0 and launcher.fast_launches > 400 and len(fixed) < 200


def test_run_fixed_keys_a_repeated_tail_tensor(fake_gpu: FakeGPU) -> None:
    """A tail holding one tensor twice (as a plan's offsets fill several layout slots) is keyed by
    that tensor: moved in place to another alignment, the launch still matches Triton's."""
    launcher = KernelLauncher(fake_gpu.fn)
    x, y = _tensor(torch.float16, 0), _tensor(torch.float16, 0)
    token, tail, kw = object(), (y, y, 64, 2, 1.0, False), {"BLOCK": 32, "SHIFT": 0, "num_warps": 4}
    for offset in (0, 0, 3, 3, 8, 1):
        y.set_(_tensor(torch.float16, offset))
        kernel, call = fake_gpu.normal((1,), x, *tail, **kw)
        assert launcher.run_fixed(token, (1,), (x,), tail, kw) is kernel
        fast_kernel, fast_call = fake_gpu.launches[-1]
        assert fast_kernel is kernel and _same(_launched_args(fast_call), _launched_args(call))
    assert len({k.key for k, _ in fake_gpu.launches}) == 2  # aligned and misaligned y: two kernels
    assert launcher.fallbacks == 0 and launcher.fast_launches >= 3


def test_run_fixed_takes_the_normal_path_when_run_would(
    fake_gpu: FakeGPU, monkeypatch: pytest.MonkeyPatch
) -> None:
    from triton import knobs

    launcher = KernelLauncher(fake_gpu.fn)
    x, y = _tensor(torch.float16, 0), _tensor(torch.float16, 0)
    token, tail, kw = object(), (None, 64, 2, 1.0, False), {"BLOCK": 32, "SHIFT": 0, "num_warps": 4}
    for _ in range(2):
        launcher.run_fixed(token, (1,), (x, y), tail, kw)
    assert (launcher.normal_launches, launcher.fast_launches) == (1, 1)
    hook, previous = (lambda metadata: None), knobs.runtime.launch_enter_hook
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    launcher.run_fixed(token, (1,), (x, y), tail, kw)
    assert launcher.fast_launches == 1 and fake_gpu.launches[-1][1][7] is hook  # the normal path ran
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", previous)
    launcher.run_fixed(token, (1,), (x, y), tail, {**kw})  # other keywords: first seen, through run()
    assert launcher.fast_launches == 2  # run() found the key cached
    fake_gpu.fail_launch.append(True)
    with pytest.raises(RuntimeError, match="launch failed"):
        launcher.run_fixed(token, (1,), (x, y), tail, kw)
    fake_gpu.fail_launch.clear()
    launcher.run((1,), x, y, *tail, **kw)  # the key failed a fast launch: the normal path for run() too
    launcher.run_fixed(token, (1,), (x, y), tail, kw)
    assert launcher.fallbacks == 1 and launcher.fast_launches == 2
    launcher.run_fixed(token, (1,), (x, y, None), tail[1:], kw)  # a head that is not all tensors
    assert launcher.fast_launches == 2


def test_profile_allocator_takes_the_normal_path(fake_gpu: FakeGPU) -> None:
    from triton.runtime import _allocation

    launcher = KernelLauncher(fake_gpu.fn)
    x, y = _tensor(torch.float16, 0), _tensor(torch.float16, 0)
    previous = _allocation._profile_allocator.get()
    _allocation._profile_allocator.set(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
    try:
        for _ in range(2):
            launcher.run((1,), x, y, None, 64, 2, 1.0, False, BLOCK=32, SHIFT=0, num_warps=4)
    finally:
        _allocation._profile_allocator.set(previous)
    assert launcher.fast_launches == 0


class _Int(int):
    pass


def test_unsupported_calls_take_the_normal_path(fake_gpu: FakeGPU) -> None:
    launcher = KernelLauncher(fake_gpu.fn)
    x, y = _tensor(torch.float16, 0), _tensor(torch.float16, 0)
    for _ in range(2):
        launcher.run(lambda meta: (1,), x, y, None, 64, 2, 1.0, False, BLOCK=32, SHIFT=0)  # callable grid
        launcher.run([1], x, y, None, 64, 2, 1.0, False, BLOCK=32, SHIFT=0)  # grid not a tuple
        launcher.run((1,), x, y, None, _Int(64), 2, 1.0, False, BLOCK=32, SHIFT=0)  # an int subclass
        launcher.run((1,), x, y, None, 64, 2, 1.0, flag=False, BLOCK=32, SHIFT=0)  # by keyword
    assert launcher.fast_launches == 0 and launcher.normal_launches == 8 and not launcher._cache


def test_kernel_with_constexpr_default_left_out_launches_what_triton_launches(fake_gpu: FakeGPU) -> None:
    """A constexpr left to its default is passed as Triton's binder passes it (until the
    twenty-second session such a key took the normal path on every launch: the Gluon backward's
    work list left ``SEQUENCE_MAJOR`` out); one without a default left out takes the normal path."""

    def with_default(x_ptr, n, BLOCK: tl.constexpr, SHIFT: tl.constexpr = 3):  # type: ignore[no-untyped-def]
        tl.store(x_ptr + tl.arange(0, BLOCK), SHIFT)

    fn = triton_jit.JITFunction(with_default)
    gpu = FakeGPU(fn, fake_gpu.driver)
    launcher = KernelLauncher(fn)
    x = _tensor(torch.float32, 0)
    for kwargs in ({"BLOCK": 16}, {"BLOCK": 16, "SHIFT": 3}, {"BLOCK": 16, "SHIFT": 5}):
        kernel, call = gpu.normal((1,), x, 64, **kwargs)
        for _ in range(3):
            assert launcher.run((1,), x, 64, **kwargs) is kernel
            fast_kernel, fast_call = gpu.launches[-1]
            assert fast_kernel is kernel
            assert _same(_launched_args(fast_call), _launched_args(call))
    assert launcher.fallbacks == 0 and launcher.fast_launches == 6 and launcher.normal_launches == 3
    with pytest.raises(TypeError):  # BLOCK has no default: Triton's own error, by the normal path
        launcher.run((1,), x, 64, SHIFT=3)
    assert launcher.fast_launches == 6 and launcher.normal_launches == 4


def test_switch_and_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fast_launch, "_state", fast_launch._state)  # restored afterwards
    monkeypatch.setattr(fast_launch, "_state_ready", False)
    monkeypatch.setenv("THD_FAST_LAUNCH", "0")
    assert not fast_launch.enabled()
    monkeypatch.setattr(fast_launch, "_state_ready", False)
    monkeypatch.setenv("THD_FAST_LAUNCH", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not fast_launch.enabled()
    monkeypatch.setattr(fast_launch, "_state_ready", False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reviewed = triton.__version__.split("+")[0] in fast_launch.REVIEWED_TRITON_VERSIONS
    assert fast_launch.enabled() == reviewed
    monkeypatch.setattr(fast_launch, "_state_ready", False)
    monkeypatch.delenv("THD_FAST_LAUNCH")  # unset: on by default
    assert fast_launch.enabled() == reviewed
    monkeypatch.setattr(fast_launch, "_state_ready", False)  # the next launch reads them again


def test_disabled_switch_takes_the_normal_path(fake_gpu: FakeGPU, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THD_FAST_LAUNCH", "0")
    fast_launch.reload_settings()
    launcher = KernelLauncher(fake_gpu.fn)
    x, y = _tensor(torch.float16, 0), _tensor(torch.float16, 0)
    for _ in range(3):
        launcher.run((1,), x, y, None, 64, 2, 1.0, False, BLOCK=32, SHIFT=0)
    assert launcher.fast_launches == 0 and len(fake_gpu.launches) == 3


def test_unreviewed_triton_needs_force(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton, "__version__", "3.99.0")
    with pytest.raises(RuntimeError, match="not one of"):
        fast_launch._Triton(force=False, verify_all=False)
    assert fast_launch._Triton(force=True, verify_all=False).version == "3.99.0"


def test_changed_jit_run_disables(monkeypatch: pytest.MonkeyPatch) -> None:
    def run(self, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]
        return None

    monkeypatch.setattr(triton_jit.JITFunction, "run", run)
    with pytest.raises(RuntimeError, match="lacks"):
        fast_launch._Triton(force=True, verify_all=False)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_interpreted_kernel_runs_through_the_normal_path() -> None:
    fast_launch.reload_settings()
    launcher = KernelLauncher(triton.jit(_scale))
    x = torch.arange(64, dtype=torch.float32)
    for stride, n in ((1, 64), (2, 32), (1, 17)):
        y = torch.zeros(64)
        launcher.run((triton.cdiv(n, 16),), x, y, None, n, stride, 2.0, False, BLOCK=16, SHIFT=1)
        want = torch.zeros(64)
        want[:n] = x[: n * stride : stride] * 2 + 1
        assert torch.equal(y, want)
    assert launcher.fast_launches == 0 and launcher.normal_launches == 3


# ----------------------------------------------------------------------------- on a GPU


@pytest.fixture
def verify_every_launch(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("THD_FAST_LAUNCH", "verify")
    fast_launch.reload_settings()
    yield
    monkeypatch.undo()
    fast_launch.reload_settings()


@pytest.mark.gpu
def test_gpu_fast_path_matches_normal_path(verify_every_launch: None) -> None:
    fn = triton.jit(_scale)
    launcher = KernelLauncher(fn)
    assert fast_launch.enabled(), f"fast path off with Triton {triton.__version__}"
    buffer = torch.randn(1024 * 16 + 64, device="cuda", dtype=torch.float16)
    sizes = [1, 15, 16, 17, 64, 100, 1024]
    for round_, (offset, n, stride, dtype) in enumerate(
        itertools.product([0, 1, 3, 8], sizes, [1, 2, 16], [torch.float16, torch.float32])
    ):
        x = buffer.to(dtype)[offset:]
        extra = None if round_ % 2 else x
        grid = (triton.cdiv(n, 32),)
        args = (n, stride, 0.5 + round_ % 3, bool(round_ % 2))
        for _ in range(3):
            # y aligned or not (one element in), the same for both paths
            y_fast, y_ref = (torch.full((n + 8,), float("nan"), device="cuda", dtype=dtype) for _ in "ab")
            y_fast, y_ref = y_fast[round_ % 2 :], y_ref[round_ % 2 :]
            assert y_fast.data_ptr() % 16 == y_ref.data_ptr() % 16
            kernel = launcher.run(grid, x, y_fast, extra, *args, BLOCK=32, SHIFT=1, num_warps=4)
            assert kernel is fn[grid](x, y_ref, extra, *args, BLOCK=32, SHIFT=1, num_warps=4)
            torch.testing.assert_close(y_fast, y_ref, atol=0, rtol=0, equal_nan=True)
            want = x[: n * stride : stride][:n].float() * args[2] + 1
            torch.testing.assert_close(y_fast[:n].float(), want, atol=1e-2, rtol=1e-2)
    assert launcher.fallbacks == 0
    assert launcher.fast_launches >= 2 * launcher.normal_launches
    torch.cuda.synchronize()


def _wide(  # a kernel with as many arguments as the attention kernels
    q, k, v, o, lse, s, c0, c1, c2, c3, p0, p1,
    r0, r1, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15,
    f0, f1, w0, w1, bucket,
    K0: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr, K4: tl.constexpr,
    K5: tl.constexpr, K6: tl.constexpr, K7: tl.constexpr, K8: tl.constexpr, K9: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    offs = tl.arange(0, BLOCK_M)
    tl.store(o + offs, tl.load(q + offs) * f0)


@pytest.mark.gpu
def test_gpu_host_time_per_launch() -> None:
    if os.environ.get("THD_FAST_LAUNCH") == "verify":
        pytest.skip("THD_FAST_LAUNCH=verify checks every cached launch: no host time to compare")
    fast_launch.reload_settings()
    assert fast_launch.enabled(), f"fast path off with Triton {triton.__version__} (or THD_FAST_LAUNCH=0)"
    fn = triton.jit(_wide)
    launcher = KernelLauncher(fn)
    t = [torch.randn(128, device="cuda", dtype=torch.bfloat16) for _ in range(6)]
    cu = [torch.zeros(8, device="cuda", dtype=torch.int32) for _ in range(6)]
    ints = [128, 128, *[64 * (i + 1) for i in range(16)]]
    args = (*t, *cu, *ints, 0.125, 1.0, 0, 0, 64)
    flags = {f"K{i}": i % 2 == 0 for i in range(10)}
    kwargs = {**flags, "BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}

    def normal() -> None:
        fn[(4, 2, 3)](*args, **kwargs)

    def fast() -> None:
        launcher.run((4, 2, 3), *args, **kwargs)

    def per_launch(launch: Any, n: int = 2000) -> float:
        for _ in range(50):
            launch()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(n):
                launch()
            best = min(best, (time.perf_counter() - start) / n)
            torch.cuda.synchronize()
        return best * 1e6

    normal_us, fast_us = per_launch(normal), per_launch(fast)
    what = f"{len(args)} arguments + {len(kwargs)} keywords"
    print(f"\nhost time per launch, {what}: normal {normal_us:.2f} us, fast {fast_us:.2f} us")
    assert launcher.fallbacks == 0 and launcher.fast_launches > 0
    assert fast_us <= normal_us


def test_attention_kernels_launch_through_the_fast_path(
    fake_gpu: FakeGPU, monkeypatch: pytest.MonkeyPatch
) -> None:
    """launch.py's launches (once it routes them through KernelLauncher) take the fast path with
    the attention kernels' real signatures, every launch checked against Triton's binder/cache,
    with new offsets tensors each call, 16-byte aligned or not (a plan serves both: the launcher
    keys their alignment)."""
    from thd.ops.attention import launch
    from thd.ops.attention.params import (
        AttentionOptions,
        BackwardCall,
        ForwardCall,
        SavedForBackward,
        VarlenLayout,
    )

    if not hasattr(launch, "LAUNCHERS"):
        pytest.skip("launch.py does not route its launches through fast_launch (/tmp/fast_launch.patch)")
    state = fast_launch._state
    assert state is not None
    monkeypatch.setattr(state, "verify_all", True)
    monkeypatch.setattr(tiles, "tma_capable", lambda *tensors: False)  # asks the CUDA device

    def jit(kernel: Any) -> Any:  # the JITFunction of a kernel (an interpreted one under the interpreter)
        fn = kernel if type(kernel) is triton_jit.JITFunction else triton_jit.JITFunction(kernel.fn)
        FakeGPU(fn, fake_gpu.driver)
        return fn

    launchers = {name: KernelLauncher(jit(launcher.fn)) for name, launcher in launch.LAUNCHERS.items()}
    monkeypatch.setattr(launch, "LAUNCHERS", launchers)
    launch.clear_plans()

    def offsets(values: list[int], shift: int) -> torch.Tensor:  # 16-byte aligned without a shift
        return torch.tensor([0] * shift + values, dtype=torch.int32)[shift:]

    for options in (AttentionOptions(0.125, causal=True), AttentionOptions(0.125, False, (4, -1), 2.0, True)):
        for shift in (0, 1, 0, 1, 0):
            cu, cup = offsets([0, 5, 12], shift), offsets([0, 8, 16], shift)
            layout = VarlenLayout(cu, cu, cup, cup, 7, 7)
            q, k, v = torch.randn(16, 4, 32), torch.randn(16, 2, 32), torch.randn(16, 2, 32)
            out, lse = launch.forward(ForwardCall(q, k, v, layout, options))
            saved = SavedForBackward(q, k, v, out, lse)
            launch.backward(BackwardCall(torch.randn_like(out), saved, layout, options))
    used = list(launchers.values())
    assert all(launcher.fallbacks == 0 for launcher in used), used
    assert all(launcher.fast_launches >= 2 for launcher in used if launcher.normal_launches), used
    assert all(launcher.normal_launches >= 2 for launcher in used), used  # both alignments compiled
    assert launch.plan_counts() == (2, 2)
    launch.clear_plans()


def _check_fast_path_bits(monkeypatch: pytest.MonkeyPatch, launchers: list[KernelLauncher]) -> None:
    """``thd.attention`` forward and backward (deterministic) three times with cached launches
    (``THD_FAST_LAUNCH=verify``) and once without: the same bits, and the uncached call makes no
    fast launch on ``launchers``. Undoes ``monkeypatch`` (and what the caller set with it)."""
    import thd

    cu = torch.tensor([0, 100, 180, 300], dtype=torch.int32, device="cuda")
    cup = torch.tensor([0, 128, 256, 384], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(384, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = torch.randn(2, 384, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    do = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    kw = {"cu_seqlens_q_padded": cup, "cu_seqlens_kv_padded": cup, "max_seqlen_q": 120, "max_seqlen_kv": 120}

    def run() -> list[torch.Tensor]:
        # New offset tensors each call, as a data loader passes them: nothing cached per layout
        # (the Gluon forward's work list) spares a launch, so every kernel launches each call.
        fresh = {**kw, "cu_seqlens_q_padded": cup.clone(), "cu_seqlens_kv_padded": cup.clone()}
        offsets = cu.clone()
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = thd.attention(*leaves, offsets, offsets, causal=True, deterministic=True, **fresh)
        out.backward(do)
        return [out.detach(), *(t.grad for t in leaves)]  # type: ignore[misc]

    try:
        monkeypatch.setenv("THD_FAST_LAUNCH", "verify")
        fast_launch.reload_settings()
        assert fast_launch.enabled(), f"fast path off with Triton {triton.__version__}"
        fast = [run() for _ in range(3)]
        monkeypatch.setenv("THD_FAST_LAUNCH", "0")
        fast_launch.reload_settings()
        before = [launcher.fast_launches for launcher in launchers]
        normal = run()
        assert [launcher.fast_launches for launcher in launchers] == before
    finally:
        monkeypatch.undo()
        fast_launch.reload_settings()
    for result in fast:
        for got, want in zip(result, normal, strict=True):
            assert torch.equal(got, want)


def _launched_kernels() -> dict[str, Any]:
    """Every kernel thd launches through :func:`thd._runtime.launcher.launcher_for` or
    ``launch.LAUNCHERS``, by name (the tl attention kernels, the Gluon family's, the other ops')."""
    from thd.ops.attention import launch
    from thd.ops.lse_merge.kernels import _lse_merge_fwd_kernel
    from thd.ops.ring_plan.kernels import _ring_plan_kernel
    from thd.ops.zero_padding.kernels import _zero_padding_fwd_kernel

    kernels = {name: launcher.fn for name, launcher in launch.LAUNCHERS.items()}
    kernels.update(
        lse_merge=_lse_merge_fwd_kernel, ring_plan=_ring_plan_kernel, zero_padding=_zero_padding_fwd_kernel
    )
    try:
        from thd.ops.attention.gluon import backward_kernel, forward_kernel, schedule
    except ImportError:  # a Triton without Gluon's Hopper surface: no Gluon kernels to launch
        return kernels
    kernels.update(
        build_work_list=schedule.build_work_list,
        gluon_forward=forward_kernel.attention_fwd_kernel,
        gluon_preprocess=backward_kernel._preprocess_kernel,
        gluon_dkdv=backward_kernel._dkdv_kernel,
        gluon_dq=backward_kernel._dq_kernel,
    )
    return kernels


def test_every_launched_kernel_takes_its_plain_parameters_first() -> None:
    """The cached path passes a launch's plain (non-constexpr) arguments positionally, so it takes
    only kernels whose plain parameters all come before their constexprs; a kernel with one after
    them runs every launch through Triton's slower normal path, as the Gluon forward did with its
    ``prof_ptr`` from 8321f57 to 07562c0 (fast=0 on the GPU)."""
    for name, kernel in _launched_kernels().items():
        fn = kernel if hasattr(kernel, "params") else triton_jit.JITFunction(kernel.fn)  # interpreted
        flags = [param.is_constexpr for param in fn.params]
        plain = flags.count(False)
        assert not any(flags[:plain]), f"{name}: a constexpr among its first {plain} parameters"
        late = [param.name for param in fn.params[plain:] if not param.is_constexpr]
        assert not late, f"{name}: plain parameters after its constexprs: {late}"


@pytest.mark.gpu
def test_gpu_attention_through_fast_path_matches_normal_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """thd.attention forward and backward: the same bits with cached launches as without."""
    from thd.ops.attention import launch

    if not hasattr(launch, "LAUNCHERS"):
        pytest.skip("launch.py does not route its launches through fast_launch (/tmp/fast_launch.patch)")
    launchers = list(launch.LAUNCHERS.values())  # the attention kernels and the preprocess
    _check_fast_path_bits(monkeypatch, launchers)
    used = [launcher for launcher in launchers if launcher.normal_launches]
    assert all(launcher.fallbacks == 0 and launcher.fast_launches >= 2 for launcher in used), used


@pytest.mark.gpu
def test_gpu_gluon_attention_through_fast_path_matches_normal_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Gluon family's launches (work list, forward, preprocess, dK/dV, dQ) through the cached
    path: the same bits as through ``fn[grid]``, every launch after the first of a key cached."""
    from thd._runtime.launcher import launcher_for

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels need an sm_90 GPU")
    from thd.ops.attention.gluon import backward_kernel, forward_kernel, schedule

    kernels = (
        schedule.build_work_list,
        forward_kernel.attention_fwd_kernel,
        backward_kernel._preprocess_kernel,
        backward_kernel._dkdv_kernel,
        backward_kernel._dq_kernel,
    )
    launchers = [launcher_for(kernel) for kernel in kernels]
    monkeypatch.setenv("THD_KERNELS", "gluon")
    _check_fast_path_bits(monkeypatch, launchers)
    assert all(launcher.fallbacks == 0 and launcher.fast_launches >= 2 for launcher in launchers), launchers


# ----------------------------------------------------------------------------- wrapper shortcuts
# interface.py / arguments.py answer the common call with a few comparisons; these tests check
# the shortcuts against the full checks they skip.


def test_resolve_options_shortcut_equals_the_checks() -> None:
    from thd.errors import ThdError
    from thd.ops.attention.arguments import resolve_options

    q = torch.zeros(4, 2, 64)
    scales = [None, 0.1, 1, -0.5, 0.0, float("inf"), float("nan"), True, np.float64(0.2), "x"]
    caps = [0.0, 0, 3, 2.5, -1.0, -0.0, float("inf"), float("nan"), False, np.float32(1.0), None]
    windows = [(-1, -1), (4, 0), (0, 3), (-2, 0), (3, -2), (True, 0), (2.0, 1), (np.int64(4), 0), (1, 2, 3)]
    for scale, cap, window, causal, deterministic in itertools.product(
        scales, caps, windows, [False, True, 0, 1], [False, True]
    ):
        args = (q, causal, scale, window, cap, deterministic)
        slow = (q, causal, scale, list(window), cap, deterministic)  # a list takes the full checks
        try:
            want: object = resolve_options("f", *slow)
        except ThdError as error:
            want = (type(error), str(error).replace(str(list(window)), str(window)))
        try:
            got: object = resolve_options("f", *args)
        except ThdError as error:
            got = (type(error), str(error))
        if isinstance(want, tuple):
            assert isinstance(got, tuple) and got[0] is want[0], (args, got, want)
        else:
            assert got == want and type(got.softmax_scale) is float and type(got.softcap) is float, args  # type: ignore[union-attr]


def test_check_call_shortcut_never_passes_what_the_checks_reject(monkeypatch: pytest.MonkeyPatch) -> None:
    from thd.errors import ThdError
    from thd.ops.attention import arguments
    from thd.ops.attention.params import AttentionOptions, VarlenLayout

    i32 = torch.int32
    cu = torch.tensor([0, 3, 8], dtype=i32)
    base: dict[str, Any] = {
        "q": torch.zeros(8, 4, 64),
        "k": torch.zeros(8, 2, 64),
        "v": torch.zeros(8, 2, 32),
        "cu_q": cu,
        "cu_kv": cu,
        "cup_q": None,
        "cup_kv": None,
        "max_q": 5,
        "max_kv": None,
        "sinks": None,
        "pos": None,
    }
    variants: dict[str, list[Any]] = {
        "q": [torch.zeros(8, 4, 64, dtype=torch.float64), torch.zeros(8, 3, 64), torch.zeros(8, 4, 60),
              torch.zeros(8, 4), torch.zeros(8, 4, 64, dtype=torch.bfloat16),
              torch.zeros(8, 4, 64, device="meta"), torch.zeros(8, 4, 264), np.zeros((8, 4, 64))],
        "k": [torch.zeros(7, 2, 64), torch.zeros(8, 0, 64), torch.zeros(8, 2, 32),
              torch.zeros(8, 2, 64, dtype=torch.half)],
        "v": [torch.zeros(8, 2, 4), torch.zeros(8, 1, 32), torch.zeros(8, 2, 264),
              torch.zeros(8, 2, 32, device="meta")],
        "cu_q": [cu.long(), cu[None], torch.zeros(0, dtype=i32), cu.to("meta"), [0, 3, 8]],
        "cu_kv": [torch.tensor([0, 8], dtype=i32), cu.float(), cu.to("meta")],
        "cup_q": [cu, torch.tensor([0, 4], dtype=i32), cu.long(), cu.to("meta"), (0, 4, 8)],
        "cup_kv": [cu, cu[None], cu.to("meta")],
        "max_q": [None, 0, -1, 2**31, True, 3.0, np.int32(3)],
        "max_kv": [7, 2**31 - 1, 2**31, "7"],
        "sinks": [torch.zeros(4), torch.zeros(2), torch.zeros(4, dtype=torch.float64), torch.zeros(1, 4),
                  torch.zeros(4, device="meta"), torch.zeros(4, dtype=torch.half), 1.0],
        "pos": [torch.zeros(2, dtype=i32)],
    }  # fmt: skip

    def check(case: dict[str, Any], shortcut: bool) -> object:
        layout = VarlenLayout(
            case["cu_q"], case["cu_kv"], case["cup_q"], case["cup_kv"], case["max_q"], case["max_kv"],
            case["pos"], case["pos"],
        )  # fmt: skip
        with monkeypatch.context() as patch:
            if not shortcut:
                patch.setattr(arguments, "passes_call_checks", lambda *args: False)
            try:
                arguments.check_call(
                    "f", case["q"], case["k"], case["v"], layout, AttentionOptions(0.1), case["sinks"]
                )
            except (ThdError, AttributeError, TypeError) as error:
                return (type(error), str(error))
        return None

    cases = [base] + [{**base, name: value} for name, values in variants.items() for value in values]
    cases += [{**base, "cup_q": cu, "cup_kv": cu, "sinks": torch.zeros(4), "max_kv": 8}]
    assert shortcut_agrees(cases, check) >= 8  # the shortcut's cases are among them
    assert arguments.passes_call_checks(
        base["q"], base["k"], base["v"], VarlenLayout(cu, cu, max_seqlen_q=5), None
    )


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "grad_without_leaves", "forward_ad"])
def test_attention_without_gradients_skips_the_function(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.autograd.forward_ad as fwad

    import thd
    from thd.ops.attention import interface

    applied: list[int] = []
    real_apply = interface.AttentionFunction.apply
    monkeypatch.setattr(interface.AttentionFunction, "apply", lambda *a: applied.append(1) or real_apply(*a))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q, k, v = torch.randn(8, 2, 16), torch.randn(8, 1, 16), torch.randn(8, 1, 16)
    want = thd.attention(q, k, v, cu, cu, causal=True, return_lse=True)
    assert applied == [1]  # grad mode on: through the Function, as before
    if mode == "no_grad":
        with torch.no_grad():
            got = thd.attention(q, k, v, cu, cu, causal=True, return_lse=True)
    elif mode == "inference_mode":
        with torch.inference_mode():
            got = thd.attention(q, k, v, cu, cu, causal=True, return_lse=True)
    elif mode == "grad_without_leaves":
        got = thd.attention(q, k, v, cu, cu, causal=True, return_lse=True)
    else:  # forward AD under no_grad: the Function still decides (it has no jvp)
        with torch.no_grad(), fwad.dual_level():
            dual = fwad.make_dual(q, torch.ones_like(q))
            with pytest.raises(RuntimeError):
                thd.attention(dual, k, v, cu, cu, causal=True)
        assert applied == [1, 1]
        return
    assert applied == ([1] if mode != "grad_without_leaves" else [1, 1])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b) and not a.requires_grad
