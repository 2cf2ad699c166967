"""Test helpers: a reporting ``assert_close``, THD layout builders and NaN poisoning.

Layouts are built here from plain Python lengths, independently of :mod:`thd.layout`, so the
tests never validate the library with its own index math.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "Layout",
    "assert_close",
    "assert_rows_equal",
    "make_layout",
    "make_qkv",
    "poison_rows",
    "poisoned_allocations",
    "reference64",
    "tolerance",
]

# (atol, rtol) per dtype and quantity: "out" for outputs and lse, "grad" for dq/dk/dv.
_TOLERANCES: dict[tuple[torch.dtype, str], tuple[float, float]] = {
    (torch.float64, "out"): (1e-6, 1e-6),
    (torch.float64, "grad"): (1e-6, 1e-6),
    (torch.float32, "out"): (2e-4, 2e-4),
    (torch.float32, "grad"): (5e-4, 5e-4),
    (torch.float16, "out"): (5e-3, 5e-3),
    (torch.float16, "grad"): (1e-2, 1e-2),
    (torch.bfloat16, "out"): (2.5e-2, 2.5e-2),
    (torch.bfloat16, "grad"): (2.5e-2, 2.5e-2),
}


def tolerance(dtype: torch.dtype, kind: str = "out") -> dict[str, float]:
    """``{"atol": ..., "rtol": ...}`` for comparing a ``dtype`` result with an fp32 oracle."""
    atol, rtol = _TOLERANCES[(dtype, kind)]
    return {"atol": atol, "rtol": rtol}


def assert_close(actual: Tensor, expected: Tensor, name: str, *, atol: float, rtol: float) -> None:
    """Assert ``|actual - expected| <= atol + rtol * |expected|`` elementwise.

    Infinities must match exactly and NaN never matches. The failure message names the
    tensor and gives the mismatch count, max abs and rel error over finite elements and the
    first bad index with both values.
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {list(actual.shape)} != expected {list(expected.shape)}")
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    ok = torch.isclose(a, e, atol=atol, rtol=rtol)
    if bool(ok.all()):
        return
    both_finite = torch.isfinite(a) & torch.isfinite(e)
    err = torch.where(both_finite, (a - e).abs(), 0.0)
    rel = err / e.abs().clamp_min(1e-12)
    bad = (~ok).nonzero()[0].tolist()
    idx = tuple(bad)
    raise AssertionError(
        f"{name}: {int((~ok).sum())}/{ok.numel()} elements differ (atol={atol:g}, rtol={rtol:g}); "
        f"max abs err {err.max().item():.3e}, max rel err {rel.max().item():.3e}; "
        f"first bad index {idx}: got {a[idx].item()!r}, expected {e[idx].item()!r}; "
        f"non-finite: got {int((~torch.isfinite(a)).sum())}, expected {int((~torch.isfinite(e)).sum())}"
    )


def assert_rows_equal(x: Tensor, rows: Tensor, value: float, name: str, *, dim: int = 0) -> None:
    """Assert every element of ``x`` in the selected ``rows`` (bool mask along ``dim``) equals ``value``.

    Exact comparison (``-0.0 == 0.0`` passes, NaN fails): used for the zeros of padding rows
    in ``out``/``dq``/``dk``/``dv`` and the ``-inf`` of ``lse``.
    """
    sel = x.detach().movedim(dim, 0)[rows.to(x.device)].to("cpu", torch.float64)
    bad = sel != value
    if not bool(bad.any()):
        return
    first = bad.nonzero()[0].tolist()
    row = int(rows.nonzero()[first[0]].item())
    raise AssertionError(
        f"{name}: {int(bad.sum())} elements on padding rows are not {value!r}; first at row {row}, "
        f"index {tuple(first[1:])} along the other dims: got {sel[tuple(first)].item()!r}"
    )


@dataclass(frozen=True)
class Layout:
    """A THD layout from host lengths: real lengths, slot lengths and reserved capacity.

    Sequence ``b`` occupies slot ``[cup[b], cup[b] + slot[b])`` and its real rows are the prefix
    ``[cup[b], cup[b] + len[b])``. Rows from ``sum(slots)`` to ``T`` are reserved capacity.
    ``padded`` says whether the ``cu_seqlens_*_padded`` tensors are passed to the op.
    """

    name: str
    lens_q: tuple[int, ...]
    lens_kv: tuple[int, ...]
    slots_q: tuple[int, ...]
    slots_kv: tuple[int, ...]
    total_q: int
    total_kv: int
    padded: bool = field(default=True)

    @property
    def max_seqlen_q(self) -> int:
        return max(self.lens_q, default=0)

    @property
    def max_seqlen_kv(self) -> int:
        return max(self.lens_kv, default=0)

    def cu(self, side: str, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
        """``(cu_seqlens, cu_seqlens_padded)`` for ``side`` in ``{"q", "kv"}``, int32 on ``device``."""
        lens, slots = (self.lens_q, self.slots_q) if side == "q" else (self.lens_kv, self.slots_kv)
        cu = torch.tensor([0, *accumulate(lens)], dtype=torch.int32, device=device)
        cup = torch.tensor([0, *accumulate(slots)], dtype=torch.int32, device=device)
        return cu, cup

    def kwargs(self, device: torch.device | str = "cpu", *, max_seqlen: bool = True) -> dict[str, Any]:
        """Keyword arguments of ``thd.attention`` after ``q, k, v`` (cu tensors and max lengths)."""
        cu_q, cup_q = self.cu("q", device)
        cu_kv, cup_kv = self.cu("kv", device)
        return {
            "cu_seqlens_q": cu_q,
            "cu_seqlens_kv": cu_kv,
            "cu_seqlens_q_padded": cup_q if self.padded else None,
            "cu_seqlens_kv_padded": cup_kv if self.padded else None,
            "max_seqlen_q": self.max_seqlen_q if max_seqlen else None,
            "max_seqlen_kv": self.max_seqlen_kv if max_seqlen else None,
        }

    def real_rows(self, side: str, device: torch.device | str = "cpu") -> Tensor:
        """Bool mask ``[T]``: True on rows that hold a real token of some sequence."""
        lens, slots, total = (
            (self.lens_q, self.slots_q, self.total_q)
            if side == "q"
            else (self.lens_kv, self.slots_kv, self.total_kv)
        )
        mask = torch.zeros(total, dtype=torch.bool)
        for start, length in zip(accumulate([0, *slots]), lens, strict=False):
            mask[start : start + length] = True
        return mask.to(device)

    def row_positions(self, side: str) -> list[tuple[int, int, int]]:
        """Per buffer row ``(sequence, position, length)``, or ``(-1, -1, 0)`` for padding rows."""
        lens, slots, total = (
            (self.lens_q, self.slots_q, self.total_q)
            if side == "q"
            else (self.lens_kv, self.slots_kv, self.total_kv)
        )
        rows = [(-1, -1, 0)] * total
        for b, (start, length) in enumerate(zip(accumulate([0, *slots]), lens, strict=False)):
            for i in range(length):
                rows[start + i] = (b, i, length)
        return rows

    def describe(self) -> str:
        return f"{self.name}-Tq{self.total_q}-Tk{self.total_kv}"


def _slots(lens: Sequence[int], pad: int | Sequence[int]) -> tuple[int, ...]:
    pads = [pad] * len(lens) if isinstance(pad, int) else list(pad)
    if len(pads) != len(lens) or min(pads, default=0) < 0:
        raise ValueError(f"pad {pad!r} does not fit lengths {list(lens)!r}")
    return tuple(n + p for n, p in zip(lens, pads, strict=True))


def make_layout(
    name: str,
    lens_q: Sequence[int],
    lens_kv: Sequence[int] | None = None,
    *,
    pad_q: int | Sequence[int] = 0,
    pad_kv: int | Sequence[int] | None = None,
    capacity_q: int = 0,
    capacity_kv: int | None = None,
    padded: bool | None = None,
) -> Layout:
    """Build a :class:`Layout`.

    ``pad_*`` is the slot padding after each sequence (one int for all, or one per sequence;
    padding only the last one is tail padding), ``capacity_*`` the reserved rows after the last
    slot. ``lens_kv``/``pad_kv``/``capacity_kv`` default to the query side (self-attention).
    ``padded`` defaults to "any padding or capacity present"; with ``padded=False`` the op gets
    no ``cu_seqlens_*_padded`` and the slots must equal the lengths.
    """
    lens_kv = lens_q if lens_kv is None else lens_kv
    if len(lens_kv) != len(lens_q):
        raise ValueError("lens_q and lens_kv need the same number of sequences")
    pad_kv = pad_q if pad_kv is None else pad_kv
    capacity_kv = capacity_q if capacity_kv is None else capacity_kv
    slots_q, slots_kv = _slots(lens_q, pad_q), _slots(lens_kv, pad_kv)
    has_padding = slots_q != tuple(lens_q) or slots_kv != tuple(lens_kv) or capacity_q or capacity_kv
    padded = bool(has_padding) if padded is None else padded
    if not padded and has_padding:
        raise ValueError("a layout with padding needs padded=True")
    return Layout(
        name=name,
        lens_q=tuple(lens_q),
        lens_kv=tuple(lens_kv),
        slots_q=slots_q,
        slots_kv=slots_kv,
        total_q=sum(slots_q) + capacity_q,
        total_kv=sum(slots_kv) + capacity_kv,
        padded=padded,
    )


def poison_rows(x: Tensor, real_rows: Tensor, value: float = float("nan")) -> Tensor:
    """Copy of ``x`` ([T, ...]) with every row outside ``real_rows`` set to ``value``."""
    mask = real_rows.to(x.device).view(-1, *([1] * (x.dim() - 1)))
    return torch.where(mask, x, torch.full_like(x, value))


def make_qkv(
    layout: Layout,
    heads_q: int,
    heads_kv: int,
    dim: int,
    dim_v: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    poison: float | None = float("nan"),
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Random ``q, k, v`` and an output gradient ``do`` for ``layout``.

    With ``poison`` set (NaN by default) the padding rows of ``q``, ``k``, ``v`` hold that value;
    ``do`` stays finite everywhere. Tensors are leaves without ``requires_grad``.
    """

    def randn(*shape: int) -> Tensor:
        where = device if generator is None else generator.device
        return torch.randn(*shape, generator=generator, device=where).to(device, dtype)

    q = randn(layout.total_q, heads_q, dim)
    k = randn(layout.total_kv, heads_kv, dim)
    v = randn(layout.total_kv, heads_kv, dim_v)
    do = randn(layout.total_q, heads_q, dim_v)
    if poison is not None:
        q = poison_rows(q, layout.real_rows("q", device), poison)
        k = poison_rows(k, layout.real_rows("kv", device), poison)
        v = poison_rows(v, layout.real_rows("kv", device), poison)
    return q, k, v, do


@contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Inside, ``torch.empty``/``empty_like``/``new_empty`` return NaN-filled memory (ints: max).

    This uses torch's deterministic mode, whose ``fill_uninitialized_memory`` does the filling.
    A row that an op allocates but forgets to write then fails loudly, instead of passing
    because fresh memory happened to be zero. Ops without a deterministic implementation raise
    inside.
    """
    previous = torch.are_deterministic_algorithms_enabled()
    previous_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    previous_fill = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous, warn_only=previous_warn)
        torch.utils.deterministic.fill_uninitialized_memory = previous_fill  # type: ignore[attr-defined]


REFERENCE_NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")


def reference64(
    layout: Layout,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    do: Tensor,
    kwargs: dict[str, Any],
    sinks: Tensor | None = None,
    *,
    budget: int = 8 << 30,
) -> dict[str, Tensor | None]:
    """Float64 ``out, lse, dq, dk, dv, dsinks`` of :func:`thd.ops.attention.reference.attention`
    (``dsinks`` None without sinks), computed a few heads at a time to bound memory.

    The reference keeps about eight ``[Lq, Lk]`` float64 buffers per head and sequence for
    autograd; heads go in groups that keep that under ``budget`` bytes (GQA groups stay whole).
    """
    from thd.ops.attention import reference

    kwargs = {key: value for key, value in kwargs.items() if key != "deterministic"}
    group = q.shape[1] // k.shape[1]
    area = sum(lq * lk for lq, lk in zip(layout.lens_q, layout.lens_kv, strict=True))
    chunk = max(1, min(k.shape[1], budget // (max(area, 1) * 8 * 8 * group)))
    parts = []
    for j0 in range(0, k.shape[1], chunk):
        j1 = min(k.shape[1], j0 + chunk)
        heads = slice(j0 * group, j1 * group)
        leaves = [t.double().requires_grad_() for t in (q[:, heads], k[:, j0:j1], v[:, j0:j1])]
        sink_leaf = None if sinks is None else sinks[heads].double().requires_grad_()
        out, lse = reference.attention(*leaves, **kwargs, sinks=sink_leaf, return_lse=True)
        out.backward(do[:, heads].double())
        grads = [t.grad for t in leaves] + [None if sink_leaf is None else sink_leaf.grad]
        assert all(g is not None for g in grads[:3])
        parts.append(dict(zip(REFERENCE_NAMES, [out.detach(), lse.detach(), *grads], strict=True)))
    dims = {"out": 1, "lse": 0, "dq": 1, "dk": 1, "dv": 1, "dsinks": 0}
    result: dict[str, Tensor | None] = {}
    for name in REFERENCE_NAMES:
        pieces = [part[name] for part in parts]
        result[name] = None if pieces[0] is None else torch.cat(pieces, dim=dims[name])  # type: ignore[arg-type]
    return result


def capture_graph(step: Callable[[], Tensor]) -> tuple[torch.cuda.CUDAGraph, Tensor]:
    """``step`` warmed up (compiled) on a side stream, then captured: the graph and its output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def shortcut_agrees(
    cases: Sequence[dict[str, Any]], outcome: Callable[[dict[str, Any], bool], object]
) -> int:
    """Assert that every case has the same ``outcome(case, shortcut)`` with the shortcut as without
    it (the full checks are the oracle); returns how many cases passed (outcome ``None``)."""
    passed = 0
    for case in cases:
        want = outcome(case, False)
        assert outcome(case, True) == want, case
        passed += want is None
    return passed
