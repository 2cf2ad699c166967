"""Wheel file names: escaping, tag sets, build tags, strict parsing."""

from __future__ import annotations

import pytest
from packaging.tags import Tag
from packaging.version import Version

from release.wheelname import (
    compress_tags,
    dist_info_dir,
    escape_name,
    expand_tags,
    format_wheel_name,
    parse_build_tag,
    parse_wheel_name,
    validate_project_name,
)


@pytest.mark.parametrize(
    ("name", "escaped"),
    [
        ("Foo.Bar_baz-cu12", "foo_bar_baz_cu12"),
        ("transformer-engine-cu12", "transformer_engine_cu12"),
        ("thd-kernels", "thd_kernels"),
        ("A", "a"),
    ],
)
def test_escape(name: str, escaped: str) -> None:
    assert escape_name(name) == escaped


@pytest.mark.parametrize("bad", ["", "-foo", "foo-", "foo bar", "foo/bar", "f\u00f6o"])
def test_invalid_names(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid project name"):
        validate_project_name(bad)


def test_multi_tag_expand_and_compress() -> None:
    tags = expand_tags("py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64")
    assert tags == {Tag("py3", "none", "manylinux_2_17_x86_64"), Tag("py3", "none", "manylinux2014_x86_64")}
    assert compress_tags(tags) == "py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64"
    assert expand_tags(["py2-none-any", "py3-none-any"]) == expand_tags("py2.py3-none-any")


def test_non_product_tag_set_refused() -> None:
    with pytest.raises(ValueError, match="cartesian"):
        compress_tags(expand_tags(["cp311-cp311-linux_x86_64", "py3-none-any"]))


@pytest.mark.parametrize("bad", ["py3-none", "py3--any", "py3-none-any-x", "py3.-none-any"])
def test_invalid_tags(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid tag"):
        expand_tags(bad)


def test_build_tags() -> None:
    assert parse_build_tag("1abc") == (1, "abc")
    assert parse_build_tag("7") == (7, "")
    for bad in ("abc", "", "1-2"):
        with pytest.raises(ValueError, match="build tag"):
            parse_build_tag(bad)


def test_format_uses_normalized_parts() -> None:
    v = Version("01.02.000")
    assert (
        format_wheel_name("Foo.Bar", v, (), expand_tags("py3-none-any")) == "foo_bar-1.2.0-py3-none-any.whl"
    )
    assert dist_info_dir("foo-cu12", Version("1!2.0")) == "foo_cu12-1!2.0.dist-info"
    name = format_wheel_name("foo-cu12", Version("0.3.0.dev0"), (1, "abc"), expand_tags("py3-none-any"))
    assert name == "foo_cu12-0.3.0.dev0-1abc-py3-none-any.whl"


def test_parse_keeps_raw_parts() -> None:
    wn = parse_wheel_name("Foo.Bar-v1.0-1abc-py2.py3-none-any.whl")
    assert (wn.name, str(wn.version), wn.build) == ("foo-bar", "1.0", (1, "abc"))
    assert (wn.raw_name, wn.raw_version, wn.raw_build) == ("Foo.Bar", "v1.0", "1abc")
    assert wn.dist_info == "foo_bar-1.0.dist-info"


@pytest.mark.parametrize(
    "bad",
    [
        "foo_cu12-0.3.0-dev0-py3-none-linux_x86_64.whl",  # hyphenated version -> bad build tag
        "transformer-engine-1.0-py3-none-any.whl",
        "foo-1.0-py3-none-any.zip",
        "foo-1.0.whl",
    ],
)
def test_parse_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_wheel_name(bad)
