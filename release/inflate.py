"""Raw-deflate inflaters for member data: ISA-L's (``isal``, about 2x zlib's speed on the real
TE wheel) when it is installed, else the standard library's ``zlib``.

Both are driven the same way (:func:`inflate`): output in pieces of at most ``max_length``
bytes, and the inflater is drained until it gives nothing more, so an inflater that holds
output back (ISA-L does, where zlib keeps the input instead) loses none.
``RELEASE_INFLATE=zlib`` forces the standard library's (a name not installed is an error).
``tests/release/test_inflate.py`` checks that both give the same verdict and the same bytes
on mutated deflate streams.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Protocol

from release.errors import ReleaseError

__all__ = ["BACKENDS", "Inflater", "InflateError", "backend", "crc32", "inflate", "inflater"]


class Inflater(Protocol):
    """What :func:`inflate` needs of ``zlib.decompressobj(-15)`` and its ISA-L twin."""

    @property
    def eof(self) -> bool: ...
    @property
    def unused_data(self) -> bytes: ...
    @property
    def unconsumed_tail(self) -> bytes: ...
    def decompress(self, data: bytes, max_length: int = 0) -> bytes: ...


def _available() -> dict[str, ModuleType]:
    found: dict[str, ModuleType] = {"zlib": zlib}
    try:
        from isal import isal_zlib
    except ImportError:
        pass
    else:
        found["isal"] = isal_zlib
    return found


BACKENDS = _available()
InflateError: tuple[type[Exception], ...] = tuple({m.error for m in BACKENDS.values()})
#: CRC-32 of zip members (the same function in both; ISA-L's measured 16x zlib's speed).
crc32: Callable[[bytes, int], int] = BACKENDS.get("isal", zlib).crc32


def backend() -> str:
    """The inflater in use: the one ``RELEASE_INFLATE`` names, else the fastest installed."""
    wanted = os.environ.get("RELEASE_INFLATE", "")
    if not wanted:
        return "isal" if "isal" in BACKENDS else "zlib"
    if wanted not in BACKENDS:
        raise ReleaseError(
            f"RELEASE_INFLATE: expected one of the installed inflaters {sorted(BACKENDS)}, got {wanted!r}"
        )
    return wanted


def inflater(name: str | None = None) -> Inflater:
    """A raw-deflate (``wbits=-15``) inflater of ``name`` (default: :func:`backend`)."""
    return BACKENDS[name or backend()].decompressobj(-15)


def inflate(engine: Inflater, raw: bytes, max_length: int) -> Iterator[bytes]:
    """The output ``raw`` (the next compressed chunk) yields, in non-empty pieces of at most
    ``max_length`` bytes. Stops at the end of the stream (input after it is left in
    ``unused_data`` or ``unconsumed_tail``), when the chunk is used up and drained, or when a
    call makes no progress (input left in ``unconsumed_tail``, the caller's to refuse)."""
    data = raw
    while True:
        piece = engine.decompress(data, max_length)
        if piece:
            yield piece
        left = engine.unconsumed_tail
        if engine.eof or (not piece and (not left or len(left) == len(data))):
            return
        data = left
