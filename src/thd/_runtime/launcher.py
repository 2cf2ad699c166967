"""Cached launches of ``@triton.jit`` (and ``@gluon.jit``) kernels: Triton's per-launch Python path,
paid once per key.

``fn[grid](*args, **kwargs)`` runs ``JITFunction.run`` on every launch: it binds the ~40
arguments, specializes each one (native code, but through a generated Python binder), builds
and hashes Triton's cache key (including ``str(options)``), checks globals, builds the launch
metadata and calls the launcher. :class:`KernelLauncher` keeps the launch but replaces the rest
on a cache hit with one cheap key of its own:

- the first call with a key goes through the normal path, which compiles (or finds) the kernel,
  launches it and returns the compiled kernel; the launcher checks, with Triton's own binder and
  cache-key function, that Triton's cache holds exactly that kernel for these arguments (and that
  its bound arguments are the ones the fast path passes, in order), and caches it; the check
  runs once more at the key's first fast launch (other argument values of the same key);
- a later call with the same key calls the compiled kernel's launcher (``CompiledKernel.run``)
  directly, with the arguments ``JITFunction.run`` passes it: grid, current stream, function
  handle, packed metadata, no launch metadata or hooks (only taken when none is active), then
  every bound argument in signature order (constexprs included, a constexpr left out with its
  default value as Triton's binder binds it: Triton 3.6's launcher parses them and ignores them,
  3.9's drops them by its annotations). Scratch memory (device-side tensor
  descriptors' global scratch through ``triton.set_allocator``'s context variable, the profile
  scratch) is allocated inside that launcher, exactly as on the normal path.

:meth:`KernelLauncher.run_fixed` is the same launch for a caller whose grid, trailing arguments
and keywords are fixed per token (a cached plan's): it keys the cached kernel by the token, the
leading tensors' types and every tensor's dtype and alignment (and the device and debug flag), not
by the whole argument list; its first launch of each such key goes through :meth:`~KernelLauncher.run`.

The key refines everything Triton specializes on (read from Triton 3.6.0 and 3.9.0): the types
of the arguments, each tensor's dtype and 16-byte alignment, each int's equality to 1,
divisibility by 16 and range (i32/i64/u64), every keyword value with its type (constexprs and
options such as ``num_warps``/``num_stages``), the effective ``debug`` flag and the current
device. The stream is not specialized on; the current one is read at every launch.

Everything else takes the normal path, every time: the interpreter (``TRITON_INTERPRET=1``),
``THD_FAST_LAUNCH=0``, a Triton whose internals do not match what this module was written
against (versions other than 3.6.0 and 3.9.0 unless ``THD_FAST_LAUNCH=force``; in any version
``JITFunction.run`` must contain the statements this module replaces), an active launch hook,
profile allocator, instrumentation mode, pre-run hook or stage-inspection hook, a changed global
the kernel uses, a callable grid, keyword arguments in place of positional ones, and arguments
of any type but tensor, int, float, bool and None. A key whose check fails, or whose fast
launch raises (which happens before the kernel is enqueued: argument parsing, pointer checks,
scratch allocation, the launch call itself), takes the normal path from then on.
``THD_FAST_LAUNCH``: unset or ``1`` on (where the above allows; checked against Triton's own launches
on an H200 with Triton 3.6), ``0`` off, ``verify`` on and
checking every fast launch against Triton's cache (tests, debugging), ``force`` on with an
unreviewed Triton whose ``JITFunction.run`` still matches. Read at the first launch;
:func:`reload_settings` reads it again.
"""

from __future__ import annotations

import functools
import inspect
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from thd._runtime import config

__all__ = ["KernelLauncher", "enabled", "ensure_scratch_allocator", "launcher_for", "reload_settings"]

REVIEWED_TRITON_VERSIONS = ("3.6.0", "3.9.0")
"""Triton releases whose ``JITFunction.run``, ``CompiledKernel`` and CUDA launcher were read."""

# Statements of JITFunction.run this module replaces or relies on (whitespace-normalized).
_RUN_FINGERPRINT = (
    "device = driver.active.get_current_device()",
    "stream = driver.active.get_current_stream(device)",
    "for hook in self.pre_run_hooks:",
    "kernel_cache, kernel_key_cache, target, backend, binder = self.device_caches[device]",
    "bound_args, specialization, options = binder(*args, **kwargs)",
    "key = compute_cache_key(kernel_key_cache, specialization, options)",
    "kernel = kernel_cache.get(key, None)",
    "for (name, _), (val, globals_dict) in self.used_global_vals.items():",
    "grid_0 = grid[0]",
    "grid_1 = grid[1] if grid_size > 1 else 1",
    "grid_2 = grid[2] if grid_size > 2 else 1",
    "launch_metadata = kernel.launch_metadata(grid, stream, *bound_args.values())",
    "kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata,"
    " knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound_args.values())",
    "return kernel",
)
# Keyword options JITFunction.run adds before binding: the fast path sets them as it does.
_REQUIRED_RUN_OPTIONS = frozenset({"debug", "instrumentation_mode"})
_KNOWN_RUN_OPTIONS = frozenset({"debug", "instrumentation_mode", "fpsan_homomorphic_casts"})

_OFF = ("0", "off", "false", "no")
_SLOW = "slow"  # cache value: this key always takes the normal path
_NO_KEY = "no-key"  # key-function cache value: these argument types are not fast-pathed
_ABSENT = object()


def _gluon_jit_type(jit_function: type) -> tuple[type, ...]:
    """Gluon's ``@gluon.jit`` class where it launches exactly as ``JITFunction`` (it inherits ``run``
    and the binder, and only swaps the AST source it compiles), else nothing."""
    try:
        from triton.experimental.gluon._runtime import GluonJITFunction
    except ImportError:
        return ()
    inherits = GluonJITFunction.run is jit_function.run and GluonJITFunction.__mro__[1] is jit_function
    return (GluonJITFunction,) if inherits else ()


class _Triton:
    """The pieces of the installed Triton the fast path uses, found and checked once."""

    def __init__(self, force: bool, verify_all: bool) -> None:
        import triton
        from triton import knobs
        from triton.compiler.compiler import CompiledKernel
        from triton.runtime import _allocation
        from triton.runtime import jit as triton_jit

        version = triton.__version__.split("+")[0]
        if version not in REVIEWED_TRITON_VERSIONS and not force:
            raise RuntimeError(f"Triton {triton.__version__} is not one of {REVIEWED_TRITON_VERSIONS}")
        run_source = " ".join(inspect.getsource(triton_jit.JITFunction.run).split())
        missing = [s for s in _RUN_FINGERPRINT if " ".join(s.split()) not in run_source]
        if missing:
            raise RuntimeError(f"JITFunction.run lacks {missing[0]!r}")
        added = list(dict.fromkeys(re.findall(r'kwargs\["(\w+)"\] =', run_source)))  # in order
        if not _REQUIRED_RUN_OPTIONS <= set(added) <= _KNOWN_RUN_OPTIONS or added[0] != "debug":
            raise RuntimeError(f"JITFunction.run adds options {added}")
        if "specialization.append" in run_source and "add_stages_inspection_hook" not in run_source:
            raise RuntimeError("JITFunction.run extends the specialization")
        self.version = triton.__version__
        self.knobs = knobs
        self.jit_module = triton_jit  # JITFunction.run reads its `driver.active` at every launch
        self.JITFunction = triton_jit.JITFunction
        self.jit_types = (triton_jit.JITFunction, *_gluon_jit_type(triton_jit.JITFunction))
        self.CompiledKernel = CompiledKernel
        self.compute_cache_key = triton_jit.compute_cache_key
        self.hook_chain = getattr(knobs, "HookChain", None)
        self.null_allocator = _allocation.NullAllocator
        self.profile_allocator = _allocation._profile_allocator
        self.run_options = tuple(added[1:])  # set after debug, in this order (str(options) is keyed)
        self.verify_all = verify_all

    def quiet(self) -> bool:
        """No launch hook (None, or Triton's default: an empty hook chain, which the normal path calls
        for nothing), profiler scratch allocator, instrumentation or stage inspection active. Every
        fast launch asks: plain loops, no generator."""
        runtime, compilation = self.knobs.runtime, self.knobs.compilation
        chain = self.hook_chain
        for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
            if hook is not None and (chain is None or type(hook) is not chain or hook.calls):
                return False
        inspecting = getattr(runtime, "add_stages_inspection_hook", None) is not None
        if inspecting or compilation.instrumentation_mode:
            return False
        for name in self.run_options:
            if getattr(compilation, name):
                return False
        return isinstance(self.profile_allocator.get(), self.null_allocator)


_state: _Triton | None = None
_state_ready = False
_mode = ""


def reload_settings() -> None:
    """Read ``THD_FAST_LAUNCH`` and ``TRITON_INTERPRET`` again and re-check the installed Triton
    (on the next launch). Cached kernels stay; launches that now take the normal path do so."""
    global _state, _state_ready
    _state, _state_ready = None, False


def _resolve() -> _Triton | None:
    global _state, _state_ready, _mode
    if not _state_ready:
        _mode = config.fast_launch_mode()
        state = None
        if _mode not in _OFF and not config.interpreting():
            try:
                state = _Triton(force=_mode == "force", verify_all=_mode == "verify")
                if state.knobs.runtime.interpret:
                    state = None
            except Exception:
                state = None
        _state, _state_ready = state, True
    return _state


def enabled() -> bool:
    """Whether launches may take the fast path (switch, interpreter and Triton version allow it)."""
    return _resolve() is not None


def _wide_int(value: int) -> tuple[str, bool]:
    """An int outside int32: Triton's i64 / u64 (or its error beyond them), with divisibility."""
    if -(2**63) <= value < 2**63:
        kind = "i64"
    elif 2**63 <= value < 2**64:
        kind = "u64"
    else:
        kind = "out-of-range"  # Triton refuses it; the normal path raises
    return kind, value & 15 == 0


_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_PLAIN_TYPES = (float, bool, type(None))  # specialized on their type only (fp32, u1, constexpr None)


def _make_arg_key(types: tuple[type, ...]) -> Callable[..., tuple] | None:
    """A function of the positional arguments giving what Triton specializes on beyond their types,
    or None when one of the types is not handled here."""
    parts = []
    for i, t in enumerate(types):
        if t in _TENSOR_TYPES:
            parts.append(f"a{i}.dtype, a{i}.data_ptr() & 15 == 0")
        elif t is int:
            # 1 becomes a constexpr; other int32 values specialize on divisibility by 16. The three
            # results (2, True, False) and _wide_int's tuples never compare equal to each other.
            a = f"a{i}"
            parts.append(
                f"(2 if {a} == 1 else {a} & 15 == 0) if -2147483648 <= {a} <= 2147483647 else wide({a})"
            )
        elif t not in _PLAIN_TYPES:
            return None
    names = ", ".join(f"a{i}" for i in range(len(types)))
    source = f"def arg_key({names}):\n    return ({', '.join(parts)}{',' if parts else ''})\n"
    namespace: dict[str, Any] = {"wide": _wide_int}
    exec(source, namespace)
    return namespace["arg_key"]  # type: ignore[no-any-return]


class _Fixed(NamedTuple):
    """What :meth:`KernelLauncher.run_fixed` keeps per token and keywords dict: both (kept alive, so
    their ids stay theirs), the tail's distinct tensors and their types, the tensor key function per
    head types, the launches by their remaining key, and the keywords' constexpr values (None when
    one is missing: such a key is never cached, see :meth:`KernelLauncher._remember`)."""

    token: object
    kwargs: dict
    tail_types: tuple[type, ...]
    tail_tensors: tuple
    tensor_keys: dict[tuple[type, ...], Callable[..., tuple] | str]
    launches: dict[tuple, list | str]
    constexprs: tuple | None


class KernelLauncher:
    """Launches one ``@triton.jit`` function like ``fn[grid](*args, **kwargs)``, through a cache
    of compiled kernels keyed on everything Triton specializes on (see the module docstring).

    Positional arguments must be the kernel's non-constexpr parameters, all of them, in order;
    keywords its constexpr parameters (all of them) and launch options (``num_warps``, ...).
    ``grid`` is a tuple of one to three ints. Anything else, an interpreted or autotuned kernel
    included, is passed to ``fn[grid]`` unchanged. Returns what ``fn[grid](...)`` returns.
    """

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.fast_launches = 0
        self.normal_launches = 0
        self.fallbacks = 0  # keys that failed a check or a fast launch, now on the normal path
        self._cache: dict[tuple, list | str] = {}
        self._arg_keys: dict[tuple[type, ...], Callable[..., tuple] | str] = {}
        self._fixed: dict[tuple[int, int], _Fixed] = {}  # run_fixed's records by the ids of token, keywords
        self._tensor_keys: dict[tuple[type, ...], Callable[..., tuple] | str] = {}
        self._plan: tuple[int, Callable[[dict], tuple]] | None = None
        self._plan_for: object = None

    def __repr__(self) -> str:
        return (
            f"KernelLauncher({getattr(self.fn, '__name__', self.fn)!r}, fast={self.fast_launches}, "
            f"normal={self.normal_launches}, fallbacks={self.fallbacks}, keys={len(self._cache)})"
        )

    def __getitem__(self, grid: Sequence[int]) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.run(grid, *args, **kwargs)

    # ------------------------------------------------------------------------- the key

    def _layout(self, state: _Triton) -> tuple[int, Callable[[dict], tuple]] | None:
        """``(number of positional parameters, getter of the constexprs' values)``, or None
        when ``fn`` is not a plain JITFunction whose non-constexpr parameters all come first."""
        if self._plan_for is state:
            return self._plan
        plan = None
        fn = self.fn
        if type(fn) in state.jit_types:
            params = list(fn.params)
            kinds = [p.kind for p in fn.signature.parameters.values()]
            plain = sum(1 for p in params if not p.is_constexpr)
            if all(not p.is_constexpr for p in params[:plain]) and all(
                k is inspect.Parameter.POSITIONAL_OR_KEYWORD for k in kinds
            ):
                names = tuple(p.name for p in params[plain:])
                getter: Callable[[dict], tuple]
                if len(names) > 1:
                    getter = operator.itemgetter(*names)
                elif names:
                    only = names[0]
                    getter = lambda kwargs: (kwargs[only],)
                else:
                    getter = lambda kwargs: ()
                defaults = {p.name: p.default for p in params[plain:] if p.has_default}
                if defaults:  # a constexpr left out takes its default, as Triton's binder gives it
                    getter = functools.partial(_with_defaults, getter, names, defaults)
                plan = (plain, getter)
        self._plan, self._plan_for = plan, state
        return plan

    def key(self, state: _Triton, device: int, args: tuple, kwargs: dict) -> tuple | None:
        """This launch's cache key, or None when it must take the normal path."""
        plan = self._layout(state)
        if plan is None or len(args) != plan[0]:
            return None
        fn = self.fn
        if not self._undisturbed(state):
            return None
        types = tuple(map(type, args))
        arg_key = self._arg_keys.get(types)
        if arg_key is None:
            arg_key = self._arg_keys[types] = _make_arg_key(types) or _NO_KEY
        if arg_key is _NO_KEY:
            return None
        debug = kwargs.get("debug", fn.debug) or state.knobs.runtime.debug
        return (
            device,
            types,
            arg_key(*args),  # type: ignore[operator]
            tuple(kwargs.items()),
            tuple(map(type, kwargs.values())),
            debug,
        )

    def _undisturbed(self, state: _Triton) -> bool:
        """No pre-run hook, launch hook or instrumentation active and no global the kernel uses
        changed (the normal path raises then): what every fast launch checks first."""
        fn = self.fn
        if fn.pre_run_hooks or not state.quiet():
            return False
        for (name, _), (value, globals_dict) in fn.used_global_vals.items():
            if globals_dict.get(name, _ABSENT) != value:
                return False
        return True

    # ------------------------------------------------------------------------- launches

    @staticmethod
    def _start(grid: object) -> tuple[_Triton, Any, int] | None:
        """The fast path's state, Triton's active driver and the current device, or None where the
        launch takes the normal path (fast path off, a grid that is not a tuple of 1-3 ints, no driver)."""
        state = _state if _state_ready else _resolve()
        if state is None or type(grid) is not tuple or not 1 <= len(grid) <= 3:
            return None
        try:
            active = state.jit_module.driver.active
            return state, active, active.get_current_device()
        except Exception:
            return None

    def run(self, grid: Sequence[int], *args: Any, **kwargs: Any) -> Any:
        """``fn[grid](*args, **kwargs)``, through the cache when possible."""
        started = self._start(grid)
        if started is None:
            return self._normal(grid, args, kwargs)
        state, active, device = started
        try:
            key = self.key(state, device, args, kwargs)
            entry = None if key is None else self._cache.get(key)
        except Exception:
            return self._normal(grid, args, kwargs)
        if key is None:
            return self._normal(grid, args, kwargs)
        if entry is None:
            kernel = self._normal(grid, args, kwargs)
            self._remember(state, key, device, kernel, args, kwargs)
            return kernel
        return self._launch_cached(state, entry, active, device, grid, args, kwargs)

    def _launch_cached(
        self,
        state: _Triton,
        entry: list | str,
        active: Any,
        device: int,
        grid: Any,
        args: tuple,
        kwargs: dict,
        constexprs: tuple | None = None,
    ) -> Any:
        """Launch the cached kernel of ``entry`` (the normal path for a key marked slow);
        ``constexprs``: the values of ``kwargs``' constexpr parameters, when the caller has them."""
        if entry is _SLOW or entry[0] is None:
            return self._normal(grid, args, kwargs)
        launch, function, packed_metadata, kernel, unchecked, values = entry
        try:
            stream = active.get_current_stream(device)
            if constexprs is None:
                constexprs = values(kwargs)
            if (unchecked or state.verify_all) and not self._check(state, kernel, device, args, kwargs):
                raise RuntimeError("Triton's cache holds another kernel for these arguments")
            entry[4] = False
            size = len(grid)
            launch(
                grid[0],
                grid[1] if size > 1 else 1,
                grid[2] if size > 2 else 1,
                stream,
                function,
                packed_metadata,
                None,  # launch metadata: only read by launch hooks, and none is active
                None,
                None,
                *args,
                *constexprs,
            )
        except Exception:
            # Nothing was enqueued: the launcher raises before cuLaunchKernelEx or when it fails.
            entry[0] = None  # this key takes the normal path from now on, whichever way it is found
            self.fallbacks += 1
            return self._normal(grid, args, kwargs)
        self.fast_launches += 1
        return kernel

    def run_fixed(self, token: object, grid: tuple, head: tuple, tail: tuple, kwargs: dict) -> Any:
        """``run(grid, *head, *tail, **kwargs)`` for a caller that passes the same ``grid`` and ``tail``
        with the same ``token`` object every time, and one of a few ``kwargs`` dicts (none ever
        changed; each is remembered by its identity with the token), ``head`` being
        tensors: a launch is then found by ``head``'s types and its and ``tail``'s tensors' dtypes and
        16-byte alignment (each distinct tail tensor once: what Triton specializes on that may differ
        between such calls), with the device and the debug flag, instead of by the whole key. The
        first launch of each such combination takes :meth:`run` (and its checks); the global-state
        checks run every time."""
        started = self._start(grid)
        if started is None:
            return self._normal(grid, (*head, *tail), kwargs)
        state, active, device = started
        try:
            fixed = self._fixed.get((id(token), id(kwargs)))
            if fixed is None or fixed.token is not token or fixed.kwargs is not kwargs:
                fixed = self._fix(state, token, tail, kwargs)
            types = tuple(map(type, head))
            tensor_key = fixed.tensor_keys.get(types)
            if tensor_key is None:
                tensor_key = fixed.tensor_keys[types] = self._tensor_key(types + fixed.tail_types)
            if tensor_key is _NO_KEY or not self._undisturbed(state):
                return self.run(grid, *head, *tail, **kwargs)
            debug = kwargs.get("debug", self.fn.debug) or state.knobs.runtime.debug
            sub = (device, debug, types, tensor_key(*head, *fixed.tail_tensors))  # type: ignore[operator]
            entry = fixed.launches.get(sub)
        except Exception:
            return self._normal(grid, (*head, *tail), kwargs)
        args = (*head, *tail)
        if entry is None:
            kernel = self.run(grid, *args, **kwargs)
            key = self.key(state, device, args, kwargs)
            fixed.launches[sub] = _SLOW if key is None else self._cache.get(key, _SLOW)
            return kernel
        return self._launch_cached(state, entry, active, device, grid, args, kwargs, fixed.constexprs)

    def _fix(self, state: _Triton, token: object, tail: tuple, kwargs: dict) -> _Fixed:
        """The record of a :meth:`run_fixed` token and keywords (see :class:`_Fixed`)."""
        if len(self._fixed) >= 1024:  # a record keeps its token (a plan, and its tensors) alive
            self._fixed.clear()
        tensors = tuple(dict.fromkeys(a for a in tail if type(a) in _TENSOR_TYPES))  # each once
        constexprs = None
        plan = self._layout(state)
        if plan is not None:
            try:
                constexprs = plan[1](kwargs)
            except KeyError:  # a constexpr without a default left out: no fast launch will use it
                constexprs = None
        record = _Fixed(token, kwargs, tuple(map(type, tensors)), tensors, {}, {}, constexprs)
        self._fixed[(id(token), id(kwargs))] = record
        return record

    def _tensor_key(self, types: tuple[type, ...]) -> Callable[..., tuple] | str:
        """The key function of tensors of ``types`` (dtype and alignment of each), or
        :data:`_NO_KEY` when one is not a tensor."""
        found = self._tensor_keys.get(types)
        if found is None:
            found = _NO_KEY
            if all(t in _TENSOR_TYPES for t in types):
                found = _make_arg_key(types) or _NO_KEY
            self._tensor_keys[types] = found
        return found

    def _normal(self, grid: Any, args: tuple, kwargs: dict) -> Any:
        self.normal_launches += 1
        return self.fn[grid](*args, **kwargs)

    def _remember(
        self, state: _Triton, key: tuple, device: int, kernel: Any, args: tuple, kwargs: dict
    ) -> None:
        """Cache the kernel the normal path just launched, if Triton's cache agrees; never raises."""
        try:
            if not isinstance(kernel, state.CompiledKernel):  # e.g. None: a JIT hook skipped compiling
                return
            plan = self._layout(state)
            assert plan is not None
            values = plan[1]
            values(kwargs)  # KeyError: a constexpr without a default left out
            launch = kernel.run  # initialized by the launch that just ran
            function = kernel.function
            if function is None or not callable(launch):
                raise RuntimeError("the compiled kernel has no launcher")
            if not self._check(state, kernel, device, args, kwargs):
                raise RuntimeError("Triton's cache holds another kernel for these arguments")
            self._cache[key] = [launch, function, kernel.packed_metadata, kernel, True, values]
        except Exception:
            self._cache[key] = _SLOW
            self.fallbacks += 1

    def _check(self, state: _Triton, kernel: Any, device: int, args: tuple, kwargs: dict) -> bool:
        """Whether ``JITFunction.run`` would launch ``kernel`` with exactly the arguments the fast
        path passes: Triton's binder and cache key, computed as ``run`` computes them."""
        fn = self.fn
        options = dict(kwargs)
        options["debug"] = options.get("debug", fn.debug) or state.knobs.runtime.debug
        for name in state.run_options:
            options[name] = getattr(state.knobs.compilation, name)
        kernel_cache, kernel_key_cache, _target, _backend, binder = fn.device_caches[device]
        bound, specialization, bound_options = binder(*args, **options)
        plan = self._layout(state)
        assert plan is not None
        passed = (*args, *plan[1](kwargs))
        if list(bound) != fn.arg_names or len(bound) != len(passed):
            return False
        if any(a is not b for a, b in zip(bound.values(), passed, strict=True)):
            return False
        triton_key = state.compute_cache_key(kernel_key_cache, specialization, bound_options)
        return kernel_cache.get(triton_key) is kernel


def _with_defaults(
    given: Callable[[dict], tuple], names: tuple[str, ...], defaults: dict[str, Any], kwargs: dict
) -> tuple:
    """The values of the constexprs ``names``: ``given(kwargs)`` when ``kwargs`` has them all, else
    each from ``kwargs`` or its default (KeyError for one without a default)."""
    try:
        return given(kwargs)
    except KeyError:
        return tuple(kwargs[name] if name in kwargs else defaults[name] for name in names)


_LAUNCHERS: dict[int, KernelLauncher] = {}


def launcher_for(fn: Any) -> KernelLauncher:
    """The one :class:`KernelLauncher` of ``fn`` (made on first use): how every op launches."""
    found = _LAUNCHERS.get(id(fn))
    if found is None or found.fn is not fn:
        found = _LAUNCHERS[id(fn)] = KernelLauncher(fn)
    return found


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cpu" if config.kernel_settings().interpret else "cuda")


def ensure_scratch_allocator() -> None:
    """Device-side tensor descriptors live in a global scratch that Triton allocates per launch
    through a per-thread (context-variable) allocator: set one in the launching thread (autograd's
    backward runs in a thread of its own)."""
    import triton
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)
