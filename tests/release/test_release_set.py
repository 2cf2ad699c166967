"""Release set: set checks (spec §4 cases 39, 40), and the full ``release`` flow on a project
copy cross-checked with installer, ``wheel tags``, check-wheel-contents and ``twine check
--strict``, then installed offline into a fresh venv as a user would (issue 23)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from release.errors import InvalidVersionInput, ReleaseError
from release.flavors import load_flavors
from release.release_set import check_release_set, make_release
from release.repack import repack_wheel
from release.verify import verify_wheel
from tests.release.wheelkit import (
    foo_members,
    install_and_query,
    metadata_wheelhouse,
    project_copy,
    write_zip,
)

TARGET = "py3-none-manylinux_2_28_x86_64"
ALTERNATIVES = ["foo", "foo-cu12", "foo-cu13"]


def synthetic_set(tmp_path: Path, versions=("2.20.0.dev0", "2.20.0.dev0", "2.20.0.dev0")) -> list:
    core = write_zip(tmp_path / f"foo-{versions[0]}-py3-none-any.whl", foo_members(version=versions[0]))
    reports = [verify_wheel(core)]
    for name, version in zip(ALTERNATIVES[1:], versions[1:], strict=True):
        d = tmp_path / f"in-{name}"
        d.mkdir()
        src = write_zip(d / f"foo-{version}-py3-none-any.whl", foo_members(version=version))
        reports.append(repack_wheel(src, name=name, tags=TARGET, outdir=tmp_path / "o").report)
    return reports


def test_release_set_ok(tmp_path: Path) -> None:  # case 39
    assert check_release_set(synthetic_set(tmp_path), "2.20.0.dev0", ALTERNATIVES) == []


def test_version_string_mismatch(tmp_path: Path) -> None:  # case 40
    reports = synthetic_set(tmp_path, versions=("2.20.0", "2.20.0", "2.20.0.0"))
    issues = check_release_set(reports, "2.20.0", ALTERNATIVES)
    assert [i.code for i in issues] == ["version-string-mismatch"]
    assert "2.20.0.0" in str(issues[0])


def test_shared_file_between_coinstallable_wheels(tmp_path: Path) -> None:
    reports = synthetic_set(tmp_path)
    bar = write_zip(
        tmp_path / "bar-2.20.0.dev0-py3-none-any.whl", foo_members(name="bar", version="2.20.0.dev0")
    )
    issues = check_release_set([*reports, verify_wheel(bar)], None, ALTERNATIVES)
    assert {i.code for i in issues} == {"shared-file"}
    assert len(issues) == 3  # bar with each of the three alternatives
    assert any("foo/__init__.py" in str(i) for i in issues)


def test_flavor_table(tmp_path: Path) -> None:
    table = load_flavors()
    assert [(f.extra, f.name, f.tags) for f in table.flavors] == [
        ("cu12", "thd-kernels-cu12", TARGET),
        ("cu13", "thd-kernels-cu13", TARGET),
    ]
    assert table.default == "cu12"
    bad = tmp_path / "flavors.json"
    for data in (
        {"default": "a", "flavors": [{"extra": "a", "name": "x", "tags": TARGET, "tag": 1}]},
        {"metapackage": "x", "default": "a", "flavors": [{"extra": "a", "name": "x", "tags": TARGET}]},
    ):
        bad.write_text(json.dumps(data))
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
    with pytest.raises(ReleaseError, match="not empty") as exc_info:
        make_release(project, tmp_path / "dist")
    assert "make clean" in str(exc_info.value) and "--overwrite" in str(exc_info.value)
    (tmp_path / "dist" / "notes.txt").write_text("mine")
    with pytest.raises(ReleaseError, match="only release artifacts") as exc_info:
        make_release(project, tmp_path / "dist", overwrite=True)
    assert "notes.txt" in str(exc_info.value)
    assert sorted(p.name for p in (tmp_path / "dist").iterdir()) == ["notes.txt", "old.whl"]


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
    assert {a["kind"] for a in manifest["artifacts"]} == {"sdist", "wheel", "flavor"}
    reports = [verify_wheel(p, release=True) for p in sorted(release_dir.glob("*.whl"))]
    assert {r.version for r in reports} == {"0.1.0.dev0"}
    assert not list(release_dir.parent.glob(".release-*"))  # staging removed


@pytest.mark.slow
def test_release_installs(release_dir: Path, tmp_path: Path) -> None:
    got = install_and_query(tmp_path / "venv", [release_dir / EXPECTED[5]], ["thd-kernels-cu13"])
    assert got == ["0.1.0.dev0", "0.1.0.dev0", False]


def _offline_pip(venv_python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``pip --python VENV install --no-index ...`` with no pip configuration or PIP_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no config file: no index, find-links or cache from the machine
    cmd = [sys.executable, "-m", "pip", "--python", str(venv_python), "install", "--no-index"]
    cmd += ["--disable-pip-version-check", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


_CPU_CALL = """
import json, torch, torch.nn.functional as F, thd
cu = torch.tensor([0, 3, 7], dtype=torch.int32)
q, k, v = (torch.randn(7, 2, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
out = thd.attention(q, k, v, cu, cu, causal=True)
sdpa = F.scaled_dot_product_attention
ref = torch.cat([
    sdpa(*(t[s:e].transpose(0, 1) for t in (q, k, v)), is_causal=True).transpose(0, 1)
    for s, e in ((0, 3), (3, 7))
])
import thd.integrations.transformers as hf
hf.register()
print(json.dumps({"file": thd.__file__, "version": thd.__version__, "err": (out - ref).abs().max().item()}))
"""


@pytest.mark.slow
def test_fresh_venv_install_offline(release_dir: Path, tmp_path: Path) -> None:
    """``pip install thd-kernels`` and ``pip install 'thd-kernels[transformers]'`` from the release
    set, offline, into a fresh venv (issue 23).

    Resolution is pip's own: ``--dry-run --ignore-installed --no-index --find-links dist/`` plus a
    wheelhouse with the METADATA of every distribution this interpreter has (the versions CI
    installed; nothing is downloaded). The install is real for the release wheel (``--no-deps``);
    its dependencies (torch, triton, numpy, transformers) are this interpreter's, reached through a
    ``.pth`` file, since installing torch again would cost CI a minute. Then, in the fresh venv with
    ``-I`` (no PYTHONPATH), ``thd`` imports from the installed wheel and a CPU attention call
    matches torch's sdpa per sequence.
    """
    import sysconfig
    import venv

    from packaging.utils import canonicalize_name

    wheelhouse = metadata_wheelhouse(tmp_path / "wheelhouse")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    installed_transformers = next(
        p.name.split("-")[1] for p in wheelhouse.glob("transformers-*.whl")
    )  # what CI installed (transformers==5.17.0)
    for spec, extra in (("thd-kernels", False), ("thd-kernels[transformers]", True)):
        report_path = tmp_path / f"report-{extra}.json"
        proc = _offline_pip(
            py, "--dry-run", "--ignore-installed", "--find-links", str(release_dir),
            "--find-links", str(wheelhouse), "--report", str(report_path), spec,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "does not provide the extra" not in proc.stderr, proc.stderr
        chosen = {
            canonicalize_name(item["metadata"]["name"]): item
            for item in json.loads(report_path.read_text())["install"]
        }
        ours = chosen["thd-kernels"]
        assert ours["download_info"]["url"].endswith(f"/{release_dir.name}/{EXPECTED[2]}"), ours
        assert {"torch", "triton", "numpy"} <= set(chosen)
        assert not any(name.startswith("thd-kernels-") for name in chosen)  # no flavor beside it
        if extra:
            assert ours["requested_extras"] == ["transformers"]
            assert chosen["transformers"]["metadata"]["version"] == installed_transformers
        else:
            assert "transformers" not in chosen
    proc = _offline_pip(py, "--no-deps", "--find-links", str(release_dir), "thd-kernels")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    site = Path(
        subprocess.run(
            [str(py), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    ours = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    (site / "zz_test_dependencies.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    proc = subprocess.run(
        [str(py), "-I", "-c", _CPU_CALL], capture_output=True, text=True, cwd=tmp_path, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(got["file"]).is_relative_to(site), got
    assert got["version"] == "0.1.0.dev0"
    assert got["err"] < 1e-5, got


@pytest.mark.slow
def test_cross_check_installer(release_dir: Path, make_wheel) -> None:
    # imported here: the GPU machine collects this module without pypa/installer (a dev extra)
    sources = pytest.importorskip("installer.sources")
    exceptions = pytest.importorskip("installer.exceptions")
    for path in release_dir.glob("*.whl"):
        with sources.WheelFile.open(path) as wheel:
            wheel.validate_record(validate_contents=True)
    tampered = foo_members()
    tampered[0] = ("foo/__init__.py", b"tampered\n")
    with (
        sources.WheelFile.open(make_wheel("foo-0.3.0.dev0-py3-none-any.whl", tampered)) as wheel,
        pytest.raises(exceptions.InstallerError, match=r"foo/__init__\.py"),
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
    proc = _run(str(exe), *map(str, sorted(release_dir.glob("*.whl"))))
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
    previous = shutil.copytree(release_dir, tmp_path / "dist")  # re-run over a previous set
    (previous / "thd_kernels-0.0.1-py3-none-any.whl").write_bytes(b"stale")
    (previous / EXPECTED[4]).write_bytes(b"stale")
    make_release(project, previous, overwrite=True)
    assert sorted(p.name for p in previous.iterdir()) == EXPECTED
    for name in EXPECTED[2:3] + EXPECTED[4:]:
        assert (previous / name).read_bytes() == (release_dir / name).read_bytes(), name


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
