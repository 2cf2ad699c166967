"""Helpers for the release tests: synthetic wheels (adversarial ones too), project copies, venvs."""

from __future__ import annotations

import hashlib
import io
import shutil
import subprocess
import sys
import venv
import warnings
import zipfile
from collections.abc import Iterable, Sequence
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from release.record import Hash

REPO = Path(__file__).resolve().parents[2]
Member = tuple[str, bytes] | tuple[str, bytes, int]


def record_for(members: Iterable[Member], record_path: str, algo: str = "sha256") -> bytes:
    rows = []
    for m in members:
        name, data = m[0], m[1]
        if name == record_path or name.endswith("/"):
            continue
        digest = Hash.of_digest(algo, hashlib.new(algo, data).digest())
        quoted = f'"{name}"' if "," in name else name
        rows.append(f"{quoted},{digest},{len(data)}\n")
    rows.append(f"{record_path},,\n")
    return "".join(rows).encode()


def metadata(name: str, version: str, body: str = "", extra: Sequence[str] = ()) -> bytes:
    head = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", *extra]
    text = "\n".join(head) + "\n"
    if body:
        text += "\n" + body
    return text.encode()


def wheel_file(tags: Sequence[str], build: str = "", purelib: str = "true") -> bytes:
    lines = ["Wheel-Version: 1.0", "Generator: tests 1.0", f"Root-Is-Purelib: {purelib}"]
    lines += [f"Tag: {t}" for t in tags]
    if build:
        lines.append(f"Build: {build}")
    return ("\n".join(lines) + "\n").encode()


def write_zip(
    path: Path,
    members: Iterable[Member],
    date_time=(2020, 1, 1, 0, 0, 0),
    compression: int = zipfile.ZIP_DEFLATED,
    zip64: bool = False,
) -> Path:
    """Write members exactly as given (duplicates, odd paths and modes included).

    ``zip64`` gives every member a zip64 extra field in its local header (``force_zip64``).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns on duplicate names
        with zipfile.ZipFile(path, "w", compression) as zf:
            for m in members:
                info = zipfile.ZipInfo(m[0], date_time=date_time)
                info.compress_type = compression
                mode = m[2] if len(m) > 2 else 0o100644
                info.external_attr = mode << 16
                if zip64:
                    with zf.open(info, "w", force_zip64=True) as stream:
                        stream.write(m[1])
                else:
                    zf.writestr(info, m[1])
    return path


def foo_members(
    name: str = "foo",
    version: str = "0.3.0.dev0",
    tags: Sequence[str] = ("py3-none-any",),
    build: str = "",
    meta_name: str | None = None,
    body: str = "",
    extra_files: Sequence[Member] = (),
    meta_extra: Sequence[str] = (),
) -> list[Member]:
    esc = name.lower().replace("-", "_").replace(".", "_")
    di = f"{esc}-{version}.dist-info"
    members: list[Member] = [
        ("foo/__init__.py", b"VALUE = 1\n"),
        ("foo/data.bin", bytes(range(256)) * 64),
        *extra_files,
        (f"{di}/METADATA", metadata(meta_name or name, version, body, meta_extra)),
        (f"{di}/WHEEL", wheel_file(tags, build)),
    ]
    members.append((f"{di}/RECORD", record_for(members, f"{di}/RECORD")))
    return members


def run_cli(argv: Sequence[str]) -> tuple[int, str, str]:
    """``python -m release ARGV`` in-process: (exit status, stdout, stderr)."""
    from release.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def assert_clean_failure(rc: int, err: str, code: str | None = None) -> None:
    """Exit 1, exactly one ``ERROR:`` line, every other line a warning or an indented issue."""
    lines = err.splitlines()
    assert rc == 1, err
    assert "Traceback" not in err, err
    assert sum(line.startswith("ERROR: ") for line in lines) == 1, err
    assert all(line.startswith(("ERROR: ", "WARNING: ", "    ")) for line in lines), err
    if code is not None:
        assert f": {code}: " in err, err


def metadata_wheelhouse(dest: Path, skip_prefix: str = "thd-kernels") -> Path:
    """A find-links directory: one wheel per distribution installed in this interpreter, holding
    only its installed METADATA (so its real ``Requires-Dist``), none of its files.

    It lets pip resolve against exactly the versions this environment has, offline, without
    copying their payload (``torch`` alone is 190 MB); for ``--dry-run`` resolution only.
    """
    from importlib.metadata import distributions

    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version

    dest.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    for dist in distributions():
        name = dist.metadata["Name"] or ""
        key = canonicalize_name(name) if name else ""
        text = dist.read_text("METADATA") or dist.read_text("PKG-INFO")
        if not key or key in seen or key.startswith(skip_prefix) or not text:
            continue
        try:
            version = str(Version(dist.version))
        except InvalidVersion:
            continue
        seen.add(key)
        stem = f"{key.replace('-', '_')}-{version}"
        members: list[Member] = [
            (f"{stem}.dist-info/METADATA", text.encode()),
            (f"{stem}.dist-info/WHEEL", wheel_file(["py3-none-any"])),
        ]
        members.append((f"{stem}.dist-info/RECORD", record_for(members, f"{stem}.dist-info/RECORD")))
        write_zip(dest / f"{stem}-py3-none-any.whl", members)
    return dest


def project_copy(dest: Path, version_text: str) -> Path:
    """pyproject.toml, README.md, src/ and a VERSION.txt with ``version_text``."""
    dest.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    shutil.copytree(REPO / "src", dest / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    (dest / "VERSION.txt").write_text(version_text + "\n", encoding="utf-8")
    return dest


def install_and_query(venv_dir: Path, wheels: Sequence[Path], dists: Sequence[str]) -> list[str]:
    """Fresh venv without pip; ``pip --python`` installs ``--no-deps``; return versions + thd's."""
    venv.EnvBuilder(with_pip=False).create(venv_dir)
    py = venv_dir / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index",
         "--disable-pip-version-check", *map(str, wheels)],
        check=True, capture_output=True,
    )  # fmt: skip
    code = "import importlib.metadata as m, json, sys, thd; "
    query = f"[m.version(d) for d in {list(dists)!r}] + [thd.__version__, 'torch' in sys.modules]"
    code += f"print(json.dumps({query}))"
    out = subprocess.run(
        [str(py), "-I", "-c", code], check=True, capture_output=True, text=True, cwd=venv_dir
    )
    import json

    return json.loads(out.stdout)
