"""Document-aware CP attention (thd.cp.document_attention) on spawned gloo ranks.

Each rank checks its buffer against :func:`thd.reference.attention` on the global batch
(forward, backward, variants, GQA, NaN-poisoned padding; see :mod:`tests.cp._documents_worker`).
CI runs 2 and 3 ranks; ``THD_TEST_CP_WORLDS=2,3,4,8`` runs more (8 processes on 2 cores take
minutes).
"""

from __future__ import annotations

import os

import pytest

from tests.cp._dist import spawn
from tests.cp._documents_worker import worker

WORLDS = [int(w) for w in os.environ.get("THD_TEST_CP_WORLDS", "2,3").split(",")]


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLDS)
def test_document_attention_matches_reference_gloo(world: int) -> None:
    spawn(worker, world, 11 * world, 3, (0, 1, 2, 3), True, timeout_s=150 + 60 * world)
