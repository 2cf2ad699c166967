"""Release set: metapackage, set checks (spec §4 cases 39, 40), and the full ``release``
flow on a project copy cross-checked with installer, ``wheel tags``, check-wheel-contents
and ``twine check --strict``."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from installer.sources import WheelFile, _WheelFileValidationError
from packaging.version import Version

from release.errors import InvalidVersionInput, ReleaseError
from release.flavors import Flavor, FlavorTable, load_flavors
from release.metadata import get_all
from release.release_set import check_release_set, make_release, write_metapackage
from release.repack import repack_wheel
from release.verify import verify_wheel
from tests.release.wheelkit import foo_members, install_and_query, project_copy, write_zip

TARGET = "py3-none-manylinux_2_28_x86_64"
TABLE = FlavorTable(
    "foo",
    "foo metapackage",
    "cu12",
    (Flavor("cu12", "foo-cu12", TARGET, ()), Flavor("cu13", "foo-cu13", TARGET, ())),
)


def synthetic_set(tmp_path: Path, versions=("2.20.0.dev0", "2.20.0.dev0")) -> list:
    reports = []
    for flavor, version in zip(TABLE.flavors, versions, strict=True):
        d = tmp_path / f"in-{flavor.extra}"
        d.mkdir()
        src = write_zip(d / f"foo-{version}-py3-none-any.whl", foo_members(version=version))
        reports.append(
            verify_wheel(repack_wheel(src, name=flavor.name, tags=TARGET, outdir=tmp_path / "o").output)
        )
    reports.append(verify_wheel(write_metapackage(tmp_path / "o", TABLE, Version(versions[0]), None)))
    return reports


def test_metapackage_pins_exact_normalized_version(tmp_path: Path) -> None:
    tmp_path.joinpath("o").mkdir()
    path = write_metapackage(tmp_path / "o", TABLE, Version("01.02.000-dev0"), 0)
    assert path.name == "foo-1.2.0.dev0-py3-none-any.whl"
    report = verify_wheel(path, release=True)
    assert report.files == [
        "foo-1.2.0.dev0.dist-info/METADATA",
        "foo-1.2.0.dev0.dist-info/WHEEL",
        "foo-1.2.0.dev0.dist-info/RECORD",
    ]
    with zipfile.ZipFile(path) as zf:
        meta = zf.read("foo-1.2.0.dev0.dist-info/METADATA")
    assert get_all(meta, "Requires-Dist") == [
        'foo-cu12==1.2.0.dev0; extra == "cu12"',
        'foo-cu13==1.2.0.dev0; extra == "cu13"',
    ]
    assert get_all(meta, "Provides-Extra") == ["cu12", "cu13"]


def test_release_set_ok(tmp_path: Path) -> None:  # case 39
    assert check_release_set(synthetic_set(tmp_path), "2.20.0.dev0", TABLE) == []


def test_version_string_mismatch(tmp_path: Path) -> None:  # case 40
    reports = synthetic_set(tmp_path, versions=("2.20.0", "2.20.0.0"))
    issues = check_release_set(reports, "2.20.0", TABLE)
    assert "version-string-mismatch" in {i.code for i in issues}
    assert "pin-mismatch" in {i.code for i in issues}  # the cu13 pin ==2.20.0 names 2.20.0.0


def test_pin_unresolved(tmp_path: Path) -> None:
    reports = synthetic_set(tmp_path)
    issues = check_release_set([r for r in reports if r.name != "foo-cu13"], None, TABLE)
    assert [i.code for i in issues] == ["pin-unresolved"]
    assert "foo-cu13" in str(issues[0])


def test_shared_file_between_coinstallable_wheels(tmp_path: Path) -> None:
    reports = synthetic_set(tmp_path)
    bar = write_zip(
        tmp_path / "bar-2.20.0.dev0-py3-none-any.whl", foo_members(name="bar", version="2.20.0.dev0")
    )
    issues = check_release_set([*reports, verify_wheel(bar)], None, TABLE)
    assert {i.code for i in issues} == {"shared-file"}
    assert any("foo/__init__.py" in str(i) for i in issues)


def test_flavor_table(tmp_path: Path) -> None:
    table = load_flavors()
    assert [(f.extra, f.name, f.tags) for f in table.flavors] == [
        ("cu12", "thd-kernels-cu12", TARGET),
        ("cu13", "thd-kernels-cu13", TARGET),
    ]
    assert table.metapackage == "thd-kernels" and table.default == "cu12"
    bad = tmp_path / "flavors.json"
    bad.write_text(
        json.dumps(
            {
                "metapackage": "x",
                "default": "a",
                "flavors": [{"extra": "a", "name": "x", "tags": TARGET, "tag": 1}],
            }
        )
    )
    with pytest.raises(ReleaseError, match="unknown keys"):
        load_flavors(bad)


def test_release_refuses_local_version(tmp_path: Path) -> None:
    project = project_copy(tmp_path / "p", "1.0+ABC-1")
    with pytest.raises(InvalidVersionInput, match="local-version"):
        make_release(project, tmp_path / "dist")
    assert not (tmp_path / "dist").exists()


def test_release_refuses_non_empty_outdir(tmp_path: Path) -> None:
    project = project_copy(tmp_path / "p", "1.0")
    (tmp_path / "dist").mkdir()
    (tmp_path / "dist" / "old.whl").write_bytes(b"")
    with pytest.raises(ReleaseError, match="not empty"):
        make_release(project, tmp_path / "dist")


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("release")
    project = project_copy(base / "p", "0.1.0-dev0")
    make_release(project, base / "dist")
    return base / "dist"  # the project copy stays in base / "p" (the real tree may change meanwhile)


EXPECTED = [
    "SHA256SUMS",
    "release.json",
    "thd_kernels-0.1.0.dev0-py3-none-any.whl",
    "thd_kernels-0.1.0.dev0.tar.gz",
    "thd_kernels_cu12-0.1.0.dev0-py3-none-manylinux_2_28_x86_64.whl",
    "thd_kernels_cu13-0.1.0.dev0-py3-none-manylinux_2_28_x86_64.whl",
]


@pytest.mark.slow
def test_release_contents(release_dir: Path) -> None:
    assert sorted(p.name for p in release_dir.iterdir()) == EXPECTED
    sums = (release_dir / "SHA256SUMS").read_text().splitlines()
    for line in sums:
        digest, name = line.split("  ")
        assert hashlib.sha256((release_dir / name).read_bytes()).hexdigest() == digest
    assert len(sums) == 4
    manifest = json.loads((release_dir / "release.json").read_text())
    assert manifest["version"]["normalized"] == "0.1.0.dev0"
    assert manifest["version"]["raw"] == "0.1.0-dev0"
    assert {a["kind"] for a in manifest["artifacts"]} == {"sdist", "flavor", "metapackage"}
    reports = [verify_wheel(p, release=True) for p in sorted(release_dir.glob("*.whl"))]
    assert {r.version for r in reports} == {"0.1.0.dev0"}
    assert not list(release_dir.parent.glob(".release-*"))  # staging removed


@pytest.mark.slow
def test_release_installs(release_dir: Path, tmp_path: Path) -> None:
    wheels = [release_dir / EXPECTED[2], release_dir / EXPECTED[5]]
    got = install_and_query(tmp_path / "venv", wheels, ["thd-kernels", "thd-kernels-cu13"])
    assert got == ["0.1.0.dev0", "0.1.0.dev0", "0.1.0.dev0", False]


@pytest.mark.slow
def test_cross_check_installer(release_dir: Path, make_wheel) -> None:
    for path in release_dir.glob("*.whl"):
        with WheelFile.open(path) as wheel:
            wheel.validate_record(validate_contents=True)
    tampered = foo_members()
    tampered[0] = ("foo/__init__.py", b"tampered\n")
    with (
        WheelFile.open(make_wheel("foo-0.3.0.dev0-py3-none-any.whl", tampered)) as wheel,
        pytest.raises(_WheelFileValidationError, match=r"foo/__init__\.py"),
    ):
        wheel.validate_record(validate_contents=True)  # the control: installer does catch it


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*args], capture_output=True, text=True, cwd=cwd)


@pytest.mark.slow
def test_cross_check_wheel_tags(release_dir: Path, tmp_path: Path, make_wheel) -> None:
    for path in release_dir.glob("*.whl"):
        copy = shutil.copy2(path, tmp_path / path.name)
        proc = _run(sys.executable, "-m", "wheel", "tags", str(copy))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == path.name
    bad = make_wheel("foo-0.3.0.dev0-py3-none-any.whl", tags=["cp310-cp310-linux_x86_64"])
    assert _run(sys.executable, "-m", "wheel", "tags", str(bad)).returncode != 0  # the control


@pytest.mark.slow
def test_cross_check_check_wheel_contents(release_dir: Path) -> None:
    exe = Path(sys.executable).with_name("check-wheel-contents")
    flavors = [str(p) for p in release_dir.glob("thd_kernels_cu*.whl")]
    proc = _run(str(exe), *flavors)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the metapackage has no code by design: only the "empty wheel" checks may fire
    proc = _run(str(exe), "--ignore", "W007,W008", str(release_dir / EXPECTED[2]))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_cross_check_twine(release_dir: Path) -> None:
    exe = Path(sys.executable).with_name("twine")
    files = [str(p) for p in sorted(release_dir.iterdir()) if p.suffix in (".whl", ".gz")]
    proc = _run(str(exe), "check", "--strict", *files)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASSED") == 4


@pytest.mark.slow
def test_release_is_reproducible(release_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = json.loads((release_dir / "release.json").read_text())
    monkeypatch.setenv("SOURCE_DATE_EPOCH", str(manifest["source_date_epoch"]))
    project = shutil.copytree(release_dir.parent / "p", tmp_path / "p")
    make_release(project, tmp_path / "dist")
    for name in EXPECTED[2:3] + EXPECTED[4:]:
        assert (tmp_path / "dist" / name).read_bytes() == (release_dir / name).read_bytes(), name


@pytest.mark.slow
def test_release_from_git_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    project = project_copy(tmp_path / "p", "2.0")
    (project / "stray.whl").write_bytes(b"ignored")
    (project / ".gitignore").write_text("*.whl\nbuild/\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "commit.gpgsign=false"]
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "x", "--date", "@1700000000"]):
        subprocess.run(
            [*git, *cmd],
            cwd=project,
            check=True,
            env={"GIT_COMMITTER_DATE": "@1700000000", "PATH": "/usr/bin:/bin"},
        )
    (project / "src" / "thd" / "py.typed").write_text("changed\n")
    res = make_release(project, tmp_path / "dist")
    manifest = json.loads((tmp_path / "dist" / "release.json").read_text())
    assert manifest["source_date_epoch"] == 1700000000
    assert manifest["git"]["dirty"] is True and len(manifest["git"]["commit"]) == 40
    assert res.warnings and "uncommitted" in res.warnings[0]
    with zipfile.ZipFile(tmp_path / "dist" / "thd_kernels_cu12-2.0-py3-none-manylinux_2_28_x86_64.whl") as zf:
        assert not any(n.endswith(".whl") for n in zf.namelist())
        assert {i.date_time for i in zf.infolist()} == {(2023, 11, 14, 22, 13, 20)}
