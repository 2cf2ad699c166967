"""Seeded mutation fuzzing of ``verify`` and ``repack`` (issue 11), bounded for CI.

Each mutant of a few test-built wheels (deflated, stored, zip64 extras, a repack output) goes
through both commands in-process. Asserted for every one: exit 0, or exit 1 with exactly one
``ERROR:`` line (an uncaught exception fails the test with its seed); the input is
byte-identical and its directory unchanged; a refused repack leaves no output directory;
repack accepts exactly when verify accepts, and refuses with verify's issue codes (issue 23:
one rule); every repack output passes ``verify``, ``zipfile.testzip``, ``installer`` (RECORD
validated) and ``unzip -t`` when it is installed. ``test_consistent_edits`` adds mutants that
keep the archive and RECORD consistent but edit what the file name, METADATA and WHEEL claim
(the WHEEL Tag edited to another tag with RECORD updated to match, among them).

``RELEASE_FUZZ_MUTANTS`` (per shard of 8, default 600) and ``RELEASE_FUZZ_SEED`` scale or move it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.release import zipcraft
from tests.release.wheelkit import assert_clean_failure, foo_members, record_for, run_cli, write_zip

pytestmark = pytest.mark.property

NAME = "foo-0.3.0.dev0-py3-none-any.whl"
TARGET = "py3-none-manylinux_2_28_x86_64"
SHARDS = 8
PER_SHARD = int(os.environ.get("RELEASE_FUZZ_MUTANTS", "600"))
BASE_SEED = int(os.environ.get("RELEASE_FUZZ_SEED", "11"))
EXTRA = [
    ("foo/m1.py", b"X = 1\n"),
    ("foo/m2.py", b"X = 2\n"),
    ("six.py", b"import os\n"),
    ("foo/sub/", b""),
    ("foo/\u00e9.py", "E = '\u00e9'\n".encode()),
]
Base = tuple[bytes, zipcraft.Layout]
Mutation = Callable[[random.Random, bytearray, zipcraft.Layout], str]


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> list[Base]:
    d = tmp_path_factory.mktemp("bases")
    members = foo_members(extra_files=EXTRA, meta_extra=["Requires-Dist: bar>=1"])
    paths = [
        write_zip(d / "deflated.whl", members),
        write_zip(d / "stored.whl", members, compression=zipfile.ZIP_STORED),
        write_zip(d / "zip64.whl", members, zip64=True),
    ]
    (d / "in").mkdir()
    shutil.copy(paths[0], d / "in" / NAME)
    rc, out, err = run_cli(["repack", str(d / "in" / NAME), "--name", "foo", "--tag", "py3-none-any",
                            "--outdir", str(d / "rp"), "--quiet"])  # fmt: skip
    assert rc == 0, err
    paths.append(Path(out.strip()))
    return [(p.read_bytes(), zipcraft.Layout(p.read_bytes())) for p in paths]


# -- mutations: each edits ``buf`` in place (positions from the base layout) and says what it did


def _member(rng: random.Random, layout: zipcraft.Layout) -> bytes:
    return rng.choice(layout.order)


def _put(buf: bytearray, at: int, width: int, value: int) -> None:
    buf[at : at + width] = (value % (1 << 8 * width)).to_bytes(width, "little")


def flip(rng: random.Random, buf: bytearray, layout: zipcraft.Layout) -> str:
    name = _member(rng, layout)
    region = rng.choice(["local", "central", "eocd", "data", "any"])
    if region == "local":
        rec = layout.local[name]
        lo, hi = rec.start, rec.end
    elif region == "central":
        rec = layout.central[name]
        lo, hi = rec.start, rec.end
    elif region == "eocd":
        lo, hi = layout.eocd, len(buf)
    elif region == "data":
        lo, hi = layout.data_span(name)
    else:
        lo, hi = 0, len(buf)
    if hi <= lo:
        return "flip: empty region"
    at = rng.randrange(lo, hi)
    buf[at] ^= rng.randrange(1, 256)
    return f"flip {region} byte {at}"


def field(rng: random.Random, buf: bytearray, layout: zipcraft.Layout) -> str:
    name = _member(rng, layout)
    kind = rng.choice(["local", "central", "both"])
    fields = zipcraft.LOCAL_FIELDS if kind == "local" else zipcraft.CENTRAL_FIELDS
    key = rng.choice([k for k in fields if k in zipcraft.LOCAL_FIELDS or kind == "central"])
    old = layout.get("central" if kind == "both" else kind, name, key)
    value = rng.choice(
        [old + 1, old - 1, 0, 0xFFFFFFFF, 0xFFFF, rng.getrandbits(32), old ^ (1 << rng.randrange(16))]
    )
    for k in ("local", "central") if kind == "both" else (kind,):
        rec = layout.local[name] if k == "local" else layout.central[name]
        off, width = (zipcraft.LOCAL_FIELDS if k == "local" else zipcraft.CENTRAL_FIELDS)[key]
        _put(buf, rec.start + off, width, value)
    return f"{kind} {key} of {name!r}: {old} -> {value}"


def eocd_field(rng: random.Random, buf: bytearray, layout: zipcraft.Layout) -> str:
    key = rng.choice(list(zipcraft.EOCD_FIELDS))
    off, width = zipcraft.EOCD_FIELDS[key]
    value = rng.choice([0xFFFF, 0xFFFFFFFF, 0, 1, rng.getrandbits(8 * width)])
    _put(buf, layout.eocd + off, width, value)
    return f"end record {key} -> {value}"


def rename(rng: random.Random, buf: bytearray, layout: zipcraft.Layout) -> str:
    name = _member(rng, layout)
    kind = rng.choice(["local", "central", "both"])
    pos = rng.randrange(len(name))
    byte = rng.choice([0x00, 0x2F, 0x2E, 0x5C, 0xFF, 0x0A, 0x7F, rng.randrange(0x21, 0x7F)])
    for k in ("local", "central") if kind == "both" else (kind,):
        rec = layout.local[name] if k == "local" else layout.central[name]
        buf[rec.name_at + pos] = byte
    return f"rename {kind} {name!r}[{pos}] -> {byte:#x}"


def duplicate(rng: random.Random, buf: bytearray, layout: zipcraft.Layout) -> str:
    for rec in (layout.local[b"foo/m2.py"], layout.central[b"foo/m2.py"]):
        buf[rec.name_at : rec.name_at + 9] = b"foo/m1.py"
    return "duplicate foo/m1.py"


def method(rng: random.Random, buf: bytearray, layout: zipcraft.Layout) -> str:
    name = _member(rng, layout)
    kind = rng.choice(["local", "central", "both"])
    value = rng.choice([0, 8, 12, 14, 1, 9, 99])
    for k in ("local", "central") if kind == "both" else (kind,):
        rec = layout.local[name] if k == "local" else layout.central[name]
        _put(buf, rec.start + (8 if k == "local" else 10), 2, value)
    return f"method {kind} {name!r} -> {value}"


def flags(rng: random.Random, buf: bytearray, layout: zipcraft.Layout) -> str:
    name = _member(rng, layout)
    kind = rng.choice(["local", "central", "both"])
    bit = 1 << rng.choice([0, 1, 2, 3, 5, 6, 11, 13, 15])
    for k in ("local", "central") if kind == "both" else (kind,):
        rec = layout.local[name] if k == "local" else layout.central[name]
        at = rec.start + (6 if k == "local" else 8)
        _put(buf, at, 2, int.from_bytes(buf[at : at + 2], "little") ^ bit)
    return f"flags {kind} {name!r} ^ {bit:#x}"


def content(rng: random.Random, buf: bytearray, layout: zipcraft.Layout) -> str:
    """Same-length edit of a member's bytes; for stored members the CRC is fixed (RECORD must tell)."""
    names = [n for n in layout.order if not n.endswith(b"/")]
    name = rng.choice([n for n in names if n.endswith((b"RECORD", b"METADATA", b"WHEEL"))] + names)
    lo, hi = layout.data_span(name)
    if hi <= lo:
        return "content: empty member"
    data = bytearray(buf[lo:hi])
    stored = layout.get("central", name, "method") == 0
    if stored and name.endswith(b"RECORD") and rng.random() < 0.5:
        text = bytes(data)
        at = text.find(b",", rng.randrange(len(text)))
        new = rng.choice([b"+", b"_", b"\xd9", b'"', b" ", b"0"])
        if at > 0:
            data[at + 1 : at + 1 + len(new)] = new
    else:
        at = rng.randrange(len(data))
        data[at] = rng.randrange(0x20, 0x7F) if stored else data[at] ^ rng.randrange(1, 256)
    buf[lo:hi] = data[: hi - lo]
    if stored:
        crc = zlib.crc32(bytes(buf[lo:hi]))
        for rec, off in ((layout.local[name], 14), (layout.central[name], 16)):
            _put(buf, rec.start + off, 4, crc)
    return f"content of {name!r} (stored={stored})"


def record_row(rng: random.Random, buf: bytearray, layout: zipcraft.Layout) -> str:
    """A same-length edit of one RECORD size or hash (stored bases; CRC fixed), else a flip."""
    name = next(n for n in layout.order if n.endswith(b"/RECORD"))
    if layout.get("central", name, "method") != 0:
        return flip(rng, buf, layout)
    lo, hi = layout.data_span(name)
    rows = bytes(buf[lo:hi]).split(b"\n")
    row = rng.randrange(len(rows) - 2)
    path, digest, size = rows[row].rsplit(b",", 2)
    size = rng.choice([b"+", b"_", b"0", b" ", b"x"]) + size[1:] if size else size
    digest = digest[:-1] + rng.choice([b"=", b"A", b"+", b"/"]) if rng.random() < 0.5 else digest
    rows[row] = b",".join((path, digest, size))
    new = b"\n".join(rows)
    buf[lo:hi] = new
    crc = zlib.crc32(new)
    for rec, off in ((layout.local[name], 14), (layout.central[name], 16)):
        _put(buf, rec.start + off, 4, crc)
    return f"RECORD row {row}: {rows[row]!r}"


NON_SHIFTING: list[Mutation] = [
    flip,
    field,
    eocd_field,
    rename,
    duplicate,
    method,
    flags,
    content,
    record_row,
]


def shift(rng: random.Random, data: bytes, layout: zipcraft.Layout) -> tuple[bytes, str]:
    """Mutations that move bytes: junk before/after/between, comment, truncation."""
    junk = rng.choice([b"x", b"PK\x03\x04", b"PK\x05\x06" + bytes(18), os.urandom(rng.randrange(1, 64))])
    kind = rng.choice(["before", "before-fixed", "after", "gap", "comment", "truncate"])
    if kind == "before":
        return junk + data, kind
    if kind == "after":
        return data + junk, kind
    if kind == "truncate":
        return data[: rng.randrange(len(data))], kind
    try:  # these re-parse the (possibly already broken) archive
        if kind == "before-fixed":
            return zipcraft.insert(data, 0, junk), kind
        if kind == "gap":
            return zipcraft.insert(data, layout.local[_member(rng, layout)].start, junk), kind
        return zipcraft.set_comment(data, junk), kind
    except (ValueError, KeyError, IndexError, struct.error):
        return data + junk, f"{kind} (fell back to after)"


def make_mutant(rng: random.Random, base: Base) -> tuple[bytes, list[str]]:
    data, layout = base
    buf = bytearray(data)
    steps = [rng.choice(NON_SHIFTING)(rng, buf, layout) for _ in range(rng.choice([0, 1, 1, 1, 2, 3]))]
    out = bytes(buf)
    if not steps or rng.random() < 0.25:
        out, what = shift(rng, out, layout)
        steps.append(what)
    return out, steps


# -- checks


class OutputChecks:
    """Full checks of a repack output, once per distinct output."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.seen: set[str] = set()
        self.unzip = shutil.which("unzip")

    def __call__(self, wheel: Path) -> None:
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest in self.seen:
            return
        rc, _, err = run_cli(["verify", str(wheel)])
        assert rc == 0, err
        with zipfile.ZipFile(wheel) as zf:
            assert zf.testzip() is None
        _install(wheel, self.workdir / f"site-{len(self.seen)}")
        if self.unzip:
            proc = subprocess.run(
                [self.unzip, "-tqq", str(wheel)], capture_output=True, text=True, check=False
            )
            assert proc.returncode == 0, proc.stdout + proc.stderr
        self.seen.add(digest)


def _install(wheel: Path, dest: Path) -> None:
    from installer import install
    from installer.destinations import SchemeDictionaryDestination
    from installer.sources import WheelFile
    from installer.utils import SCHEME_NAMES

    scheme = {key: str(dest / key) for key in SCHEME_NAMES}
    with WheelFile.open(wheel) as source:
        source.validate_record(validate_contents=True)
        install(source, SchemeDictionaryDestination(scheme, sys.executable, "posix"), {})
    assert (dest / "purelib" / "foo" / "__init__.py").is_file()
    shutil.rmtree(dest)


def check_mutant(data: bytes, work: Path, check_output: OutputChecks) -> tuple[int, int]:
    indir, outdir = work / "in", work / "out"
    indir.mkdir(parents=True)
    path = indir / NAME
    path.write_bytes(data)
    rc_v, out_v, err_v = run_cli(["verify", "--json", str(path)])
    rc_r, out_r, err_r = run_cli(
        ["repack", str(path), "--name", "foo-cu12", "--tag", TARGET, "--outdir", str(outdir), "--json"]
    )
    for rc, err in ((rc_v, err_v), (rc_r, err_r)):
        if rc:
            assert_clean_failure(rc, err)
        else:
            assert "ERROR" not in err and "Traceback" not in err, err
    assert path.read_bytes() == data, "input modified"
    assert os.listdir(indir) == [NAME], os.listdir(indir)
    assert (rc_r == 0) == (rc_v == 0), f"verify: {err_v}; repack: {err_r}"
    if rc_r:
        assert not outdir.exists(), list(outdir.iterdir())
        assert _codes(out_r) == _codes(out_v), f"verify: {err_v}; repack: {err_r}"
    else:
        (wheel,) = outdir.iterdir()
        check_output(wheel)
    shutil.rmtree(work)
    return rc_v, rc_r


def _codes(json_out: str) -> set[str]:
    return {i["code"] for i in json.loads(json_out)["error"]["issues"]}


def _edited(base: bytes, edit: Callable[[str, bytes], bytes]) -> bytes:
    """``base`` with every member passed through ``edit``, RECORD regenerated to match."""
    with zipfile.ZipFile(io.BytesIO(base)) as zf:
        infos = zf.infolist()
        members = [(i.filename, zf.read(i)) for i in infos]
        method = infos[0].compress_type
    record = next(n for n, _ in members if n.endswith(".dist-info/RECORD"))
    members = [(n, edit(n, d)) for n, d in members if n != record]
    members.append((record, record_for(members, record)))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", method) as zf:
        for n, d in members:
            zf.writestr(zipfile.ZipInfo(n, (2020, 1, 1, 0, 0, 0)), d, compress_type=method)
    return buf.getvalue()


def _sub(member: str, old: bytes, new: bytes) -> Callable[[str, bytes], bytes]:
    return lambda n, d: d.replace(old, new, 1) if n.endswith(member) else d


CONSISTENT_EDITS: dict[str, tuple[Callable[[str, bytes], bytes], str]] = {
    "other tag": (_sub("/WHEEL", b"Tag: py3-none-any", b"Tag: cp310-cp310-linux_x86_64"), "tag-mismatch"),
    "extra tag": (
        _sub("/WHEEL", b"Tag: py3-none-any", b"Tag: py3-none-any\nTag: py2-none-any"),
        "tag-mismatch",
    ),
    "unexpanded": (_sub("/WHEEL", b"Tag: py3-none-any", b"Tag: py2.py3-none-any"), "unexpanded-tag"),
    "build": (_sub("/WHEEL", b"Root-Is-Purelib", b"Build: 1\nRoot-Is-Purelib"), "build-mismatch"),
    "wheel 2.0": (_sub("/WHEEL", b"Wheel-Version: 1.0", b"Wheel-Version: 2.0"), "wheel-version"),
    "purelib": (_sub("/WHEEL", b"Root-Is-Purelib: true", b"Root-Is-Purelib: yes"), "purelib-missing"),
    "name": (_sub("/METADATA", b"Name: foo", b"Name: bar"), "name-mismatch"),
    "version": (_sub("/METADATA", b"Version: 0.3.0.dev0", b"Version: 0.3.0-dev0"), "version-mismatch"),
    "two names": (_sub("/METADATA", b"Name: foo", b"Name: foo\nName: foo"), "metadata-invalid"),
    "installer": (lambda n, d: d, "forbidden-member"),
}


@pytest.mark.parametrize("edit", list(CONSISTENT_EDITS))
def test_consistent_edits(bases: list[Base], tmp_path: Path, edit: str) -> None:
    """Archive and RECORD consistent, claims edited: verify rejects, repack refuses alike (issue 23)."""
    func, code = CONSISTENT_EDITS[edit]
    for index, (data, _) in enumerate(bases):
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            di = next(n for n in zf.namelist() if n.endswith("/WHEEL")).split("/")[0]
        mutant = _edited(data, func)
        if edit == "installer":
            mutant = _with_member(mutant, f"{di}/INSTALLER", b"pip\n")
        work = tmp_path / f"{edit}-{index}"
        (work / "in").mkdir(parents=True)
        path = work / "in" / NAME
        path.write_bytes(mutant)
        rc_v, out_v, err_v = run_cli(["verify", "--json", str(path)])
        argv = ["repack", str(path), "--name", "foo-cu12", "--tag", TARGET, "--outdir", str(work / "o")]
        rc_r, out_r, err_r = run_cli([*argv, "--json"])
        assert rc_v == 1 and code in _codes(out_v), err_v
        assert_clean_failure(rc_r, err_r, code)
        assert _codes(out_r) == _codes(out_v)
        assert not (work / "o").exists() and path.read_bytes() == mutant


def _with_member(data: bytes, name: str, content: bytes) -> bytes:
    """``data`` plus one member, listed in RECORD (so only the member itself is wrong)."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        members = [(i.filename, zf.read(i)) for i in zf.infolist()]
    record = next(n for n, _ in members if n.endswith(".dist-info/RECORD"))
    members = [m for m in members if m[0] != record] + [(name, content)]
    members.append((record, record_for(members, record)))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for n, d in members:
            zf.writestr(zipfile.ZipInfo(n, (2020, 1, 1, 0, 0, 0)), d)
    return buf.getvalue()


@pytest.mark.parametrize("shard", range(SHARDS))
def test_mutants(bases: list[Base], tmp_path: Path, shard: int) -> None:
    check_output = OutputChecks(tmp_path)
    accepted = 0
    for i in range(PER_SHARD):
        seed = BASE_SEED * 1_000_003 + shard * PER_SHARD + i
        rng = random.Random(seed)
        base = bases[i % len(bases)]
        data, steps = make_mutant(rng, base)
        try:
            rc_v, _ = check_mutant(data, tmp_path / f"m{i}", check_output)
        except BaseException as exc:
            raise AssertionError(f"seed {seed}, base {i % len(bases)}, mutations {steps}: {exc!r}") from exc
        accepted += rc_v == 0
    assert accepted < PER_SHARD  # the mutator does produce refusals ...


def test_mutator_produces_both_outcomes(bases: list[Base], tmp_path: Path) -> None:
    """... and accepted mutants (harmless bytes: times, attributes), so outputs get checked."""
    outcomes = set()
    check_output = OutputChecks(tmp_path)
    for i in range(60):
        data, _ = make_mutant(random.Random(i), bases[i % len(bases)])
        outcomes.add(check_mutant(data, tmp_path / f"m{i}", check_output)[1])
    assert outcomes == {0, 1}
