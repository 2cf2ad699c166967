"""Zip-to-zip rename and retag (spec §4 cases 1, 12-22, 25, 33, 34, 38, 41, 42)."""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
import zipfile
from pathlib import Path

import pytest
from packaging.utils import parse_wheel_filename

from release.errors import RepackError, WheelVerificationError
from release.metadata import get_all, get_first
from release.repack import repack_wheel
from release.verify import Limits, verify_wheel
from release.zipread import ZipArchive
from tests.release.wheelkit import foo_members, record_for, wheel_file, write_zip

TARGET = "py3-none-manylinux_2_28_x86_64"
DI = "foo-0.3.0.dev0.dist-info"


def read(path: Path, member: str) -> bytes:
    with zipfile.ZipFile(path) as zf:
        return zf.read(member)


def names(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as zf:
        return zf.namelist()


def raw_bytes(path: Path, member: str) -> bytes:
    with ZipArchive.open(path) as archive:
        entry = next(e for e in archive.entries if e.name == member)
        return b"".join(archive.iter_raw(entry))


def test_reference_regression(foo_wheel: Path, tmp_path: Path) -> None:  # case 1
    before = foo_wheel.read_bytes()
    res = repack_wheel(foo_wheel, name="foo_cu12", tags=TARGET, outdir=tmp_path / "out")
    out = res.output
    assert out.name == "foo_cu12-0.3.0.dev0-py3-none-manylinux_2_28_x86_64.whl"
    assert parse_wheel_filename(out.name)[:2] == ("foo-cu12", parse_wheel_filename(foo_wheel.name)[1])
    lst = names(out)
    assert "foo_cu12-0.3.0.dev0.dist-info/METADATA" in lst
    assert lst[-1] == "foo_cu12-0.3.0.dev0.dist-info/RECORD"
    assert all(n.startswith("foo_cu12-0.3.0.dev0.dist-info/") for n in lst[-3:])
    meta = read(out, "foo_cu12-0.3.0.dev0.dist-info/METADATA")
    assert get_first(meta, "Version") == "0.3.0.dev0" and get_first(meta, "Name") == "foo_cu12"
    assert get_all(read(out, "foo_cu12-0.3.0.dev0.dist-info/WHEEL"), "Tag") == [TARGET]
    assert foo_wheel.read_bytes() == before
    # unchanged members are copied without recompression
    assert raw_bytes(out, "foo/data.bin") == raw_bytes(foo_wheel, "foo/data.bin")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [out.name]  # no temp file left


@pytest.mark.parametrize("display", ["Foo.Bar_baz-cu12", "foo-bar-baz-cu12"])
def test_display_name(make_wheel, tmp_path: Path, display: str) -> None:  # case 12
    members = foo_members(name="foo_bar_baz", version="1.0", meta_name="Foo.Bar_baz")
    src = make_wheel("foo_bar_baz-1.0-py3-none-any.whl", members)
    out = repack_wheel(src, name=display, tags=TARGET, outdir=tmp_path / "o").output
    assert out.name.startswith("foo_bar_baz_cu12-1.0-")
    assert get_first(read(out, "foo_bar_baz_cu12-1.0.dist-info/METADATA"), "Name") == display


BODY = "Name: transformer_engine\n\nRequires: transformer_engine_torch\n\u00e9\r\n"


@pytest.mark.parametrize("spelling", ["transformer-engine", "transformer_engine"])
def test_only_name_header_changes(make_wheel, tmp_path: Path, spelling: str) -> None:  # cases 13, 14
    extra = ['Requires-Dist: transformer_engine_torch; extra == "pytorch"', "Summary: Name: x"]
    src = make_wheel(
        "transformer_engine-2.0-py3-none-any.whl",
        foo_members(
            name="transformer_engine", version="2.0", meta_name=spelling, body=BODY, meta_extra=extra
        ),
    )
    old = read(src, "transformer_engine-2.0.dist-info/METADATA")
    out = repack_wheel(src, name="transformer-engine-cu12", tags=TARGET, outdir=tmp_path / "o").output
    new = read(out, "transformer_engine_cu12-2.0.dist-info/METADATA")
    assert new == old.replace(f"Name: {spelling}\n".encode(), b"Name: transformer-engine-cu12\n", 1)
    assert new.split(b"\n\n", 1)[1] == BODY.encode()
    assert b"_cu12_torch" not in new


def test_idempotent(foo_wheel: Path, tmp_path: Path) -> None:  # case 15
    kw = {"name": "foo-cu12", "tags": TARGET, "requires": ["nvidia-x>=1"]}
    first = repack_wheel(foo_wheel, outdir=tmp_path / "a", **kw)
    data = first.output.read_bytes()
    again = repack_wheel(first.output, **kw)  # same directory: the target is the input itself
    assert again.written is False and again.output == first.output
    assert first.output.read_bytes() == data
    other = repack_wheel(first.output, outdir=tmp_path / "b", **kw)
    assert other.output.read_bytes() == data
    assert "cu12_cu12" not in " ".join(names(other.output))
    assert get_all(read(other.output, "foo_cu12-0.3.0.dev0.dist-info/METADATA"), "Requires-Dist") == [
        "nvidia-x>=1"
    ]


def test_rename_again(foo_wheel: Path, tmp_path: Path) -> None:  # case 16
    cu12 = repack_wheel(foo_wheel, name="foo_cu12", tags=TARGET, outdir=tmp_path / "a").output
    cu13 = repack_wheel(cu12, name="foo_cu13", tags=TARGET, outdir=tmp_path / "b").output
    assert cu13.name.startswith("foo_cu13-0.3.0.dev0-")
    assert not any("cu12" in n for n in names(cu13))


def test_impure_retag(make_wheel, tmp_path: Path) -> None:  # case 17
    src = make_wheel("foo-0.3.0.dev0-cp311-cp311-linux_x86_64.whl", tags=["cp311-cp311-linux_x86_64"])
    out = repack_wheel(src, name="foo_cu12", tags=TARGET, outdir=tmp_path / "o").output
    wheel = read(out, "foo_cu12-0.3.0.dev0.dist-info/WHEEL")
    assert get_all(wheel, "Tag") == [TARGET]


def test_extension_retag_refused(make_wheel, tmp_path: Path) -> None:  # case 18
    ext = ("foo/_ext.cpython-311-x86_64-linux-gnu.so", b"\x7fELF")
    src = make_wheel(
        "foo-0.3.0.dev0-cp311-cp311-linux_x86_64.whl", tags=["cp311-cp311-linux_x86_64"], extra_files=[ext]
    )
    with pytest.raises(RepackError, match="extension module") as exc_info:
        repack_wheel(src, name="foo_cu12", tags=TARGET, outdir=tmp_path / "o")
    assert exc_info.value.code == "extension-retag"
    assert not (tmp_path / "o").exists()
    out = repack_wheel(src, name="foo_cu12", tags=TARGET, outdir=tmp_path / "o", allow_extension_retag=True)
    verify_wheel(out.output)
    keep = repack_wheel(src, name="foo_cu12", tags="cp311-cp311-manylinux_2_28_x86_64", outdir=tmp_path / "k")
    verify_wheel(keep.output)


def test_multi_tag(foo_wheel: Path, tmp_path: Path) -> None:  # case 19
    tags = "py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64"
    out = repack_wheel(foo_wheel, name="foo_cu12", tags=tags, outdir=tmp_path / "o").output
    assert out.name.endswith("-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl")
    assert get_all(read(out, "foo_cu12-0.3.0.dev0.dist-info/WHEEL"), "Tag") == [
        "py3-none-manylinux2014_x86_64",
        "py3-none-manylinux_2_17_x86_64",
    ]


def test_build_tag_kept(make_wheel, tmp_path: Path) -> None:  # case 20
    src = make_wheel("foo-0.3.0.dev0-1abc-py3-none-any.whl", build="1abc")
    out = repack_wheel(src, name="foo_cu12", tags=TARGET, outdir=tmp_path / "o").output
    assert out.name == "foo_cu12-0.3.0.dev0-1abc-py3-none-manylinux_2_28_x86_64.whl"
    assert get_all(read(out, "foo_cu12-0.3.0.dev0.dist-info/WHEEL"), "Build") == ["1abc"]


def test_tag_mismatch_refused(make_wheel, tmp_path: Path) -> None:  # case 21, as issue 23 decided
    """The WHEEL Tag edited to another tag, RECORD updated to match: verify rejects it, so repack does."""
    src = make_wheel("foo-0.3.0.dev0-py3-none-any.whl", tags=["cp310-cp310-linux_x86_64"])
    with pytest.raises(WheelVerificationError, match="input wheel is not valid") as exc_info:
        repack_wheel(src, name="foo_cu12", tags=TARGET, outdir=tmp_path / "o")
    assert exc_info.value.codes == {"tag-mismatch"}
    assert not (tmp_path / "o").exists()


def test_tampered_input_refused(make_wheel, tmp_path: Path) -> None:  # case 22
    members = foo_members()
    members[0] = ("foo/__init__.py", b"VALUE = 2\n")
    src = make_wheel("foo-0.3.0.dev0-py3-none-any.whl", members)
    with pytest.raises(WheelVerificationError, match="input wheel is not valid") as exc_info:
        repack_wheel(src, name="foo_cu12", tags=TARGET, outdir=tmp_path / "o")
    assert exc_info.value.codes == {"record-hash"}
    assert not (tmp_path / "o").exists()  # refused before anything was created


def test_crlf_record_input(make_wheel, tmp_path: Path) -> None:  # case 25
    members = foo_members(extra_files=[("foo/a,b.txt", b"comma")])
    members[-1] = (members[-1][0], members[-1][1].replace(b"\n", b"\r\n"))
    src = make_wheel("foo-0.3.0.dev0-py3-none-any.whl", members)
    out = repack_wheel(src, name="foo_cu12", tags=TARGET, outdir=tmp_path / "o").output
    record = read(out, "foo_cu12-0.3.0.dev0.dist-info/RECORD")
    assert b"\r\n" not in record and b'"foo/a,b.txt",sha256=' in record


@pytest.mark.parametrize("epoch", [0, 1700000000])
def test_epoch_clamped_and_reproducible(tmp_path: Path, epoch: int) -> None:  # cases 33, 34
    outs = []
    for i, (mode, dt) in enumerate([(0o100600, (1980, 1, 1, 0, 0, 0)), (0o100644, (2024, 5, 6, 7, 8, 10))]):
        extra = [("foo/run.sh", b"#!/bin/sh\n", 0o100775 if i else 0o100700)]
        members = [(m[0], m[1], m[2] if len(m) > 2 else mode) for m in foo_members(extra_files=extra)]
        d = tmp_path / f"s{i}"
        d.mkdir()
        src = write_zip(d / "foo-0.3.0.dev0-py3-none-any.whl", members, date_time=dt)
        outs.append(
            repack_wheel(src, name="foo_cu12", tags=TARGET, outdir=tmp_path / f"o{i}", epoch=epoch).output
        )
    assert outs[0].read_bytes() == outs[1].read_bytes()
    with zipfile.ZipFile(outs[0]) as zf:
        assert zf.testzip() is None
        infos = {i.filename: i for i in zf.infolist()}
    expected = (1980, 1, 1, 0, 0, 0) if epoch == 0 else (2023, 11, 14, 22, 13, 20)
    assert {i.date_time for i in infos.values()} == {expected}
    assert infos["foo/run.sh"].external_attr >> 16 == 0o100755
    assert infos["foo/__init__.py"].external_attr >> 16 == 0o100644


def test_source_date_epoch_env(foo_wheel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    out = repack_wheel(foo_wheel, name="foo_cu12", tags=TARGET, outdir=tmp_path / "o").output
    with zipfile.ZipFile(out) as zf:
        assert {i.date_time for i in zf.infolist()} == {(2023, 11, 14, 22, 13, 20)}
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    with pytest.raises(RepackError, match="SOURCE_DATE_EPOCH"):
        repack_wheel(foo_wheel, name="foo_cu12", tags=TARGET, outdir=tmp_path / "o2")


def test_data_dir_renamed(make_wheel, tmp_path: Path) -> None:  # case 38
    src = make_wheel(
        "foo-0.3.0.dev0-py3-none-any.whl", extra_files=[("foo-0.3.0.dev0.data/headers/x.h", b"int x;\n")]
    )
    out = repack_wheel(src, name="foo_cu12", tags=TARGET, outdir=tmp_path / "o").output
    assert "foo_cu12-0.3.0.dev0.data/headers/x.h" in names(out)
    assert b"foo_cu12-0.3.0.dev0.data/headers/x.h,sha256=" in read(
        out, "foo_cu12-0.3.0.dev0.dist-info/RECORD"
    )


def test_output_collision(foo_wheel: Path, tmp_path: Path) -> None:  # case 41
    out = tmp_path / "o"
    first = repack_wheel(foo_wheel, name="foo_cu12", tags=TARGET, outdir=out).output
    first.write_bytes(b"something else")
    with pytest.raises(RepackError, match="exists with different bytes"):
        repack_wheel(foo_wheel, name="foo_cu12", tags=TARGET, outdir=out)
    assert first.read_bytes() == b"something else"
    res = repack_wheel(foo_wheel, name="foo_cu12", tags=TARGET, outdir=out, overwrite=True)
    assert res.written and verify_wheel(res.output)
    assert sorted(p.name for p in out.iterdir()) == [first.name]


def test_refuses_to_overwrite_input(make_wheel, tmp_path: Path) -> None:
    src = make_wheel("foo_cu12-0.3.0.dev0-py3-none-manylinux_2_28_x86_64.whl", name="foo_cu12", tags=[TARGET])
    before = src.read_bytes()
    with pytest.raises(RepackError, match="overwrite the input"):
        repack_wheel(src, name="foo_cu12", tags=TARGET, requires=["bar"], overwrite=True)
    assert src.read_bytes() == before


def test_dry_run(foo_wheel: Path, tmp_path: Path) -> None:  # case 42
    res = repack_wheel(foo_wheel, name="foo_cu12", tags=TARGET, outdir=tmp_path / "o", dry_run=True)
    assert not res.written and not (tmp_path / "o").exists()
    assert res.plan["dist_info"] == [DI, "foo_cu12-0.3.0.dev0.dist-info"]
    assert res.plan["tags"] == [TARGET]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "foo cu12"}, "invalid project name"),
        ({"tags": "py3-none"}, "invalid tag"),
        ({"requires": ["not a req ;;"]}, "repack"),
        ({"tags": ["cp311-cp311-linux_x86_64", "py3-none-any"]}, "cartesian"),
    ],
)
def test_usage_errors(foo_wheel: Path, kwargs: dict, match: str) -> None:
    args = {"name": "foo_cu12", "tags": TARGET, **kwargs}
    with pytest.raises(RepackError, match=match):
        repack_wheel(foo_wheel, **args)


def test_large_member_streams_in_constant_memory(tmp_path: Path) -> None:
    big = os.urandom(48 << 20)
    members = foo_members(extra_files=[("foo/big.bin", big)])
    src = write_zip(tmp_path / "foo-0.3.0.dev0-py3-none-any.whl", members)
    del big, members
    tracemalloc.start()
    try:
        out = repack_wheel(src, name="foo_cu12", tags=TARGET, outdir=tmp_path / "o").output
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12 << 20, f"peak traced memory {peak / 2**20:.1f} MiB"
    assert raw_bytes(out, "foo/big.bin") == raw_bytes(src, "foo/big.bin")


def test_wheel_file_rendering_keeps_other_fields(make_wheel, tmp_path: Path) -> None:
    src = make_wheel("foo-0.3.0.dev0-py3-none-any.whl")
    out = repack_wheel(src, name="foo_cu12", tags=TARGET, outdir=tmp_path / "o").output
    wheel = read(out, "foo_cu12-0.3.0.dev0.dist-info/WHEEL")
    assert wheel == wheel_file([TARGET]).replace(b"Generator: tests 1.0", b"Generator: tests 1.0")


@pytest.mark.slow
def test_zip64_many_members(tmp_path: Path) -> None:  # case 32: ZIP64 end records (>= 65535 entries)
    extra = [(f"foo/m{i // 1000}/f{i}.py", b"") for i in range(66_000)]
    src = write_zip(tmp_path / "foo-0.3.0.dev0-py3-none-any.whl", foo_members(extra_files=extra))
    out = repack_wheel(src, name="foo_cu12", tags=TARGET, outdir=tmp_path / "o").output
    data = out.read_bytes()
    assert b"PK\x06\x06" in data[-200:] and b"PK\x06\x07" in data[-200:]
    with zipfile.ZipFile(out) as zf:
        assert len(zf.infolist()) == 66_005
        assert zf.testzip() is None
    proc = subprocess.run([sys.executable, "-m", "wheel", "tags", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_crlf_metadata_keeps_line_ends(make_wheel, tmp_path: Path) -> None:
    members = foo_members(body="Long\r\ndescription\r\n")
    members = [
        (n, d.replace(b"\n", b"\r\n").replace(b"\r\r\n", b"\r\n") if n.endswith("METADATA") else d)
        for n, d in members
    ]
    members = [m for m in members if not m[0].endswith("RECORD")]
    members.append((f"{DI}/RECORD", record_for(members, f"{DI}/RECORD")))
    src = make_wheel("foo-0.3.0.dev0-py3-none-any.whl", members)
    out = repack_wheel(src, name="foo_cu12", tags=TARGET, requires=["bar"], outdir=tmp_path / "o").output
    meta = read(out, "foo_cu12-0.3.0.dev0.dist-info/METADATA")
    assert meta.startswith(
        b"Metadata-Version: 2.1\r\nName: foo_cu12\r\nVersion: 0.3.0.dev0\r\nRequires-Dist: bar\r\n"
    )
    assert meta.endswith(b"\r\n\r\nLong\r\ndescription\r\n")


def test_stored_members_strong_hash_and_compressible_data(tmp_path: Path) -> None:
    d = tmp_path / "in"
    d.mkdir()
    members = foo_members(extra_files=[("foo/zeros.bin", bytes(4 << 20))])
    rec_name = f"{DI}/RECORD"
    members[-1] = (rec_name, record_for(members, rec_name, algo="sha512"))
    src = d / "foo-0.3.0.dev0-py3-none-any.whl"
    with zipfile.ZipFile(src, "w") as zf:
        for name, data, *_ in members:
            method = zipfile.ZIP_DEFLATED if name.endswith(".bin") else zipfile.ZIP_STORED
            zf.writestr(name, data, compress_type=method)
    out = repack_wheel(src, name="foo_cu12", tags=TARGET, outdir=tmp_path / "o", limits=Limits(max_ratio=1e6))
    assert raw_bytes(out.output, "foo/zeros.bin") == raw_bytes(src, "foo/zeros.bin")
    assert raw_bytes(out.output, "foo/__init__.py") == b"VALUE = 1\n"  # stored stays stored
    assert b"foo/zeros.bin,sha256=" in read(out.output, "foo_cu12-0.3.0.dev0.dist-info/RECORD")


def test_hash_output_is_the_file_digest(foo_wheel: Path, tmp_path: Path) -> None:
    import hashlib

    res = repack_wheel(foo_wheel, name="foo_cu12", tags=TARGET, outdir=tmp_path / "o", hash_output=True)
    assert res.sha256 == hashlib.sha256(res.output.read_bytes()).hexdigest()
    again = repack_wheel(foo_wheel, name="foo_cu12", tags=TARGET, outdir=tmp_path / "o", hash_output=True)
    assert not again.written and again.sha256 == res.sha256
    assert repack_wheel(foo_wheel, name="foo_cu12", tags=TARGET, outdir=tmp_path / "p").sha256 is None
