"""Regressions of issue 11: hostile archives are refused by ``verify`` and ``repack`` alike.

Every case runs both commands through the CLI: exit 1, one ``ERROR:`` line, the same issue code
from both, the input byte-identical and nothing left in the output directory.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from release.errors import WheelVerificationError
from release.record import MAX_FIELD
from release.repack import repack_wheel
from release.verify import inspect_wheel, verify_wheel
from tests.release import zipcraft
from tests.release.wheelkit import (
    REPO,
    assert_clean_failure,
    foo_members,
    run_cli,
    write_zip,
)

NAME = "foo-0.3.0.dev0-py3-none-any.whl"
DI = "foo-0.3.0.dev0.dist-info"
META = f"{DI}/METADATA".encode()
TARGET = "py3-none-manylinux_2_28_x86_64"
STORED = zipfile.ZIP_STORED


def wheel(tmp_path: Path, members=None, compression: int = zipfile.ZIP_DEFLATED, **kwargs) -> Path:
    (tmp_path / "in").mkdir(exist_ok=True)
    return write_zip(tmp_path / "in" / NAME, members or foo_members(**kwargs), compression=compression)


def mutant(tmp_path: Path, data: bytes) -> Path:
    (tmp_path / "in").mkdir(exist_ok=True)
    path = tmp_path / "in" / NAME
    path.write_bytes(data)
    return path


def refused(path: Path, code: str) -> None:
    """Both commands fail cleanly with ``code``; the input and its directory stay as they were."""
    before, listing = path.read_bytes(), sorted(path.parent.iterdir())
    out = path.parent.parent / "out"
    for argv in (
        ["verify", str(path)],
        ["repack", str(path), "--name", "foo-cu12", "--tag", TARGET, "--outdir", str(out)],
    ):
        rc, _, err = run_cli(argv)
        assert_clean_failure(rc, err, code)
    assert path.read_bytes() == before and sorted(path.parent.iterdir()) == listing
    assert not out.exists()


def test_same_length_metadata_edit(tmp_path: Path) -> None:
    path = wheel(tmp_path, compression=STORED, meta_extra=["Requires-Dist: bar>=1"])
    data = path.read_bytes()
    meta = zipcraft.member_bytes(data, META)
    evil = meta.replace(b"bar>=1", b"evil<9")
    mutant(tmp_path, zipcraft.replace_stored(data, META, evil))  # CRC fixed: only RECORD can tell
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None and zf.read(META.decode()) == evil
    refused(path, "record-hash")
    _, issues = inspect_wheel(path)
    assert [(i.code, i.where) for i in issues] == [("record-hash", META.decode())]


@pytest.mark.parametrize("member", ["METADATA", "WHEEL"])
def test_rewritten_members_checked_before_repack(tmp_path: Path, member: str) -> None:
    members = foo_members()
    name = f"{DI}/{member}"
    members = [(n, d + b"X-Evil: 1\n" if n == name else d) for n, d in members]  # old RECORD kept
    refused(wheel(tmp_path, members), "record-hash")


@pytest.mark.parametrize(("kind", "delta", "code"), [
    ("central", -1, "zip-mismatch"),
    ("central", 1, "zip-mismatch"),
    ("local", -1, "zip-mismatch"),
    ("both", -1, "zip-outside-data"),  # one byte of the member is claimed by no record
    ("both", 1, "bad-zip"),  # the member would swallow the next local header
])  # fmt: skip
def test_wrong_compressed_size(tmp_path: Path, kind: str, delta: int, code: str) -> None:
    data = wheel(tmp_path).read_bytes()
    name = b"foo/data.bin"
    csize = zipcraft.Layout(data).get("central", name, "csize")
    refused(mutant(tmp_path, zipcraft.patch(data, kind, name, "csize", csize + delta)), code)


def test_bad_local_header_signature(tmp_path: Path) -> None:
    data = bytearray(wheel(tmp_path).read_bytes())
    start = zipcraft.Layout(bytes(data)).local[b"foo/data.bin"].start
    data[start + 2] = 0x09
    refused(mutant(tmp_path, bytes(data)), "bad-zip")


@pytest.mark.parametrize("cut", [0.3, 0.6, 0.97])
def test_truncated(tmp_path: Path, cut: float) -> None:
    data = wheel(tmp_path).read_bytes()
    refused(mutant(tmp_path, data[: int(len(data) * cut)]), "bad-zip")


@pytest.mark.parametrize("method", [zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA])
def test_bzip2_and_lzma_refused_by_both(tmp_path: Path, method: int) -> None:
    path = wheel(tmp_path, compression=method)
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None  # a valid archive, only the method is refused
    refused(path, "zip-method")


def test_unsupported_method_number(tmp_path: Path) -> None:
    data = wheel(tmp_path, compression=STORED).read_bytes()
    refused(mutant(tmp_path, zipcraft.patch(data, "both", b"foo/__init__.py", "method", 99)), "zip-method")


def test_invalid_utf8_name_with_flag(tmp_path: Path) -> None:
    data = wheel(tmp_path, extra_files=[("foo/\u00e9.py", b"x")]).read_bytes()
    refused(
        mutant(tmp_path, zipcraft.rename(data, "foo/\u00e9.py".encode(), b"foo/\xff\xfe.py")), "name-encoding"
    )


def test_non_ascii_name_without_flag(tmp_path: Path) -> None:
    data = wheel(tmp_path, extra_files=[("foo/\u00e9.py", b"x")]).read_bytes()
    flags = zipcraft.Layout(data).get("central", "foo/\u00e9.py".encode(), "flags")
    refused(
        mutant(tmp_path, zipcraft.patch(data, "both", "foo/\u00e9.py".encode(), "flags", flags & ~0x800)),
        "name-encoding",
    )


def test_record_field_over_128_kib(tmp_path: Path) -> None:
    members = foo_members()
    members[-1] = (members[-1][0], members[-1][1] + b"x" * (129 << 10) + b",,\n")
    refused(wheel(tmp_path, members), "record-parse")
    assert MAX_FIELD < 129 << 10


@pytest.mark.parametrize("size", ["+12", "1_2", "\u0661\u0662", " 12", "012", "12.0", "0x1"])
def test_record_size_strict(tmp_path: Path, size: str) -> None:
    members = foo_members()
    rec = members[-1][1].replace(b",10\n", f",{size}\n".encode(), 1)  # foo/__init__.py is 10 bytes
    assert rec != members[-1][1]
    members[-1] = (members[-1][0], rec)
    refused(wheel(tmp_path, members), "record-parse")


@pytest.mark.parametrize(("local", "central"), [(b"../six", b"xx/six"), (b"/ix.py", b"six.py")])
def test_local_name_differs_from_central(tmp_path: Path, local: bytes, central: bytes) -> None:
    data = wheel(tmp_path, extra_files=[(central.decode(), b"import os\n")]).read_bytes()
    refused(mutant(tmp_path, zipcraft.rename(data, central, local, "local")), "zip-mismatch")


@pytest.mark.parametrize(
    ("bit", "code"),
    [(0x20, "zip-flags"), (0x08, "zip-flags"), (0x01, "encrypted-entry"), (0x4000, "zip-flags")],
)
def test_refused_flag_bits(tmp_path: Path, bit: int, code: str) -> None:
    data = wheel(tmp_path).read_bytes()
    refused(mutant(tmp_path, zipcraft.patch(data, "both", b"foo/data.bin", "flags", bit)), code)


def test_flags_differ_between_headers(tmp_path: Path) -> None:
    data = wheel(tmp_path, extra_files=[("foo/\u00e9.py", b"x")]).read_bytes()
    refused(
        mutant(tmp_path, zipcraft.patch(data, "local", "foo/\u00e9.py".encode(), "flags", 0)), "zip-mismatch"
    )


@pytest.mark.parametrize(("field", "value"), [("crc", 1), ("usize", 1), ("method", 0), ("csize", 3)])
def test_local_fields_differ(tmp_path: Path, field: str, value: int) -> None:
    data = wheel(tmp_path).read_bytes()
    refused(mutant(tmp_path, zipcraft.patch(data, "local", b"foo/data.bin", field, value)), "zip-mismatch")


@pytest.mark.parametrize("field", ["crc", "usize"])
def test_wrong_crc_or_size_in_both_headers(tmp_path: Path, field: str) -> None:
    data = wheel(tmp_path).read_bytes()
    value = zipcraft.Layout(data).get("central", b"foo/data.bin", field)
    refused(mutant(tmp_path, zipcraft.patch(data, "both", b"foo/data.bin", field, value + 1)), "bad-zip")


def test_junk_before_first_local_header(tmp_path: Path) -> None:
    data = wheel(tmp_path).read_bytes()
    shifted = zipcraft.insert(data, 0, b"#!/bin/sh\nexit 0\n")  # offsets fixed: zipfile reads it fine
    with zipfile.ZipFile(mutant(tmp_path, shifted)) as zf:
        assert zf.testzip() is None
    refused(mutant(tmp_path, shifted), "zip-outside-data")
    refused(mutant(tmp_path, b"JUNK" + data), "zip-outside-data")  # offsets not fixed


def test_gap_between_members(tmp_path: Path) -> None:
    data = wheel(tmp_path).read_bytes()
    layout = zipcraft.Layout(data)
    refused(
        mutant(tmp_path, zipcraft.insert(data, layout.local[b"foo/data.bin"].start, b"\0" * 7)),
        "zip-outside-data",
    )
    refused(mutant(tmp_path, zipcraft.insert(data, layout.cd_offset, b"hidden")), "zip-outside-data")


@pytest.mark.parametrize("tail", [b"x", b"PK\x03\x04trailing", b"\0" * 1000])
def test_junk_after_end_record(tmp_path: Path, tail: bytes) -> None:
    refused(mutant(tmp_path, wheel(tmp_path).read_bytes() + tail), "zip-outside-data")


def test_archive_comment(tmp_path: Path) -> None:
    refused(
        mutant(tmp_path, zipcraft.set_comment(wheel(tmp_path).read_bytes(), b"hello")), "zip-outside-data"
    )


def test_directory_entries(tmp_path: Path) -> None:
    members = foo_members(extra_files=[("foo/sub/", b"")])
    verify_wheel(wheel(tmp_path, members))  # an empty directory entry is fine
    data = wheel(tmp_path, foo_members(extra_files=[("foo/sub/", b"data")]), compression=STORED).read_bytes()
    refused(mutant(tmp_path, data), "zip-directory")
    data = wheel(tmp_path, members).read_bytes()
    refused(mutant(tmp_path, zipcraft.rename(data, b"foo/sub/", b"../subd/", "local")), "zip-mismatch")
    data = wheel(tmp_path, foo_members(extra_files=[("foo/sub/", b"hidden")])).read_bytes()
    data = zipcraft.patch(data, "both", b"foo/sub/", "usize", 0)  # declares nothing, holds 6 bytes
    refused(mutant(tmp_path, data), "bad-zip")


def test_nul_in_member_name(tmp_path: Path) -> None:
    data = wheel(tmp_path, extra_files=[("foo/ab.py", b"x = 1\n")]).read_bytes()
    refused(mutant(tmp_path, zipcraft.rename(data, b"foo/ab.py", b"foo/a\0.py")), "unsafe-path")
    with zipfile.ZipFile(tmp_path / "in" / NAME) as zf:
        assert "foo/a" in zf.namelist()  # what zipfile makes of it: the NUL and all after it are gone


def test_duplicate_names(tmp_path: Path) -> None:
    data = wheel(tmp_path, extra_files=[("foo/m1.py", b"a"), ("foo/m2.py", b"b")]).read_bytes()
    refused(mutant(tmp_path, zipcraft.rename(data, b"foo/m2.py", b"foo/m1.py")), "duplicate-entry")


@pytest.mark.parametrize(("kind", "field"), [("central", "csize"), ("both", "usize"), ("local", "csize")])
def test_zip64_marker_without_extra(tmp_path: Path, kind: str, field: str) -> None:
    data = wheel(tmp_path).read_bytes()
    refused(mutant(tmp_path, zipcraft.patch(data, kind, b"foo/data.bin", field, 0xFFFFFFFF)), "bad-zip")


def test_end_record_count_marker(tmp_path: Path) -> None:
    data = wheel(tmp_path).read_bytes()
    refused(mutant(tmp_path, zipcraft.patch(data, "eocd", b"", "count", 0xFFFF)), "bad-zip")


def test_zip64_archives_accepted_and_repacked(tmp_path: Path) -> None:
    path = write_zip(tmp_path / NAME, foo_members(), zip64=True)
    assert b"\x01\x00\x10\x00" in path.read_bytes()  # zip64 extras in the local headers
    verify_wheel(path)
    out = repack_wheel(path, name="foo-cu12", tags=TARGET, outdir=tmp_path / "o").output
    verify_wheel(out)


def test_path_conflict(tmp_path: Path) -> None:
    refused(
        wheel(tmp_path, foo_members(extra_files=[("foo/x", b"1"), ("foo/x/y.py", b"2")])), "path-conflict"
    )


def test_record_quoting_strict(tmp_path: Path) -> None:
    members = foo_members()
    rec = members[-1][1].replace(b"foo/__init__.py,", b'"foo/__init__.py"x,', 1)
    members[-1] = (members[-1][0], rec)
    refused(wheel(tmp_path, members), "record-parse")


def test_record_missing_size(tmp_path: Path) -> None:
    members = foo_members()
    members[-1] = (members[-1][0], members[-1][1].replace(b",10\n", b",\n", 1))
    refused(wheel(tmp_path, members), "record-size")


def test_control_character_in_name(tmp_path: Path) -> None:
    data = wheel(tmp_path, extra_files=[("foo/ab.py", b"x = 1\n")]).read_bytes()
    refused(mutant(tmp_path, zipcraft.rename(data, b"foo/ab.py", b"foo/a\n.py")), "unsafe-path")


def test_cli_subprocess_has_no_traceback(tmp_path: Path) -> None:
    path = wheel(tmp_path, compression=zipfile.ZIP_LZMA)
    for argv in (["verify", str(path)], ["repack", str(path), "--name", "x", "--tag", TARGET]):
        proc = subprocess.run(
            [sys.executable, "-m", "release", *argv], cwd=REPO, capture_output=True, text=True, check=False
        )
        assert_clean_failure(proc.returncode, proc.stderr, "zip-method")


def test_repack_output_reads_the_same_everywhere(tmp_path: Path) -> None:
    from tests.release.test_fuzz import OutputChecks

    src = wheel(tmp_path, foo_members(extra_files=[("foo/\u00e9.py", b"x = 1\n"), ("foo/sub/", b"")]))
    out = repack_wheel(src, name="foo-cu12", tags=TARGET, outdir=tmp_path / "o").output
    OutputChecks(tmp_path)(out)  # verify, zipfile.testzip, installer (RECORD validated), unzip -t


def test_input_changed_after_the_static_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Member bytes swapped in after the header checks are the bytes hashed: they cannot get signed."""
    from release.verify import WheelChecker

    path = wheel(tmp_path, compression=STORED)
    data = path.read_bytes()
    swapped = zipcraft.replace_stored(data, b"foo/__init__.py", b"VALUE = 6\n")
    real = WheelChecker.check_static

    def check_then_swap(self, archive):
        real(self, archive)
        path.write_bytes(swapped)  # same inode: the open archive reads the new bytes

    monkeypatch.setattr(WheelChecker, "check_static", check_then_swap)
    with pytest.raises(WheelVerificationError) as exc_info:
        repack_wheel(path, name="foo-cu12", tags=TARGET, outdir=tmp_path / "o")
    assert exc_info.value.codes <= {"record-hash", "bad-zip"} and exc_info.value.codes
    assert "foo/__init__.py" in str(exc_info.value.issues[0])
    assert not (tmp_path / "o").exists()


def test_unwritable_output_is_a_clean_error(tmp_path: Path) -> None:
    path = wheel(tmp_path)
    (tmp_path / "file").write_text("not a directory")
    rc, _, err = run_cli(
        ["repack", str(path), "--name", "x", "--tag", TARGET, "--outdir", str(tmp_path / "file" / "o")]
    )
    assert_clean_failure(rc, err)
    assert "cannot write the output" in err
