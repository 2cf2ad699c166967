"""Which implementation runs a call: the torch reference or a kernel family (``tl``, ``gluon``).

A *family* is an object (usually a module) with ``supports_forward(call)``, ``forward(call)``,
``supports_backward(call)`` and ``backward(call)``, each taking one typed call of the op. An op
declares its families once in a :class:`FamilyRegistry`: the reference, the default kernel family
and optional ones, each loaded on first use; a family whose import raises ``ImportError`` is
*unavailable* (the reason is kept).

Choice, per call (settings from :mod:`thd._runtime.config`):

1. ``THD_ATTENTION_BACKEND=reference``, or tensors no Triton kernel can run on (CPU without
   ``TRITON_INTERPRET=1``) and no ``THD_ATTENTION_BACKEND=triton``: the reference.
2. ``THD_KERNELS=<name>``: that family. If it is unavailable or its ``supports_*`` says no, the call
   raises :class:`~thd.errors.ThdValueError` with the reason: a forced family never silently
   becomes another one (a benchmark or a test that asked for it would measure the wrong kernels).
3. ``THD_KERNELS=prefer-<name>``: that family wherever it is available and supports the call,
   else the default family (no speed rule: every call a family can run runs on it).
4. ``THD_KERNELS=auto`` (default): the first optional family whose ``auto`` predicate holds for the
   call (e.g. an sm_90 device), that is available, prefers the call (its optional
   ``auto_forward(call)`` / ``auto_backward(call)``: where it measured faster) and supports it; else
   the default family. The preference is asked first: it reads host values only, while
   ``supports_*`` reads tensor metadata, so a call the rule declines (short documents) skips that.

:meth:`FamilyRegistry.last` tells which family ran the last call of each phase, and why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from thd._runtime import config
from thd.errors import ThdValueError

__all__ = ["Choice", "FamilyRegistry", "OptionalFamily", "runs_triton"]


def runs_triton(x: Tensor) -> bool:
    """True when a Triton kernel can run on ``x``: on its GPU, or through the interpreter."""
    return x.is_cuda or (x.device.type == "cpu" and config.interpreting())


@dataclass(frozen=True)
class Choice:
    """The family a call ran on, and why that one."""

    family: str
    reason: str


@dataclass
class OptionalFamily:
    """A family that is tried first where ``auto(first tensor)`` holds; ``load`` imports it."""

    load: Callable[[], Any]
    auto: Callable[[Tensor], bool]


@dataclass
class FamilyRegistry:
    """The implementations of one op (see the module docstring)."""

    op: str
    reference: Any
    default_name: str
    load_default: Callable[[], Any]
    optional: dict[str, OptionalFamily] = field(default_factory=dict)
    _loaded: dict[str, Any] = field(default_factory=dict)
    _missing: dict[str, str] = field(default_factory=dict)
    _last: dict[str, Choice] = field(default_factory=dict)

    # ------------------------------------------------------------------------- families

    def register(self, name: str, family: Any) -> None:
        """Use ``family`` (already loaded) for ``name`` from now on (tests inject fakes this way)."""
        self._loaded[name] = family
        self._missing.pop(name, None)

    def forget(self, name: str) -> None:
        """Drop what is known of ``name``: the next call loads it again."""
        self._loaded.pop(name, None)
        self._missing.pop(name, None)

    def family(self, name: str) -> Any | None:
        """The loaded family ``name``, or None when it is unavailable (:meth:`why_missing`)."""
        found = self._loaded.get(name)
        if found is not None or name in self._missing:
            return found
        if name == self.default_name:  # the default family must import: its error is the user's
            found = self._loaded[name] = self.load_default()
            return found
        loader = self.optional[name].load
        try:
            found = loader()
        except ImportError as exc:
            self._missing[name] = f"{type(exc).__name__}: {exc}"
            return None
        self._loaded[name] = found
        return found

    def why_missing(self, name: str) -> str:
        return self._missing.get(name, "")

    # ------------------------------------------------------------------------- choice

    def runs_reference(self, phase: str, x: Tensor) -> bool:
        """Whether this call of ``phase`` runs the reference (rule 1 of the module docstring);
        ``x`` is the tensor that decides the device."""
        backend = config.attention_backend()
        if backend == "reference" or (backend != "triton" and not runs_triton(x)):
            self._last[phase] = _REFERENCE_CHOICE[backend == "reference"]
            return True
        return False

    def choose(self, phase: str, x: Tensor, call: tuple) -> Any:
        """The kernel family that runs ``call`` of ``phase`` (``"forward"``/``"backward"``), for a
        call :meth:`runs_reference` sent to the kernels; ``x`` is the tensor that decides the device."""
        requested = config.kernel_family()
        if requested == "auto":
            return self._auto(phase, x, call)
        if requested.startswith(PREFER):
            return self._preferred(phase, requested.removeprefix(PREFER), call)
        if requested != self.default_name and requested not in self.optional:
            raise ThdValueError(f"{self.op}: THD_KERNELS={requested}: this op has no such kernel family")
        family = self.family(requested)
        if family is None:
            raise ThdValueError(
                f"{self.op}: THD_KERNELS={requested}: the {requested} family is not available "
                f"({self.why_missing(requested)})"
            )
        if not getattr(family, f"supports_{phase}")(call):
            raise ThdValueError(
                f"{self.op} {phase}: THD_KERNELS={requested}: the {requested} family does not support "
                f"this call ({_describe(call)}); unset THD_KERNELS to let thd choose"
            )
        choice = _FORCED.get(requested)
        if choice is None:
            choice = _FORCED[requested] = Choice(requested, "THD_KERNELS")
        self._last[phase] = choice
        return family

    def _preferred(self, phase: str, name: str, call: tuple) -> Any:
        """Rule 3: family ``name`` if it is available and supports ``call``, else the default."""
        if name not in self.optional:
            raise ThdValueError(f"{self.op}: THD_KERNELS={PREFER}{name}: this op has no such kernel family")
        family = self.family(name)
        if family is not None and getattr(family, f"supports_{phase}")(call):
            self._last[phase] = Choice(name, f"THD_KERNELS={PREFER}{name}")
            return family
        reason = f"{name} unavailable" if family is None else f"{name} does not support the call"
        self._last[phase] = Choice(self.default_name, reason)
        return self._default()

    def _default(self) -> Any:
        """The default family (loaded on first use)."""
        return self._loaded.get(self.default_name) or self.family(self.default_name)

    def _auto(self, phase: str, x: Tensor, call: tuple) -> Any:
        reason = "default"
        for name, entry in self.optional.items():
            if not entry.auto(x):
                continue
            family = self.family(name)
            if family is None:
                reason = f"{name} unavailable"
                continue
            prefers = getattr(family, f"auto_{phase}", None)
            if prefers is not None and not prefers(call):
                reason = f"{name} measured slower for the call"
                continue
            if not getattr(family, f"supports_{phase}")(call):
                reason = f"{name} does not support the call"
                continue
            self._last[phase] = Choice(name, "auto")
            return family
        default = self._default()
        choice = self._last.get(phase)
        if choice is None or choice.family != self.default_name or choice.reason != reason:
            self._last[phase] = Choice(self.default_name, reason)
        return default

    def last(self, phase: str = "forward") -> Choice | None:
        """Which family ran the latest call of ``phase``, and why (None before any call)."""
        return self._last.get(phase)


PREFER = "prefer-"
"""Prefix of ``THD_KERNELS`` values that prefer an optional family (rule 3)."""
_FORCED: dict[str, Choice] = {}  # the choice of each forced family, made once (Choice is immutable)
_REFERENCE_CHOICE = {
    True: Choice("reference", "THD_ATTENTION_BACKEND=reference"),
    False: Choice("reference", "no Triton for these tensors"),
}


def _describe(call: tuple) -> str:
    """Short facts of a call for an error message: dtype and shape of its first tensors."""
    tensors = [a for a in call if isinstance(a, Tensor)]
    tensors += [a for part in call if isinstance(part, tuple) for a in part if isinstance(a, Tensor)]
    return ", ".join(f"{t.dtype} {list(t.shape)}".replace("torch.", "") for t in tensors[:4])
