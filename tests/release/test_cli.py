"""``python -m release`` in-process through ``main([...])``: output, JSON, exit status."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from release.__main__ import build_parser, main
from release.progress import Progress
from tests.release.wheelkit import REPO, foo_members, project_copy

TARGET = "py3-none-manylinux_2_28_x86_64"


def test_version_text_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "VERSION.txt").write_text("0.1.0-dev0\n")
    assert main(["version", "--project", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "0.1.0.dev0\n"
    assert main(["version", "--json", "--file", str(tmp_path / "VERSION.txt")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["raw"] == "0.1.0-dev0" and data["normalized"] == "0.1.0.dev0"
    assert data["normalized_from"] == "0.1.0-dev0"


def test_version_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "VERSION.txt").write_text("1.0+ABC-1\n")
    assert main(["version", "--project", str(tmp_path), "--release"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ERROR: ") and "local-version" in err and err.count("\n") == 1
    (tmp_path / "VERSION.txt").write_bytes(b"\xef\xbb\xbf1.0\n")
    assert main(["version", "--project", str(tmp_path), "--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["error"]["code"] == "invalid-version"
    assert "byte-order mark" in captured.err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([], ["nope"], ["repack", "x.whl"], ["verify"]):
        with pytest.raises(SystemExit) as exc_info:
            main(argv)
        assert exc_info.value.code == 2
    capsys.readouterr()


def test_invalid_repack_arguments_exit_2(foo_wheel: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["repack", str(foo_wheel), "--name", "bad name", "--tag", TARGET]) == 2
    assert capsys.readouterr().err.startswith("ERROR: repack: invalid project name")
    assert main(["repack", str(foo_wheel), "--name", "ok", "--tag", "py3-none"]) == 2


def test_verify_reports_every_issue(make_wheel, foo_wheel: Path, capsys: pytest.CaptureFixture[str]) -> None:
    members = foo_members()
    members[0] = ("foo/__init__.py", b"VALUE = 2\n")
    bad = make_wheel("foo-0.3.0.dev0-py3-none-manylinux_2_28_x86_64.whl", members)
    assert main(["verify", str(foo_wheel)]) == 0
    assert capsys.readouterr().out == f"OK {foo_wheel}\n"
    assert main(["verify", str(foo_wheel), str(bad)]) == 1
    assert capsys.readouterr().out == f"OK {foo_wheel}\n"  # the good one is named
    assert main(["verify", "--json", str(foo_wheel), str(bad)]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("ERROR: verify: 1 of 2 wheel(s) failed\n")
    lines = captured.err.splitlines()[1:]
    assert lines and all(line.startswith("    ") for line in lines)
    assert any("record-hash" in line and "foo/__init__.py" in line for line in lines)
    assert any("tag-mismatch" in line for line in lines)
    data = json.loads(captured.out)
    assert {i["code"] for i in data["error"]["issues"]} == {"record-hash", "tag-mismatch"}
    assert all(i["artifact"] == bad.name for i in data["error"]["issues"])


def test_missing_file_is_no_such_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "foo-1.0-py3-none-any.whl"
    for argv in (["verify", str(missing)], ["repack", str(missing), "--name", "x", "--tag", TARGET]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("ERROR: ") and "no-such-file" in err and "no such file" in err, err
        assert "bad-zip" not in err


def test_every_argument_has_help() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name, p in sub.choices.items():
        assert p.description, name
        for action in p._actions:
            assert action.help, f"{name} {action.dest}"


def test_runs_from_another_directory(tmp_path: Path) -> None:
    """``python PATH/TO/release`` from anywhere; --project defaults to the tool's repository."""
    proc = subprocess.run(
        [sys.executable, "-I", str(REPO / "release"), "version", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["raw"] == (REPO / "VERSION.txt").read_text().strip()


def test_verify_limits(foo_wheel: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--max-size", "100", str(foo_wheel)]) == 1
    assert "too-large" in capsys.readouterr().err


def test_repack_and_dry_run(foo_wheel: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    args = ["repack", str(foo_wheel), "--name", "foo-cu12", "--tag", TARGET, "--outdir", str(out)]
    assert main([*args, "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["ok"] and not plan["written"] and not out.exists()
    assert plan["plan"]["dist_info"] == ["foo-0.3.0.dev0.dist-info", "foo_cu12-0.3.0.dev0.dist-info"]
    assert main([*args, "--requires", "bar>=1"]) == 0
    written = Path(capsys.readouterr().out.strip())
    assert written.name == "foo_cu12-0.3.0.dev0-py3-none-manylinux_2_28_x86_64.whl"
    assert main([*args, "--requires", "bar>=1"]) == 0
    assert capsys.readouterr().out.strip().endswith("(unchanged)")
    assert main([*args, "--quiet"]) == 1  # a different result for an existing file
    assert "exists with different bytes" in capsys.readouterr().err


def test_repack_refuses_extension(make_wheel, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = make_wheel(
        "foo-0.3.0.dev0-cp311-cp311-linux_x86_64.whl",
        tags=["cp311-cp311-linux_x86_64"],
        extra_files=[("foo/_x.abi3.so", b"\x7fELF")],
    )
    base = ["repack", str(src), "--name", "foo-cu12", "--tag", TARGET, "--outdir", str(tmp_path / "o")]
    assert main(base) == 1
    assert "--allow-extension-retag" in capsys.readouterr().err
    assert main([*base, "--allow-extension-retag", "--quiet"]) == 0


def test_progress_only_on_a_tty() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    plain, tty = io.StringIO(), Tty()
    for stream in (plain, tty):
        p = Progress(stream)
        p.step("building")
        p.bytes(50, 100)
        p.bytes(100, 100)
    assert plain.getvalue() == ""
    assert "... building" in tty.getvalue() and "100.0%" in tty.getvalue()
    quiet = Tty()
    Progress(quiet, quiet=True).step("x")
    assert quiet.getvalue() == ""


def test_no_progress_when_captured(foo_wheel: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(foo_wheel)]) == 0
    assert capsys.readouterr().err == ""


def test_every_command_has_json_and_quiet() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == {"version", "build", "repack", "verify", "release", "wheel"}
    for name, p in sub.choices.items():
        opts = {o for a in p._actions for o in a.option_strings}
        assert {"--json", "--quiet"} <= opts, name


@pytest.mark.slow
def test_release_and_wheel_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    project = project_copy(tmp_path / "p", "1.0-rc1")
    assert main(["release", "--project", str(project), "--outdir", str(tmp_path / "dist"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["version"]["normalized"] == "1.0rc1" and len(data["artifacts"]) == 4
    assert main(["release", "--project", str(project), "--outdir", str(tmp_path / "dist")]) == 1
    err = capsys.readouterr().err
    assert "not empty" in err and "make clean" in err and "--overwrite" in err
    assert (
        main(["wheel", "--project", str(project), "--outdir", str(tmp_path / "w"), "--local", "gdead"]) == 0
    )
    assert (
        capsys.readouterr()
        .out.strip()
        .endswith("thd_kernels_cu12-1.0rc1+gdead-py3-none-manylinux_2_28_x86_64.whl")
    )
    assert main(["build", "--project", str(project), "--outdir", str(tmp_path / "b"), "--no-sdist"]) == 0
    assert capsys.readouterr().out.strip().endswith("thd_kernels-1.0rc1-py3-none-any.whl")


@pytest.mark.slow
def test_module_entry_point_without_torch(tmp_path: Path) -> None:
    (tmp_path / "VERSION.txt").write_text("v1.0\n")
    code = (
        "import sys, runpy; sys.argv = ['release', 'version', '--project', sys.argv[1]];"
        "\ntry: runpy.run_module('release', run_name='__main__')\n"
        "except SystemExit as e: assert e.code == 0, e.code\n"
        "import release.release_set, release.build, release.repack\n"
        "assert 'torch' not in sys.modules and 'thd' not in sys.modules"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "1.0\n"


def test_repack_json_matches_schema(
    foo_wheel: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Case 42: ``repack --dry-run --json`` (and the real run) validate against the shipped schema."""
    import jsonschema

    schema_path = Path(__file__).parents[2] / "release" / "schemas" / "repack.schema.json"
    schema = json.loads(schema_path.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    out = tmp_path / "out"
    args = ["repack", str(foo_wheel), "--name", "foo-cu12", "--tag", TARGET, "--outdir", str(out), "--json"]
    for extra in (["--dry-run"], ["--requires", "bar>=1"]):
        assert main([*args, *extra]) == 0
        payload = json.loads(capsys.readouterr().out)
        jsonschema.validate(payload, schema)
        assert payload["written"] is (extra[0] != "--dry-run")
    broken = {**payload, "plan": {**payload["plan"], "tags": ["not a tag"]}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)
