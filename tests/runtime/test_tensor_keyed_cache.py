"""``thd._runtime.tensor_keyed_cache``: a value is reused only for the same, unchanged tensors and
an equal rest of the key; capture and inference tensors always build; the oldest entry goes first."""

from __future__ import annotations

import torch

from thd._runtime.tensor_keyed_cache import TensorKeyedCache


class _Builds:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        return self.calls


def test_same_unchanged_tensors_and_equal_rest_hit() -> None:
    cache: TensorKeyedCache[int] = TensorKeyedCache(4)
    build = _Builds()
    a, b = torch.zeros(3), torch.ones(2)
    first = cache.get_or_build((a, b), ("x", 1000), build, capturing=False)
    assert cache.get_or_build((a, b), ("x", int("1000")), build, capturing=False) == first
    assert build.calls == 1 and cache.counts == {"misses": 1, "hits": 1}
    assert cache.get_or_build((a, b), ("y", 1000), build, capturing=False) != first  # another rest
    a.add_(1)  # written in place: a new version
    assert cache.get_or_build((a, b), ("x", 1000), build, capturing=False) not in (first, 2)
    assert cache.get_or_build((a.clone(), b), ("x", 1000), build, capturing=False) == 4  # equal, not same
    assert build.calls == 4


def test_capture_and_inference_tensors_always_build() -> None:
    cache: TensorKeyedCache[int] = TensorKeyedCache(4)
    build = _Builds()
    a = torch.zeros(3)
    cache.get_or_build((a,), (), build, capturing=True)
    cache.get_or_build((a,), (), build, capturing=True)
    with torch.inference_mode():
        frozen = torch.zeros(3)
    cache.get_or_build((frozen,), (), build, capturing=False)
    cache.get_or_build((frozen,), (), build, capturing=False)
    assert build.calls == 4 and cache.counts == {"capturing": 2, "uncached": 2}
    assert cache.get_or_build((a,), (), build, capturing=False) == 5  # capture kept nothing


def test_the_least_recently_used_entry_goes_first_and_clear_resets() -> None:
    cache: TensorKeyedCache[int] = TensorKeyedCache(2)
    build = _Builds()
    t1, t2, t3 = torch.zeros(1), torch.zeros(1), torch.zeros(1)
    v1 = cache.get_or_build((t1,), (), build, capturing=False)
    cache.get_or_build((t2,), (), build, capturing=False)
    assert cache.get_or_build((t1,), (), build, capturing=False) == v1  # t1 now the most recent
    cache.get_or_build((t3,), (), build, capturing=False)  # evicts t2
    assert cache.get_or_build((t1,), (), build, capturing=False) == v1
    assert cache.get_or_build((t2,), (), build, capturing=False) == 4
    cache.clear()
    assert not cache.counts and cache.get_or_build((t1,), (), build, capturing=False) == 5


def test_an_unhashable_rest_always_builds() -> None:
    cache: TensorKeyedCache[int] = TensorKeyedCache(4)
    build = _Builds()
    a = torch.zeros(3)
    assert [cache.get_or_build((a,), (["list"],), build, capturing=False) for _ in range(2)] == [1, 2]
    assert cache.counts == {"uncached": 2}
