"""``thd._runtime.config``: the Gluon backward's settings are parsed with the others, and a bad
value is a ThdValueError naming the variable."""

from __future__ import annotations

import pytest

from thd._runtime.config import Settings
from thd.errors import ThdValueError


def test_gluon_backward_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("THD_GLUON_BWD_CONSUMERS", raising=False)
    monkeypatch.delenv("THD_GLUON_DQ_ATOMIC", raising=False)
    default = Settings.from_environ()
    assert (default.gluon_bwd_consumers, default.gluon_dq_atomic) == (2, None)
    monkeypatch.setenv("THD_GLUON_BWD_CONSUMERS", "1")
    monkeypatch.setenv("THD_GLUON_DQ_ATOMIC", "1")
    chosen = Settings.from_environ()
    assert (chosen.gluon_bwd_consumers, chosen.gluon_dq_atomic) == (1, True)
    monkeypatch.setenv("THD_GLUON_DQ_ATOMIC", "0")
    assert Settings.from_environ().gluon_dq_atomic is False
    monkeypatch.setenv("THD_GLUON_DQ_ATOMIC", "yes")
    with pytest.raises(ThdValueError, match=r"THD_GLUON_DQ_ATOMIC='yes': expected an integer from 0 to 1"):
        Settings.from_environ()
    monkeypatch.delenv("THD_GLUON_DQ_ATOMIC")
    monkeypatch.setenv("THD_GLUON_BWD_CONSUMERS", "3")
    with pytest.raises(ThdValueError, match=r"THD_GLUON_BWD_CONSUMERS='3': expected an integer from 1 to 2"):
        Settings.from_environ()
