"""Every environment setting of ``thd``, parsed in one place.

The rule: a setting that changes **what is compiled** is read once, when the kernels are imported
(the first call that needs them, through :func:`kernel_settings`; Triton itself fixes interpreter
against compiler when it decorates them, so a later read could not take effect); ``THD_VALIDATE``
once when :mod:`thd.layout` is imported; the launcher's own switch at the first launch. A setting
that changes **where a call goes** is read on **every call**, by the functions below (spawned
workers and tests change them at run time). :func:`reload` parses the kernel settings again
(tests, benchmarks); modules that copied a value keep their copy.

========================  ==========  ===============================================================
variable                  read        meaning
========================  ==========  ===============================================================
``TRITON_INTERPRET``      both        ``1``: Triton kernels run on CPU tensors through the interpreter.
                                      Kernel import: interpreter tiles, constexprs; per call: dispatch.
``THD_AUTOTUNE``          kernels     ``1``: autotune the attention tiles instead of the table.
``THD_TILES``             kernels     JSON file of tile-table entries replacing the measured ones.
``THD_TMA``               kernels     ``0``: never read tiles through tensor descriptors.
``THD_DQ_MODE``           kernels     ``0|1|2``: how the non-deterministic backward adds dQ.
``THD_FWD_MAX_REGISTERS`` kernels     register cap of small-head-dim forward tiles (``0``: none).
``THD_GLUON_BWD_CONSUMERS`` kernels   ``1`` | ``2`` (default): consumer partitions of the Gluon backward.
``THD_GLUON_DQ_ATOMIC``   kernels     ``0|1``: how the non-deterministic Gluon backward adds dQ.
``THD_FAST_LAUNCH``       1st launch  ``1`` (default) | ``0`` | ``verify`` | ``force``: cached launches
                                      (:func:`thd._runtime.launcher.reload_settings` reads it again).
``THD_VALIDATE``          import      default of :func:`thd.layout.set_validation` (``0`` off,
                                      ``device``: device-side assertions on CUDA).
``THD_ATTENTION_BACKEND`` per call    ``reference`` | ``triton``: force the torch reference or the
                                      kernels (default: kernels where Triton runs).
``THD_KERNELS``           per call    ``auto`` (default) | ``tl`` | ``gluon``: the kernel family;
                                      ``prefer-gluon``: Gluon wherever it supports the call, else
                                      ``tl`` (no speed rule; the GPU tests run the suite so).
``THD_CP_SIDE_STREAM``    per call    ``0``: the ring's NCCL/gloo exchange runs on the current stream.
========================  ==========  ===============================================================

``THD_CP_TRANSPORT`` (per call) is parsed by :func:`thd.cp.transport.requested_transport`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from thd.errors import ThdValueError

__all__ = [
    "KERNEL_FAMILIES",
    "Settings",
    "attention_backend",
    "cp_side_stream",
    "env_int",
    "fast_launch_mode",
    "interpreting",
    "kernel_family",
    "kernel_settings",
    "reload",
    "validation_default",
]

KERNEL_FAMILIES = ("auto", "tl", "gluon", "prefer-gluon")


def env_int(name: str, default: int, allowed: range) -> int:
    """Integer setting ``name`` from the environment (``default`` when unset or empty);
    :class:`ThdValueError` naming the variable and its value when it is not in ``allowed``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value not in allowed:
        raise ThdValueError(f"{name}={raw!r}: expected an integer from {allowed.start} to {allowed.stop - 1}")
    return value


@dataclass(frozen=True)
class Settings:
    """The settings fixed when the kernels are imported (see the module docstring)."""

    interpret: bool
    autotune: bool
    tiles_file: str
    tma: bool
    dq_mode: int | None  # None: the measured default
    fwd_max_registers: int
    gluon_bwd_consumers: int = 2
    gluon_dq_atomic: bool | None = None  # None: the measured default per head dim

    @classmethod
    def from_environ(cls) -> Settings:
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        dq_mode = env_int("THD_DQ_MODE", -1, range(3))
        atomic = env_int("THD_GLUON_DQ_ATOMIC", -1, range(2))
        return cls(
            interpret=interpret,
            autotune=os.environ.get("THD_AUTOTUNE", "0") == "1" and not interpret,
            tiles_file=os.environ.get("THD_TILES", ""),
            tma=os.environ.get("THD_TMA", "1") != "0",
            dq_mode=None if dq_mode < 0 else dq_mode,
            fwd_max_registers=env_int("THD_FWD_MAX_REGISTERS", 168, range(256)),
            gluon_bwd_consumers=env_int("THD_GLUON_BWD_CONSUMERS", 2, range(1, 3)),
            gluon_dq_atomic=None if atomic < 0 else bool(atomic),
        )


_kernel_settings: Settings | None = None


def kernel_settings() -> Settings:
    """The kernel settings, parsed from the environment at the first call."""
    global _kernel_settings
    if _kernel_settings is None:
        _kernel_settings = Settings.from_environ()
    return _kernel_settings


def reload() -> Settings:
    """Parse the kernel settings again; modules that copied a value keep their copy."""
    global _kernel_settings
    _kernel_settings = None
    return kernel_settings()


def validation_default() -> tuple[bool, bool]:
    """``THD_VALIDATE``: ``(value checks on, on the device)``; ``0``/``false``/``off`` turn them
    off, ``device`` asks for device-side assertions on CUDA."""
    raw = os.environ.get("THD_VALIDATE", "1").strip().lower()
    return raw not in ("0", "false", "off"), raw == "device"


# ----------------------------------------------------------------------------- per call


def interpreting() -> bool:
    """``TRITON_INTERPRET=1`` now (read at call time: spawned workers may unset it)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def attention_backend() -> str:
    """``"reference"``, ``"triton"`` or ``""`` (no preference): ``THD_ATTENTION_BACKEND``."""
    forced = os.environ.get("THD_ATTENTION_BACKEND")
    if not forced:
        return ""
    forced = forced.lower()
    return forced if forced in ("reference", "triton") else ""


def kernel_family() -> str:
    """``THD_KERNELS``: ``"auto"`` (unset or empty), ``"tl"``, ``"gluon"`` or ``"prefer-gluon"``;
    anything else is a :class:`ThdValueError` naming the allowed values."""
    raw = os.environ.get("THD_KERNELS")
    if not raw:
        return "auto"
    value = raw.strip().lower()
    if value not in KERNEL_FAMILIES:
        raise ThdValueError(f"THD_KERNELS={raw!r}: expected one of {', '.join(KERNEL_FAMILIES)}")
    return value


def fast_launch_mode() -> str:
    """``THD_FAST_LAUNCH`` in lower case: ``1`` (unset), ``0``/``off``/``false``/``no``, ``verify``
    or ``force``."""
    return os.environ.get("THD_FAST_LAUNCH", "1").strip().lower()


def cp_side_stream() -> bool:
    """Whether the ring's NCCL/gloo exchange may use a side stream (``THD_CP_SIDE_STREAM``)."""
    return os.environ.get("THD_CP_SIDE_STREAM", "1") != "0"
