"""Fixtures for the release tool tests (helpers live in ``wheelkit``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.release.wheelkit import Member, foo_members, write_zip

WheelFactory = Callable[..., Path]


@pytest.fixture
def make_wheel(tmp_path: Path) -> WheelFactory:
    """``make_wheel(filename, members=None, **foo_members kwargs)`` writes a wheel in tmp_path/in."""
    indir = tmp_path / "in"
    indir.mkdir()

    def factory(filename: str, members: list[Member] | None = None, **kwargs) -> Path:
        return write_zip(indir / filename, members if members is not None else foo_members(**kwargs))

    return factory


@pytest.fixture
def foo_wheel(make_wheel: WheelFactory) -> Path:
    return make_wheel("foo-0.3.0.dev0-py3-none-any.whl")
