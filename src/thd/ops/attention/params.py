"""The typed objects every attention layer passes along: where the rows are (:class:`VarlenLayout`),
what to compute (:class:`AttentionOptions`), what the backward reads (:class:`SavedForBackward`),
and one call of each phase (:class:`ForwardCall`, :class:`BackwardCall`: what a kernel family's
``supports_*`` and ``forward``/``backward`` take).

Their fields are the single list of a call's arguments: the custom ops' schema is generated from
them (:mod:`thd.ops.attention.schema`), so a new option is a new field here plus its use in the
kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from torch import Tensor

__all__ = ["AttentionOptions", "BackwardCall", "ForwardCall", "SavedForBackward", "VarlenLayout"]


@dataclass(frozen=True)
class VarlenLayout:
    """Packed sequences of a THD batch, for queries and for keys/values.

    Sequence ``b`` has ``cu_seqlens_q[b+1] - cu_seqlens_q[b]`` real query rows starting at row
    ``cu_seqlens_q_padded[b]`` (``None``: slots are the sequences, no padding between them);
    likewise for keys and values. ``max_seqlen_*`` bound the real lengths (``None``: derive them
    with one device-to-host read). ``positions_*`` (int32 ``[B]``, both or neither) place the
    first query and key row of each sequence on one position axis, for windows and causal masks
    over chunks of longer sequences (the ring); ``None`` aligns the last query with the last key.
    """

    cu_seqlens_q: Tensor
    cu_seqlens_kv: Tensor
    cu_seqlens_q_padded: Tensor | None = None
    cu_seqlens_kv_padded: Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_kv: int | None = None
    positions_q: Tensor | None = None
    positions_kv: Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1

    @property
    def slots_q(self) -> Tensor:
        """Slot offsets of the queries (``cu_seqlens_q`` when there is no padding)."""
        return self.cu_seqlens_q if self.cu_seqlens_q_padded is None else self.cu_seqlens_q_padded

    @property
    def slots_kv(self) -> Tensor:
        return self.cu_seqlens_kv if self.cu_seqlens_kv_padded is None else self.cu_seqlens_kv_padded

    def with_max_seqlens(self, max_seqlen_q: int, max_seqlen_kv: int) -> VarlenLayout:
        """This layout with the given bounds (itself when it has them: the ring's calls pass them)."""
        if max_seqlen_q == self.max_seqlen_q and max_seqlen_kv == self.max_seqlen_kv:
            return self
        return VarlenLayout(
            self.cu_seqlens_q,
            self.cu_seqlens_kv,
            self.cu_seqlens_q_padded,
            self.cu_seqlens_kv_padded,
            max_seqlen_q,
            max_seqlen_kv,
            self.positions_q,
            self.positions_kv,
        )

    def tensors(self) -> tuple[Tensor | None, ...]:
        """The offset and position tensors, in the order of the custom ops' schema."""
        return (
            self.cu_seqlens_q,
            self.cu_seqlens_kv,
            self.cu_seqlens_q_padded,
            self.cu_seqlens_kv_padded,
            self.positions_q,
            self.positions_kv,
        )


@dataclass(frozen=True)
class AttentionOptions:
    """What to compute, besides the inputs.

    ``window_size = (left, right)``: query ``i`` (at key position ``i + Lk - Lq``) sees keys
    ``[i' - left, i' + right]``; ``-1`` leaves a side unbounded. ``causal`` bounds the right
    side at 0. ``softcap > 0`` maps scores ``s`` to ``softcap * tanh(s / softcap)``.
    ``deterministic`` selects the backward without atomics (bitwise reproducible).
    """

    softmax_scale: float
    causal: bool = False
    window_size: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    deterministic: bool = False

    @property
    def window_left(self) -> int:
        """Keys visible to the left of the diagonal; ``-1`` is unbounded."""
        return self.window_size[0]

    @property
    def window_right(self) -> int:
        """Keys visible to the right of the diagonal (0 when causal); ``-1`` is unbounded."""
        return 0 if self.causal else self.window_size[1]

    @property
    def is_masked(self) -> bool:
        """Whether any key of a sequence may be hidden from a query of it."""
        return self.window_left >= 0 or self.window_right >= 0

    def __hash__(self) -> int:
        """The fields' hash, computed once (options key every cached plan; equal options, equal
        hashes, as the generated hash gives)."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            fields = (self.softmax_scale, self.causal, self.window_size, self.softcap, self.deterministic)
            cached = hash(fields)
            object.__setattr__(self, "_hash", cached)
        return cached

    def with_deterministic(self) -> AttentionOptions:
        """These options with ``deterministic=True`` (cached: the same object on every call)."""
        if self.deterministic:
            return self
        cached = self.__dict__.get("_deterministic")
        if cached is None:
            cached = replace(self, deterministic=True)
            object.__setattr__(self, "_deterministic", cached)
        return cached


class SavedForBackward(NamedTuple):
    """What the backward of one attention call reads: its inputs and its ``(out, lse)`` (possibly
    merged over several calls by a ring), and the ``sinks`` it ran with."""

    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    lse: Tensor
    sinks: Tensor | None = None


class ForwardCall(NamedTuple):
    """One forward: ``q [Tq, Hq, D]``, ``k [Tk, Hkv, D]``, ``v [Tk, Hkv, Dv]``, where and what, the
    optional ``sinks [Hq]`` and ``accumulate=(out, lse)``, a partial result to merge into in place."""

    q: Tensor
    k: Tensor
    v: Tensor
    layout: VarlenLayout
    options: AttentionOptions
    sinks: Tensor | None = None
    accumulate: tuple[Tensor, Tensor] | None = None


class BackwardCall(NamedTuple):
    """One backward: the output gradient ``do``, what the forward saved, where and what, the
    optional ``accumulate=(dq, dk, dv)`` (fp32 buffers shaped like q, k, v) to add the gradients to,
    and the optional ``delta``: ``rowsum(dO * out)`` (fp32, shaped like ``lse``) already computed
    on this layout's real query rows (by :func:`thd.ops.attention.dispatch.backward_delta`, over
    rows that include them), which spares the kernels' preprocess unless the call has sinks."""

    do: Tensor
    saved: SavedForBackward
    layout: VarlenLayout
    options: AttentionOptions
    accumulate: tuple[Tensor, Tensor, Tensor] | None = None
    delta: Tensor | None = None
