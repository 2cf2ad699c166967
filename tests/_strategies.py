"""Hypothesis strategies shared by the property tests."""

from __future__ import annotations

from hypothesis import strategies as st

from tests._helpers import Layout, make_layout

__all__ = ["random_layouts"]


@st.composite
def random_layouts(draw: st.DrawFn) -> Layout:
    """1-4 sequences of 0-40 tokens (keys as many as queries or drawn apart), slot padding and
    reserved capacity on both sides."""
    count = draw(st.integers(1, 4))
    lens = st.lists(st.integers(0, 40), min_size=count, max_size=count)
    pads = st.lists(st.integers(0, 5), min_size=count, max_size=count)
    lens_q = draw(lens)
    lens_kv = draw(st.one_of(st.just(lens_q), lens))
    return make_layout(
        "random",
        lens_q,
        lens_kv,
        pad_q=draw(pads),
        pad_kv=draw(pads),
        capacity_q=draw(st.integers(0, 4)),
        capacity_kv=draw(st.integers(0, 4)),
    )
