"""RECORD parsing and serialization."""

from __future__ import annotations

import pytest

from release.record import Hash, RecordEntry, RecordParseError, parse_record, serialize_record


def test_empty_file_hash() -> None:
    assert str(Hash.of_bytes(b"")) == "sha256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU"


def test_crlf_and_quoted_comma() -> None:
    data = b'"foo/a,b.py",sha256=abc,3\r\nfoo/c.py,sha256=def,4\r\nfoo-1.0.dist-info/RECORD,,\r\n'
    entries = parse_record(data)
    assert [e.path for e in entries] == ["foo/a,b.py", "foo/c.py", "foo-1.0.dist-info/RECORD"]
    assert entries[0].hash == Hash("sha256", "abc")
    assert entries[0].size == 3
    assert entries[2].hash is None and entries[2].size is None
    out = serialize_record(entries)
    assert out == b'"foo/a,b.py",sha256=abc,3\nfoo/c.py,sha256=def,4\nfoo-1.0.dist-info/RECORD,,\n'
    assert parse_record(out) == entries


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"a,sha256=x\n", "row 1: expected 3 fields"),
        (b"a,sha256=x,1\nb,sha256=y,big\n", r"row 2 \('b'\): size"),
        (b"a,sha256=x,-1\n", "ASCII digits"),
        (b"a,nohash,1\n", "algorithm=urlsafe-base64 digest"),
        (b",sha256=x,1\n", "empty path"),
        (b"\xff,,\n", "not UTF-8"),
    ],
)
def test_parse_errors(data: bytes, match: str) -> None:
    with pytest.raises(RecordParseError, match=match):
        parse_record(data)


def test_entry_roundtrip() -> None:
    entry = RecordEntry.from_elements("x.py", "sha512=abc", "10")
    assert entry.to_row() == ("x.py", "sha512=abc", "10")
