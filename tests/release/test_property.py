"""Hypothesis (spec §4 case 43): random valid names and PEP 440 versions survive
repack + verify, and repacking the output again is a byte-identical no-op."""

from __future__ import annotations

import tempfile
import zipfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from release.repack import repack_wheel
from release.verify import inspect_wheel, verify_wheel
from release.wheelname import escape_name, expand_tags
from tests.release.wheelkit import foo_members, write_zip

pytestmark = pytest.mark.property

NAMES = st.from_regex(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,12}[A-Za-z0-9])?", fullmatch=True)
_num = st.integers(0, 999).map(str)
_zpad = st.tuples(st.sampled_from(["", "0", "00"]), _num).map("".join)
_pre = st.tuples(
    st.sampled_from(["a", "b", "rc", "alpha", "beta", "c", "pre", "preview", "RC"]),
    st.sampled_from(["", ".", "-", "_"]),
    _num,
)
_post = st.tuples(st.sampled_from([".post", "-post", "post", "-r", ".rev"]), _num)
_dev = st.tuples(st.sampled_from([".dev", "-dev", "dev", "_dev"]), _num)
_local = st.lists(st.from_regex(r"[A-Za-z0-9]{1,5}", fullmatch=True), min_size=1, max_size=3)


@st.composite
def raw_versions(draw: st.DrawFn) -> str:
    text = draw(st.sampled_from(["", "v", "V"]))
    if draw(st.booleans()):
        text += f"{draw(st.integers(0, 3))}!"
    text += ".".join(draw(st.lists(_zpad, min_size=1, max_size=4)))
    if draw(st.booleans()):
        text += "".join(draw(_pre))
    if draw(st.booleans()):
        text += "".join(draw(_post))
    if draw(st.booleans()):
        text += "".join(draw(_dev))
    if draw(st.booleans()):
        text += "+" + draw(st.sampled_from([".", "-", "_"])).join(draw(_local))
    return text


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(src_name=NAMES, target=NAMES, raw=raw_versions(), multi=st.booleans())
def test_repack_roundtrip(src_name: str, target: str, raw: str, multi: bool) -> None:
    version = str(Version(raw))
    tags = "py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64" if multi else "py3-none-any"
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        (base / "in").mkdir()
        members = foo_members(name=escape_name(src_name), version=version, meta_name=src_name)
        src = write_zip(base / "in" / f"{escape_name(src_name)}-{version}-py3-none-any.whl", members)
        out = repack_wheel(src, name=target, tags=tags, requires=["dep>=1"], outdir=base / "out").output
        name, parsed, build, tagset = parse_wheel_filename(out.name)
        assert (name, parsed, build) == (canonicalize_name(target), Version(raw), ())
        assert tagset == expand_tags(tags)
        assert str(parsed) == version in out.name
        report = verify_wheel(out)
        assert report.dist_info == f"{escape_name(target)}-{version}.dist-info"
        assert canonicalize_name(report.display_name) == canonicalize_name(target)
        data = out.read_bytes()
        again = repack_wheel(out, name=target, tags=tags, requires=["dep>=1"])
        assert not again.written and out.read_bytes() == data
        other = repack_wheel(out, name=target, tags=tags, requires=["dep>=1"], outdir=base / "again").output
        assert other.read_bytes() == data


@SETTINGS
@given(
    names=st.lists(
        st.text(min_size=1, max_size=12).filter(lambda n: not n.endswith("/")), min_size=1, max_size=5
    )
)
def test_verify_never_crashes_on_odd_member_names(names: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        members = foo_members() + [(n, b"x") for n in names]
        path = Path(tmp) / "foo-0.3.0.dev0-py3-none-any.whl"
        try:
            write_zip(path, members)
        except (ValueError, UnicodeEncodeError):
            return  # zipfile itself refuses the name
        _, issues = inspect_wheel(path)
        with zipfile.ZipFile(path) as zf:
            listed = set(zf.namelist())
        unlisted = {i.where for i in issues if i.code == "record-unlisted"}
        assert unlisted <= listed
        assert issues  # every extra member is at least unlisted in RECORD
