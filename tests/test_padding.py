"""thd.padding: detection semantics, the verdict cache (identity, freshness, capture) and masks."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import thd._capture
import thd.padding
from thd.errors import ThdTypeError, ThdValueError
from thd.layout import pack_lengths
from thd.padding import (
    clear_detection_cache,
    detect_pad_between_seqs,
    detection_stats,
    resolve_pad_between_seqs,
    valid_rows,
)


def _i32(values: list[int], device: str = "cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


@pytest.fixture(autouse=True)
def _fresh_cache(fresh_detection_cache: None) -> None:
    """Every test starts with an empty detection cache."""


@pytest.fixture
def capturing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend a CUDA graph is being captured."""
    monkeypatch.setattr(thd._capture, "is_capturing", lambda: True)


def _stats() -> tuple[int, int, int]:
    s = detection_stats()
    return s["hits"], s["misses"], s["fallbacks"]


# ----------------------------------------------------------------------------- semantics


@pytest.mark.parametrize(
    ("cu", "cup", "want_cp1", "want_cp2"),
    [
        pytest.param([0, 3, 5, 9], [0, 3, 5, 9], False, False, id="value-equal"),
        pytest.param([0, 3, 5], [0, 3, 8], False, True, id="tail-padding"),
        pytest.param([0, 3, 5, 9], [0, 4, 8, 12], True, True, id="slot-padding"),
        pytest.param([0, 4, 8], [0, 4, 8], False, False, id="no-padding"),
        pytest.param([0, 3, 3, 7], [0, 4, 4, 8], True, True, id="zero-length-middle"),
        pytest.param([0, 8, 8, 8], [0, 8, 8, 8], False, False, id="trailing-placeholders"),
        pytest.param([0, 8, 8], [0, 8, 16], False, False, id="trailing-dummy-slot"),
        pytest.param([0, 8, 8, 8], [0, 8, 16, 24], True, False, id="trailing-dummy-slots"),
        pytest.param([0, 5, 5], [0, 8, 8], True, True, id="tail-padding-then-placeholder"),
        pytest.param([0, 0, 0], [0, 0, 4], False, False, id="all-empty"),
        pytest.param([0], [0], False, False, id="no-sequences"),
        pytest.param([0, 1, 2], [0, 4, 8], True, True, id="single-tokens"),
        pytest.param([0, 4], [0, 8], False, True, id="divisible-real-length-longer-slot"),
        pytest.param([0, 7, 16, 17, 17, 30], [0, 8, 20, 24, 24, 40], True, True, id="middle-padding"),
    ],
)
def test_detect_matches_spec(cu: list[int], cup: list[int], want_cp1: bool, want_cp2: bool) -> None:
    assert detect_pad_between_seqs(_i32(cu), _i32(cup)) is want_cp1
    assert detect_pad_between_seqs(_i32(cu), _i32(cup), cp_size=2) is want_cp2


def test_detect_same_object_or_none_means_no_padding() -> None:
    cu = _i32([0, 3, 8])
    assert detect_pad_between_seqs(cu, cu, cp_size=2) is False
    assert detect_pad_between_seqs(cu, None, cp_size=2) is False
    assert _stats() == (0, 0, 0)


@pytest.mark.property
@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9), max_size=6),
    cp_size=st.integers(1, 4),
    extra=st.lists(st.integers(0, 1), min_size=6, max_size=6),
)
def test_detect_matches_host_definition(lengths: list[int], cp_size: int, extra: list[int]) -> None:
    layout = pack_lengths(lengths, cp_size=cp_size)
    cu, cup = layout.cu_seqlens.tolist(), layout.cu_seqlens_padded.tolist()
    if cp_size == 1:  # pack_lengths leaves cp_size=1 unpadded; add some slot padding
        padded = [n + e for n, e in zip(lengths, extra, strict=False)]
        cup = [0]
        for n in padded:
            cup.append(cup[-1] + n)
    last = max((b for b, n in enumerate(lengths) if n), default=-1)
    want = cu[:-1] != cup[:-1] if cp_size == 1 else cu[: last + 2] != cup[: last + 2]
    assert detect_pad_between_seqs(_i32(cu), _i32(cup), cp_size=cp_size) is want
    if cp_size > 1:
        assert layout.pad_between_seqs is want


# ----------------------------------------------------------------------------- cache


def test_detect_cache_hits_on_same_tensors_and_keys_on_cp_size() -> None:
    cu, cup = _i32([0, 3, 5]), _i32([0, 3, 8])
    assert detect_pad_between_seqs(cu, cup) is False
    assert detect_pad_between_seqs(cu, cup) is False
    assert _stats() == (1, 1, 0)
    assert detect_pad_between_seqs(cu, cup, cp_size=2) is True  # separate entry
    assert detect_pad_between_seqs(cu, cup, cp_size=2) is True
    assert _stats() == (2, 2, 0)
    assert detection_stats()["size"] == 2


def test_detect_inplace_refill_invalidates() -> None:
    cu, cup = _i32([0, 3, 5, 9]), _i32([0, 3, 5, 9])
    assert detect_pad_between_seqs(cu, cup, cp_size=2) is False
    cup.copy_(_i32([0, 4, 8, 12]))  # next step refills the static buffer
    assert detect_pad_between_seqs(cu, cup, cp_size=2) is True
    cup[1:] = _i32([3, 5, 9])
    assert detect_pad_between_seqs(cu, cup, cp_size=2) is False
    assert _stats() == (0, 3, 0)


def test_detect_freed_tensor_with_reused_id_never_hits(monkeypatch: pytest.MonkeyPatch) -> None:
    # Blind the freshness key so that only the weak references can tell the tensors apart.
    monkeypatch.setattr(thd.padding, "_state", lambda cu, cup: ())
    cup = _i32([0, 4, 8])
    cu = torch.empty(3, dtype=torch.int32).copy_(cup)
    assert detect_pad_between_seqs(cu, cup) is False  # value-equal: cached False
    old_id, old_ref = id(cu), weakref.ref(cu)
    del cu
    fresh: torch.Tensor | None = None
    for _ in range(10_000):
        candidate = torch.empty(3, dtype=torch.int32)
        if id(candidate) == old_id:
            fresh = candidate
            break
        del candidate
    if fresh is None:
        pytest.skip("CPython did not reuse the id; test_detect_cache_entry_dies_with_tensor covers it")
    assert old_ref() is None
    fresh.copy_(_i32([0, 3, 8]))  # padding: the stale verdict (False) would be wrong
    assert detect_pad_between_seqs(fresh, cup) is True
    assert _stats() == (0, 2, 0)


def test_detect_cache_entry_dies_with_tensor() -> None:
    cup = _i32([0, 4, 8])
    cu = _i32([0, 4, 8])
    detect_pad_between_seqs(cu, cup)
    entry = thd.padding._cache[(id(cu), id(cup), 1)]
    assert entry.cu_ref() is cu
    del cu
    gc.collect()
    assert entry.cu_ref() is None  # the key can never prove identity again


def test_detect_cache_keeps_no_tensor_alive() -> None:
    cu, cup = _i32([0, 3, 8]), _i32([0, 4, 8])
    refs = [weakref.ref(cu), weakref.ref(cup)]
    detect_pad_between_seqs(cu, cup, cp_size=2)
    del cu, cup
    gc.collect()
    assert all(r() is None for r in refs)


def test_detect_cache_is_lru_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(thd.padding, "DETECTION_CACHE_SIZE", 4)
    pairs = [(_i32([0, n]), _i32([0, n])) for n in range(10)]
    for cu, cup in pairs:
        detect_pad_between_seqs(cu, cup)
    assert detection_stats()["size"] == 4
    detect_pad_between_seqs(*pairs[-1])
    detect_pad_between_seqs(*pairs[0])  # evicted: recomputed
    assert _stats() == (1, 11, 0)


def test_clear_detection_cache_resets_counters() -> None:
    cu, cup = _i32([0, 3]), _i32([0, 4])
    detect_pad_between_seqs(cu, cup)
    detect_pad_between_seqs(cu, cup)
    clear_detection_cache()
    assert detection_stats() == {"hits": 0, "misses": 0, "fallbacks": 0, "size": 0}
    detect_pad_between_seqs(cu, cup)
    assert _stats() == (0, 1, 0)


# ----------------------------------------------------------------------------- capture


def test_detect_capture_miss_returns_safe_answer_without_host_reads(
    capturing: None, no_host_reads: None
) -> None:
    cu, cup = _i32([0, 3, 5, 9]), _i32([0, 3, 5, 9])  # value-equal, but never seen eagerly
    assert detect_pad_between_seqs(cu, cup, cp_size=2) is True
    assert detect_pad_between_seqs(cu, cup) is True
    assert _stats() == (0, 0, 2)
    assert detection_stats()["size"] == 0  # a guess is never cached
    assert detect_pad_between_seqs(cu, cu) is False  # identity needs no read


def test_detect_capture_hit_reuses_warmup_verdict(request: pytest.FixtureRequest) -> None:
    cu, cup = _i32([0, 3, 5, 9]), _i32([0, 3, 5, 9])
    assert detect_pad_between_seqs(cu, cup, cp_size=2) is False  # warm-up runs eagerly
    request.getfixturevalue("capturing")
    request.getfixturevalue("no_host_reads")
    assert detect_pad_between_seqs(cu, cup, cp_size=2) is False  # same as warm-up: same backend
    assert _stats() == (1, 1, 0)


def test_detect_capture_after_refill_falls_back(capturing: None) -> None:
    cu, cup = _i32([0, 3, 5]), _i32([0, 3, 5])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(thd._capture, "is_capturing", lambda: False)
        assert detect_pad_between_seqs(cu, cup) is False
    cu.copy_(_i32([0, 2, 5]))
    assert detect_pad_between_seqs(cu, cup) is True
    assert _stats() == (0, 1, 1)


# ----------------------------------------------------------------------------- explicit value


def test_resolve_explicit_value_wins() -> None:
    cu, cup = _i32([0, 3, 5]), _i32([0, 4, 8])
    assert resolve_pad_between_seqs(False, cu, cup, cp_size=2) is False
    assert resolve_pad_between_seqs(True, cu, cu) is True
    assert _stats() == (0, 0, 0)
    assert resolve_pad_between_seqs(None, cu, cup, cp_size=2) is True
    assert _stats() == (0, 1, 0)


def test_rejects_non_bool_explicit_value() -> None:
    cu = _i32([0, 3])
    with pytest.raises(ThdTypeError, match="pad_between_seqs: expected a bool or None, got Tensor"):
        resolve_pad_between_seqs(torch.tensor(True), cu, cu)  # type: ignore[arg-type]


def test_rejects_bad_metadata() -> None:
    with pytest.raises(ThdTypeError, match=r"detect_pad_between_seqs: cu_seqlens_padded dtype"):
        detect_pad_between_seqs(_i32([0, 3]), torch.tensor([0, 4]))
    with pytest.raises(ThdValueError, match=r"detect_pad_between_seqs: cu_seqlens_padded shape"):
        detect_pad_between_seqs(_i32([0, 3]), _i32([0, 4, 8]))
    with pytest.raises(ThdValueError, match="detect_pad_between_seqs: cp_size"):
        detect_pad_between_seqs(_i32([0, 3]), _i32([0, 4]), cp_size=0)
    assert _stats() == (0, 0, 0)


# ----------------------------------------------------------------------------- valid rows


def _host_valid(cu: list[int], cup: list[int] | None, num_rows: int) -> list[bool]:
    slots = cu if cup is None else cup
    out = [False] * num_rows
    for b in range(len(cu) - 1):
        for t in range(slots[b], slots[b] + cu[b + 1] - cu[b]):
            out[t] = True
    return out


@pytest.mark.parametrize(
    ("cu", "cup", "num_rows"),
    [
        ([0, 3, 5, 9], [0, 4, 8, 12], 16),
        ([0, 3, 3, 7], [0, 4, 4, 8], 8),
        ([0, 5, 13], [0, 8, 16], 16),
        ([0, 0, 0], [0, 0, 4], 6),
        ([0], [0], 3),
        ([0, 2, 5], None, 7),
        ([0, 0], [0, 0], 0),
    ],
)
def test_valid_rows_matches_host_walk(cu: list[int], cup: list[int] | None, num_rows: int) -> None:
    got = valid_rows(_i32(cu), None if cup is None else _i32(cup), num_rows)
    assert got.dtype == torch.bool and got.shape == (num_rows,)
    assert got.tolist() == _host_valid(cu, cup, num_rows)


def test_valid_rows_is_device_side(no_host_reads: None) -> None:
    mask = valid_rows(_i32([0, 3, 5]), _i32([0, 4, 8]), 12)
    assert mask.shape == (12,)


def test_rejects_bad_num_rows_in_valid_rows() -> None:
    with pytest.raises(ThdValueError, match=r"valid_rows: num_rows: expected an int >= 0, got -1"):
        valid_rows(_i32([0, 3]), None, -1)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_detect_on_cuda_and_cache_hit_is_sync_free() -> None:
    cu, cup = _i32([0, 3, 5, 9], "cuda"), _i32([0, 3, 5, 9], "cuda")
    assert detect_pad_between_seqs(cu, cup, cp_size=2) is False
    assert detect_pad_between_seqs(_i32([0, 3, 5], "cuda"), _i32([0, 3, 8], "cuda"), cp_size=2) is True
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert detect_pad_between_seqs(cu, cup, cp_size=2) is False  # hit: no device read
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert valid_rows(cu, _i32([0, 4, 8, 12], "cuda"), 16).tolist() == _host_valid(
        [0, 3, 5, 9], [0, 4, 8, 12], 16
    )
