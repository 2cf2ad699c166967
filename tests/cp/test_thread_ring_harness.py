"""The threaded-ring harness (``tests/cp/_thread_ring.py``) itself: a rank that never finishes
fails the run with every such rank's stack, so a hang on the GPU names where it hangs."""

from __future__ import annotations

import threading

import pytest

from tests.cp import _thread_ring


def _stuck_in_here(release: threading.Event) -> None:
    release.wait(30)


def test_a_rank_that_never_finishes_fails_with_its_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_thread_ring, "TIMEOUT_S", 0.5)
    release = threading.Event()

    def body(rank: int, comm: _thread_ring.ThreadComm) -> int:
        if rank == 1:
            _stuck_in_here(release)
        return rank

    try:
        with pytest.raises(TimeoutError, match="still running") as info:
            _thread_ring.run_ranks(2, body)
    finally:
        release.set()
    message = str(info.value)
    assert "rank 1:" in message and "_stuck_in_here" in message
    assert "rank 0:" not in message  # finished ranks are not listed
