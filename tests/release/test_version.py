"""VERSION.txt reading and PEP 440 normalization (wheel-release-spec §4 cases 1-11)."""

from __future__ import annotations

from pathlib import Path

import pytest

from release.errors import InvalidVersionInput
from release.version import normalize_version, read_version_file, with_local_label


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [
        ("0.3.0-dev0", "0.3.0.dev0"),
        ("1.14.0.dev", "1.14.0.dev0"),
        ("0.5.0dev", "0.5.0.dev0"),
        ("1.0-dev", "1.0.dev0"),
        ("1.0-rc1", "1.0rc1"),
        ("1.0RC1", "1.0rc1"),
        ("1.0.rc.1", "1.0rc1"),
        ("1.0c1", "1.0rc1"),
        ("1.0preview1", "1.0rc1"),
        ("1.0-1", "1.0.post1"),
        ("1.0-r4", "1.0.post4"),
        ("1.2post", "1.2.post0"),
        ("1.0.post-1", "1.0.post1"),
        ("1.0a1.post2.dev3", "1.0a1.post2.dev3"),
        ("1.0rc1-dev2", "1.0rc1.dev2"),
        ("v1.0", "1.0"),
        ("01.02.000", "1.2.0"),
        ("1!2.0", "1!2.0"),
        ("0!1.0", "1.0"),
        ("1.0+ABC-1", "1.0+abc.1"),
    ],
)
def test_normalize(raw: str, normalized: str) -> None:
    info = normalize_version(raw)
    assert info.normalized == normalized
    assert info.as_dict()["normalized_from"] == (None if raw == normalized else raw)


@pytest.mark.parametrize("text", [" 1.0\r\n", "1.0\t", "\n\n1.0\n\n", "1.0"])
def test_read_strips_whitespace(tmp_path: Path, text: str) -> None:
    path = tmp_path / "VERSION.txt"
    path.write_bytes(text.encode())
    assert read_version_file(path).normalized == "1.0"


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"1.0-\n", "invalid-version.*'1.0-'"),
        (b"latest\n", "invalid-version.*'latest'"),
        (b"1.0+abc+def\n", "invalid-version"),
        (b"1.0 beta\n", "invalid-version.*'1.0 beta'"),
        (b"", "expected one non-empty line"),
        (b"  \n\n", "expected one non-empty line"),
        (b"\xef\xbb\xbf1.0\n", "byte-order mark"),
        ("\uff11.\uff10\n".encode(), "invalid-version"),
        (b"\xff\xfe1\n", "not UTF-8"),
        (b"1.0\n2.0\n", "ambiguous-version.*got 2"),
    ],
)
def test_read_rejects(tmp_path: Path, data: bytes, match: str) -> None:
    path = tmp_path / "VERSION.txt"
    path.write_bytes(data)
    with pytest.raises(InvalidVersionInput, match=match) as exc_info:
        read_version_file(path)
    assert str(path) in str(exc_info.value)
    assert isinstance(exc_info.value, ValueError)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidVersionInput, match="cannot read"):
        read_version_file(tmp_path / "nope.txt")


def test_release_refuses_local() -> None:
    normalize_version("1.0").require_release()
    normalize_version("1!2.0").require_release()
    with pytest.raises(InvalidVersionInput, match=r"local-version.*'1.0\+abc.1'.*PyPI"):
        normalize_version("1.0+ABC-1").require_release()


def test_with_local_label() -> None:
    assert with_local_label(normalize_version("0.1.0-dev0"), "g1A2b3c").normalized == "0.1.0.dev0+g1a2b3c"
    assert with_local_label(normalize_version("1.0+ABC-1"), "g12").normalized == "1.0+abc.1.g12"
    with pytest.raises(InvalidVersionInput):
        with_local_label(normalize_version("1.0"), "bad label")
