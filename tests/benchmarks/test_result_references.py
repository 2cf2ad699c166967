"""Every result file the docs and the README name in backticks (``name.json``, ``.txt``, ``.png``,
with or without ``benchmarks/results/``) is committed under ``benchmarks/results/``; the release
tool's own file names (``VERSION.txt``, ``release.json``) are not results."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
NAMED = re.compile(r"`(?:benchmarks/results/)?(\w[\w.+-]*\.(?:json|txt|png))`")
NOT_RESULTS = {"VERSION.txt", "release.json"}
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), RESULTS / "README.md"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_result_files_exist(doc: Path) -> None:
    named = set(NAMED.findall(doc.read_text()))
    committed = {p.name for p in RESULTS.iterdir()}
    missing = sorted(n for n in named - NOT_RESULTS if n not in committed)
    assert not missing, f"{doc.name} names result files that are not committed: {missing}"
