"""Verification of synthetic wheels, adversarial ones included (spec §4 cases 20-37).

Every rejection must name the wheel and carry its specific code; the input stays
byte-identical, and ``repack`` refuses the same input without writing anything.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from release.errors import WheelVerificationError
from release.repack import repack_wheel
from release.verify import Limits, check_path, inspect_wheel, verify_wheel
from tests.release.wheelkit import foo_members, metadata, record_for, wheel_file, write_zip

DI = "foo-0.3.0.dev0.dist-info"
NAME = "foo-0.3.0.dev0-py3-none-any.whl"


def rejected(path: Path, code: str, match: str = "", **kwargs) -> None:
    """``verify`` reports ``code``; ``repack`` refuses with exactly verify's codes, writing nothing."""
    before = path.read_bytes()
    _, issues = inspect_wheel(path, **kwargs)
    codes = [i.code for i in issues]
    assert code in codes, issues
    hit = [i for i in issues if i.code == code]
    assert all(i.artifact == path.name for i in hit)
    if match:
        assert any(match in str(i) for i in hit), hit
    with pytest.raises(WheelVerificationError) as exc_info:
        verify_wheel(path, **kwargs)
    assert code in exc_info.value.codes
    outdir = path.parent.parent / "out"
    with pytest.raises(WheelVerificationError) as refused:
        repack_wheel(path, name="foo-cu12", tags="py3-none-manylinux_2_28_x86_64", outdir=outdir, **kwargs)
    assert refused.value.codes == set(codes)
    assert not outdir.exists() or not any(outdir.iterdir())
    assert path.read_bytes() == before


def rebuild(members, replace: dict[str, bytes] | None = None, drop=(), add=(), rerecord: bool = True):
    out = [(m[0], (replace or {}).get(m[0], m[1]), *m[2:]) for m in members if m[0] not in drop]
    out += list(add)
    if rerecord:
        rec = f"{DI}/RECORD"
        out = [m for m in out if m[0] != rec]
        out.append((rec, record_for(out, rec)))
    return out


def test_valid_wheel(foo_wheel: Path) -> None:
    report = verify_wheel(foo_wheel)
    assert (report.name, report.version, report.tags) == ("foo", "0.3.0.dev0", ["py3-none-any"])
    assert report.dist_info == DI
    assert report.warnings == []


@pytest.mark.parametrize(
    ("filename", "code"),
    [
        ("foo-0.3.0-dev0-py3-none-any.whl", "invalid-filename"),
        ("foo.whl", "invalid-filename"),
        ("Foo-0.3.0.dev0-py3-none-any.whl", "filename-not-normalized"),
        ("foo-0.3.0dev0-py3-none-any.whl", "filename-not-normalized"),
    ],
)
def test_filename(make_wheel, filename: str, code: str) -> None:
    rejected(make_wheel(filename), code)


def test_build_tag_mismatch(make_wheel) -> None:  # case 20
    rejected(make_wheel("foo-0.3.0.dev0-1abc-py3-none-any.whl"), "build-mismatch", "expected '1abc'")
    path = make_wheel("foo-0.3.0.dev0-py3-none-any.whl", build="1abc")
    rejected(path, "build-mismatch", "got '1abc'")


def test_tag_mismatch(make_wheel) -> None:  # case 21: refused by repack too (issue 23)
    path = make_wheel(NAME, tags=["cp310-cp310-linux_x86_64"])
    rejected(path, "tag-mismatch", "py3-none-any")


def test_tampered_hash(make_wheel) -> None:  # case 22
    members = rebuild(foo_members(), {"foo/__init__.py": b"VALUE = 2\n"}, rerecord=False)
    rejected(make_wheel(NAME, members), "record-hash", "foo/__init__.py")


def test_unlisted_and_missing(make_wheel) -> None:  # case 23
    members = foo_members()
    members = [m for m in members if m[0] != "foo/data.bin"] + [("foo/extra.py", b"x = 1\n")]
    path = make_wheel(NAME, [*members[:-2], ("foo/extra.py", b"x = 1\n"), members[-2]])
    rejected(path, "record-unlisted", "foo/extra.py")
    rejected(path, "record-missing", "foo/data.bin")


def test_weak_hash(make_wheel) -> None:  # case 24
    members = foo_members()
    members[-1] = (f"{DI}/RECORD", record_for(members, f"{DI}/RECORD", algo="md5"))
    rejected(make_wheel(NAME, members), "weak-hash", "'md5'")


def test_record_directory_row_and_missing_own_row_warn(make_wheel) -> None:  # case 24
    members = foo_members()
    rec = members[-1][1].replace(f"{DI}/RECORD,,\n".encode(), b"foo/,,\n")
    path = make_wheel(NAME, [*members[:-1], (f"{DI}/RECORD", rec)])
    report = verify_wheel(path)
    assert {w.code for w in report.warnings} == {"record-self", "record-directory"}


@pytest.mark.parametrize("missing", ["METADATA", "WHEEL", "RECORD"])
def test_structure_missing_member(make_wheel, missing: str) -> None:  # case 26
    members = [m for m in foo_members() if m[0] != f"{DI}/{missing}"]
    rejected(make_wheel(NAME, members), "structure", f"{DI}/{missing}")


def test_no_dist_info(make_wheel) -> None:  # case 26
    rejected(make_wheel(NAME, [("foo/__init__.py", b"")]), "structure", "no .dist-info")


def test_multiple_dist_info(make_wheel) -> None:  # case 27
    extra = ("bar-1.0.dist-info/METADATA", metadata("bar", "1.0"))
    rejected(make_wheel(NAME, rebuild(foo_members(), add=[extra])), "multiple-dist-info")


def test_dist_info_and_data_names(make_wheel) -> None:
    members = [(m[0].replace(DI, "foo-0.3.0-dev0.dist-info"), m[1]) for m in foo_members()]
    rejected(make_wheel(NAME, members), "dist-info-mismatch", "foo-0.3.0-dev0.dist-info")
    members = rebuild(foo_members(), add=[("foo-0.3.0-dev0.data/headers/x.h", b"")])
    rejected(make_wheel(NAME, members), "data-dir-mismatch")


@pytest.mark.parametrize(
    "evil", ["../evil.py", "foo/../../evil.py", "/abs/path.py", "foo\\bar.py", "C:/x.py", "foo//x.py"]
)
def test_unsafe_paths(make_wheel, evil: str) -> None:  # case 28
    rejected(make_wheel(NAME, rebuild(foo_members(), add=[(evil, b"x")])), "unsafe-path", evil)


def test_check_path() -> None:
    assert check_path("foo/bar.py") is None
    assert check_path("foo/") is None
    assert "absolute" in (check_path("/x") or "")


def test_symlink_entry(make_wheel) -> None:  # case 29
    members = rebuild(foo_members(), add=[("foo/link", b"/etc/passwd", 0o120777)])
    rejected(make_wheel(NAME, members), "symlink-entry", "foo/link")


def test_duplicate_entry(make_wheel) -> None:  # case 30
    members = foo_members()
    members.insert(1, ("foo/__init__.py", b"VALUE = 666\n"))
    rejected(make_wheel(NAME, members), "duplicate-entry", "foo/__init__.py")


def test_case_collision(make_wheel) -> None:  # case 31
    members = rebuild(foo_members(), add=[("foo/A.py", b"a"), ("foo/a.py", b"b")])
    rejected(make_wheel(NAME, members), "case-collision", "foo/a.py")


def test_compression_bomb(make_wheel) -> None:  # case 32 (scaled down)
    members = rebuild(foo_members(), add=[("foo/zeros.bin", bytes(8 << 20))])
    rejected(make_wheel(NAME, members), "too-large", "compression ratio")
    path = make_wheel("foo-0.3.0.dev0-py3-none-any.whl", rebuild(foo_members()))
    rejected(path, "too-large", "uncompressed size", limits=Limits(max_total_size=1000))


def test_version_mismatch(make_wheel) -> None:  # case 35
    members = foo_members(version="1.1")
    members = rebuild(members, {m[0]: metadata("foo", "1.0") for m in members if m[0].endswith("METADATA")})
    path = make_wheel(
        "foo-1.1-py3-none-any.whl", [(m[0].replace(DI, "foo-1.1.dist-info"), m[1]) for m in members]
    )
    rejected(path, "version-mismatch", "expected '1.1' (file name), got '1.0'")


def test_unnormalized_metadata_version(make_wheel) -> None:  # hatchling-style 'Version: 0.1.0-dev0'
    members = rebuild(foo_members(), {f"{DI}/METADATA": metadata("foo", "0.3.0-dev0")})
    rejected(make_wheel(NAME, members), "version-mismatch", "got '0.3.0-dev0'")


def test_name_mismatch(make_wheel) -> None:  # case 36
    members = rebuild(foo_members(), {f"{DI}/METADATA": metadata("bar", "0.3.0.dev0")})
    rejected(make_wheel(NAME, members), "name-mismatch", "got 'bar'")


@pytest.mark.parametrize(
    ("wheel", "code"),
    [
        (b"Wheel-Version: 2.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n", "wheel-version"),
        (b"Wheel-Version: 1.0\nTag: py3-none-any\n", "purelib-missing"),
        (b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py2.py3-none-any\n", "unexpanded-tag"),
    ],
)
def test_wheel_file_fields(make_wheel, wheel: bytes, code: str) -> None:  # case 37
    members = rebuild(foo_members(tags=["py2-none-any", "py3-none-any"]), {f"{DI}/WHEEL": wheel})
    rejected(make_wheel("foo-0.3.0.dev0-py2.py3-none-any.whl", members), code)


def test_release_mode_refuses_local(make_wheel) -> None:
    path = make_wheel("foo-1.0+abc.1-py3-none-any.whl", foo_members(version="1.0+abc.1"))
    verify_wheel(path)
    rejected(path, "local-version", "PyPI", release=True)


def test_installer_files_forbidden(make_wheel) -> None:
    members = rebuild(foo_members(), add=[(f"{DI}/INSTALLER", b"pip\n")])
    rejected(make_wheel(NAME, members), "forbidden-member", "INSTALLER")


def test_not_a_zip(tmp_path: Path) -> None:
    path = tmp_path / NAME
    path.write_bytes(b"not a zip")
    _, issues = inspect_wheel(path)
    assert [i.code for i in issues] == ["bad-zip"]


def test_all_issues_collected(make_wheel) -> None:
    members = rebuild(
        foo_members(), {f"{DI}/METADATA": metadata("bar", "9"), f"{DI}/WHEEL": wheel_file(["py2-none-any"])}
    )
    _, issues = inspect_wheel(write_zip(make_wheel(NAME).parent / NAME, members))
    assert {"name-mismatch", "version-mismatch", "tag-mismatch"} <= {i.code for i in issues}


def test_threaded_hashing_finds_the_same_issues(make_wheel, monkeypatch: pytest.MonkeyPatch) -> None:
    members = foo_members(extra_files=[(f"foo/m{i}.py", b"x = %d\n" % i) for i in range(20)])
    members[5] = (members[5][0], b"x = 9\n")
    members[9] = (members[9][0], b"x = 1\n")
    path = make_wheel(NAME, members)
    sequential = inspect_wheel(path)[1]
    monkeypatch.setattr("release.verify._PARALLEL_MIN", 0)
    threaded = inspect_wheel(path)[1]
    assert threaded == sequential
    assert [i.where for i in threaded] == ["foo/m3.py", "foo/m7.py"]


def test_duplicate_name_header(make_wheel) -> None:
    members = rebuild(foo_members(), {f"{DI}/METADATA": metadata("foo", "0.3.0.dev0", extra=["Name: foo"])})
    rejected(make_wheel(NAME, members), "metadata-invalid", "expected one field, got 2")


@pytest.mark.parametrize(
    ("meta", "code", "match"),
    [
        (b"Name: foo\nVersion: 0.3.0.dev0\n", "metadata-invalid", "Metadata-Version"),
        (b"Metadata-Version: 2.1\nVersion: 0.3.0.dev0\n", "name-mismatch", "no Name field"),
        (b"Metadata-Version: 2.1\nName: foo\n", "version-mismatch", "no Version"),
        (b"Metadata-Version: 2.1\nName: foo\nVersion: latest\n", "version-mismatch", "invalid 'latest'"),
        (b"Metadata-Version: 2.1\nthis is not a header\n", "metadata-invalid", "RFC 822"),
    ],
)
def test_metadata_fields(make_wheel, meta: bytes, code: str, match: str) -> None:
    rejected(make_wheel(NAME, rebuild(foo_members(), {f"{DI}/METADATA": meta})), code, match)


def test_wheel_file_garbage(make_wheel) -> None:
    members = rebuild(foo_members(), {f"{DI}/WHEEL": b"Wheel-Version: 1.0\ngarbage\n"})
    rejected(make_wheel(NAME, members), "wheel-file-invalid")


@pytest.mark.parametrize(
    ("transform", "code"),
    [
        (lambda rec: rec + b"bad,row\n", "record-parse"),
        (lambda rec: rec + rec.splitlines(keepends=True)[0], "record-duplicate"),
        (lambda rec: rec.replace(rec.split(b",")[1], b"", 1), "record-hash"),
        (lambda rec: rec.replace(b"RECORD,,", b"RECORD,sha256=x,1"), "record-self"),
    ],
)
def test_record_rows(make_wheel, transform, code: str) -> None:
    members = foo_members()
    members[-1] = (members[-1][0], transform(members[-1][1]))
    rejected(make_wheel(NAME, members), code)


def test_corrupt_member_data(make_wheel) -> None:
    path = make_wheel(NAME)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("foo/data.bin")
    start = info.header_offset + 30 + len(info.filename) + len(info.extra) + 8
    data[start] ^= 0xFF
    path.write_bytes(bytes(data))
    rejected(path, "bad-zip", "foo/data.bin")


def test_encrypted_flag(make_wheel) -> None:
    path = make_wheel(NAME)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("foo/__init__.py")
    central = data.find(b"PK\x01\x02")
    while data[central + 46 : central + 46 + len(info.filename)] != info.filename.encode():
        central = data.find(b"PK\x01\x02", central + 4)
    data[central + 8] |= 0x1
    path.write_bytes(bytes(data))
    _, issues = inspect_wheel(path)
    assert "encrypted-entry" in {i.code for i in issues}
