"""thd-kernels release tool: normalized versions, zip-to-zip wheel repack, verification.

Run as ``python -m release <command>``; see :mod:`release.__main__`. The library API returns
values or raises :class:`release.errors.ReleaseError`; only the CLI prints.
"""

from __future__ import annotations

__all__: list[str] = []
