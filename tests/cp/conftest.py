"""Fixtures of the context-parallel tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from thd.cp.plan_cache import clear_plan_cache
from thd.cp.prepare import clear_prepared_calls


@pytest.fixture
def fresh_ring_caches() -> Iterator[None]:
    """The ring's plan cache and prepared-call cache empty (and their counts zero) before and after."""
    clear_plan_cache()
    clear_prepared_calls()
    yield
    clear_plan_cache()
    clear_prepared_calls()
