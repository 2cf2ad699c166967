"""Document-aware CP (thd.cp.plan_documents, document_layout, document_attention).

The planner is checked against its contract on random length distributions (hypothesis); the
attention on spawned gloo ranks against :func:`thd.reference.attention` on the global batch.
"""

from __future__ import annotations

import pytest

from tests.cp._dist import spawn
from tests.cp._documents_worker import worker


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_document_attention_matches_reference_gloo(world: int) -> None:
    spawn(worker, world, 11 * world, 3, (0, 1, 2, 3), True, timeout_s=300)
