"""A least-recently-used cache of what the host derives from the values of tensors it cannot read
without a sync (ring plans from offsets, the Gluon forward's work lists).

An entry is found only for the very same tensor objects, none written in place since (their
``_version``; a write through ``.data`` or outside torch is not seen), and an equal rest of the key.
Entries keep their tensors alive, so an ``id`` is never reused while cached. Never used under
CUDA-graph capture (a captured graph must hold the derivation itself, so that a replay on new values
redoes it), nor for inference tensors (no version counter). Thread-safe: ranks run as threads in
some setups.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from operator import is_
from typing import Generic, TypeVar

from torch import Tensor

__all__ = ["TensorKeyedCache"]

V = TypeVar("V")


class TensorKeyedCache(Generic[V]):
    """The last ``capacity`` values, keyed by tensors' identities and versions plus a rest;
    :attr:`counts` counts ``"hits"``, ``"misses"``, ``"capturing"`` and ``"uncached"``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.counts: Counter[str] = Counter()
        self._entries: OrderedDict[tuple, tuple[tuple[Tensor, ...], V]] = OrderedDict()
        self._lock = threading.Lock()

    def get_or_build(
        self, tensors: tuple[Tensor, ...], rest: tuple, build: Callable[[], V], *, capturing: bool
    ) -> V:
        """The value an earlier call with the same, unchanged ``tensors`` and an equal ``rest``
        built, else ``build()`` (kept unless ``capturing``, a tensor has no version counter or
        ``rest`` cannot be hashed)."""
        if capturing:
            self.counts["capturing"] += 1
            return build()
        try:
            key = (tuple((id(t), t._version) for t in tensors), rest)
            with self._lock:
                entry = self._entries.get(key)  # hashes the key: TypeError for an unhashable rest
                if entry is not None and all(map(is_, entry[0], tensors)):
                    self._entries.move_to_end(key)
                    self.counts["hits"] += 1
                    return entry[1]
        except (RuntimeError, TypeError):  # an inference tensor (no version counter), an unhashable rest
            self.counts["uncached"] += 1
            return build()
        value = build()
        with self._lock:
            self._entries[key] = (tensors, value)
            if len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
            self.counts["misses"] += 1
        return value

    def clear(self) -> None:
        """Forget every entry (and the tensors it keeps alive) and reset the counts."""
        with self._lock:
            self._entries.clear()
            self.counts.clear()
