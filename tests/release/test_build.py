"""Real builds of this project from a copy in tmp_path, then repack, verify and install.

The real VERSION.txt is never touched: each test copies pyproject.toml, README.md and
src/ and writes its own VERSION.txt.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from release.build import build_project, check_sdist
from release.errors import BuildFailed, WheelVerificationError
from release.flavors import load_flavors
from release.release_set import make_dev_wheel
from release.repack import repack_wheel
from release.verify import verify_wheel
from tests.release.wheelkit import install_and_query, project_copy

VERSIONS = [
    ("0.1.0-dev0", "0.1.0.dev0"),
    ("1.0-rc1", "1.0rc1"),
    ("1.0-1", "1.0.post1"),
    ("v1.0", "1.0"),
    ("01.02.000", "1.2.0"),
    ("1!2.0", "1!2.0"),
    ("1.0+ABC-1", "1.0+abc.1"),  # dev builds only: release refuses local versions
]


@pytest.mark.slow
@pytest.mark.parametrize(("raw", "normalized"), VERSIONS, ids=[v[0] for v in VERSIONS])
def test_round_trip(tmp_path: Path, raw: str, normalized: str) -> None:
    project = project_copy(tmp_path / "p", raw)
    built = build_project(project, tmp_path / "b", sdist=False)
    assert built.wheel.name == f"thd_kernels-{normalized}-py3-none-any.whl"
    assert built.version.raw == raw and built.version.normalized == normalized
    table = load_flavors()
    flavor = table.get(table.default)
    res = repack_wheel(
        built.wheel, name=flavor.name, tags=flavor.tags, requires=flavor.requires, outdir=tmp_path / "o"
    )
    assert res.output.name == f"thd_kernels_cu12-{normalized}-py3-none-manylinux_2_28_x86_64.whl"
    verify_wheel(res.output)
    got = install_and_query(tmp_path / "venv", [res.output], ["thd-kernels-cu12"])
    assert got == [normalized, normalized, False]  # ... and torch was not imported
    assert (project / "VERSION.txt").read_text() == raw + "\n"


@pytest.mark.slow
def test_build_with_sdist(tmp_path: Path) -> None:
    project = project_copy(tmp_path / "p", "0.1.0-dev0")
    built = build_project(project, tmp_path / "b", sdist=True, epoch=1700000000)
    assert built.sdist is not None and built.sdist.name == "thd_kernels-0.1.0.dev0.tar.gz"
    assert check_sdist(built.sdist, "thd-kernels", "0.1.0.dev0") == []
    assert check_sdist(built.sdist, "thd-kernels", "0.1.0") != []
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == sorted([built.sdist.name, built.wheel.name])
    assert not (project / "build").exists() and not list(project.glob("src/*.egg-info"))


@pytest.mark.slow
def test_dev_wheel_with_local_label(tmp_path: Path) -> None:
    project = project_copy(tmp_path / "p", "0.1.0-dev0")
    info, report = make_dev_wheel(project, tmp_path / "dist", local="gABC1234")
    assert info.normalized == "0.1.0.dev0+gabc1234"
    assert report.path.name == "thd_kernels_cu12-0.1.0.dev0+gabc1234-py3-none-manylinux_2_28_x86_64.whl"
    again = make_dev_wheel(project, tmp_path / "dist", local="gABC1234")[1]
    assert again.path == report.path


def test_outdir_must_be_fresh(tmp_path: Path) -> None:
    project = project_copy(tmp_path / "p", "1.0")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "stale.whl").write_bytes(b"")
    with pytest.raises(BuildFailed, match="not empty"):
        build_project(project, tmp_path / "b")


_BACKEND = """
import base64, hashlib, zipfile
def _h(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    raw = open("VERSION.txt").read().strip()
    norm = "0.1.0.dev0"
    di = f"thd_kernels-{norm}.dist-info"
    files = {"thd/__init__.py": b"",
             f"{di}/METADATA": f"Metadata-Version: 2.1\\nName: thd-kernels\\nVersion: {raw}\\n".encode(),
             f"{di}/WHEEL": b"Wheel-Version: 1.0\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"}
    record = "".join(f"{n},{_h(d)},{len(d)}\\n" for n, d in files.items()) + f"{di}/RECORD,,\\n"
    name = f"thd_kernels-{norm}-py3-none-any.whl"
    with zipfile.ZipFile(f"{wheel_directory}/{name}", "w") as zf:
        for n, d in files.items():
            zf.writestr(n, d)
        zf.writestr(f"{di}/RECORD", record)
    return name
def build_sdist(sdist_directory, config_settings=None):
    raise RuntimeError("boom: this backend cannot build sdists")
"""


def _fake_project(tmp_path: Path, requires: str = "[]") -> Path:
    project = tmp_path / "fake"
    project.mkdir()
    (project / "VERSION.txt").write_text("0.1.0-dev0\n")
    (project / "fakebackend.py").write_text(_BACKEND)
    (project / "pyproject.toml").write_text(
        f'[build-system]\nrequires = {requires}\nbuild-backend = "fakebackend"\nbackend-path = ["."]\n'
        '[project]\nname = "thd-kernels"\ndynamic = ["version"]\n'
    )
    return project


def test_unnormalizing_backend_is_caught(tmp_path: Path) -> None:
    # Like hatchling: normalized file name, but METADATA keeps 'Version: 0.1.0-dev0'.
    with pytest.raises(WheelVerificationError) as exc_info:
        build_project(_fake_project(tmp_path), tmp_path / "b", sdist=False)
    assert exc_info.value.codes == {"version-mismatch"}
    assert "got '0.1.0-dev0'" in str(exc_info.value.issues[0])


def test_backend_failure_keeps_output(tmp_path: Path) -> None:
    with pytest.raises(BuildFailed, match="boom: this backend cannot build sdists") as exc_info:
        build_project(_fake_project(tmp_path), tmp_path / "b", sdist=True)
    assert exc_info.value.exception is not None


def test_missing_build_requirements(tmp_path: Path) -> None:
    project = _fake_project(tmp_path, requires='["thd-no-such-package-xyz>=1"]')
    with pytest.raises(BuildFailed, match="thd-no-such-package-xyz"):
        build_project(project, tmp_path / "b", sdist=False)


def test_old_backend_reported_before_it_runs(tmp_path: Path) -> None:
    # Like setuptools 65 in a fresh venv: the backend itself fails on this pyproject.toml.
    project = _fake_project(tmp_path, requires='["thd-no-such-package-xyz>=75.8.1"]')
    (project / "fakebackend.py").write_text("raise RuntimeError('too old to read this pyproject.toml')\n")
    with pytest.raises(BuildFailed, match=r"missing .*thd-no-such-package-xyz>=75\.8\.1"):
        build_project(project, tmp_path / "b", sdist=False)


def test_sdist_checks(tmp_path: Path) -> None:
    path = tmp_path / "thd_kernels-1.0.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo("thd_kernels-1.0/../evil")
        tar.addfile(info)
        link = tarfile.TarInfo("thd_kernels-1.0/link")
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc/passwd"
        tar.addfile(link)
    codes = {i.code for i in check_sdist(path, "thd-kernels", "1.0")}
    assert codes == {"unsafe-path", "symlink-entry", "structure"}
