"""release.inflate: ISA-L's inflater gives the verdict and the bytes zlib's does.

The member-data rule (:class:`release.zipread.DataCheck`) runs with each installed inflater on
mutated raw-deflate streams (bit flips, byte overwrites, truncations, insertions, trailing
bytes; several compression levels and strategies; chunkings from 1 byte up), declared with
the original's size and CRC, and must accept the same streams with the same output and refuse
the same streams with the same code. Compressible data checks the pieces stay bounded.
"""

from __future__ import annotations

import random
import zlib

import pytest

from release import inflate
from release.errors import ReleaseError
from release.zipread import CHUNK, DataCheck, ZipEntry
from release.ziprecords import DEFLATED, ZipFormatError


def _entry(size: int, crc: int, csize: int) -> ZipEntry:
    return ZipEntry("pkg/data.bin", 0, DEFLATED, crc, csize, size, 0, 0, 0, 0)


def _verdict(stream: bytes, size: int, crc: int, chunk: int) -> tuple[str, bytes | str]:
    check = DataCheck(_entry(size, crc, len(stream)))
    out = bytearray()
    running = 0
    try:
        for at in range(0, max(len(stream), 1), chunk):
            for piece in check.inflate(stream[at : at + chunk]):
                assert 0 < len(piece) <= CHUNK
                out += piece
                running = zlib.crc32(piece, running)
        check.end(running)
    except ZipFormatError as exc:
        return "refused", exc.code
    return "accepted", bytes(out)


def _mutants(seed: int, count: int):
    rng = random.Random(seed)
    sources = [
        bytes(rng.randrange(256) for _ in range(700)),
        b"the quick brown fox " * 300,
        bytes(range(256)) * 24,
        bytes(3000),
    ]
    strategies = (zlib.Z_DEFAULT_STRATEGY, zlib.Z_FIXED, zlib.Z_HUFFMAN_ONLY, zlib.Z_RLE)
    for _ in range(count):
        source = rng.choice(sources)
        packer = zlib.compressobj(rng.choice((0, 1, 6, 9)), zlib.DEFLATED, -15, 8, rng.choice(strategies))
        data = bytearray(packer.compress(source) + packer.flush())
        for _ in range(rng.randrange(0, 4)):
            kind = rng.randrange(5)
            at = rng.randrange(len(data) + 1)
            if kind == 0 and at < len(data):
                data[at] ^= 1 << rng.randrange(8)
            elif kind == 1 and at < len(data):
                data[at] = rng.randrange(256)
            elif kind == 2:
                del data[at:]
            elif kind == 3:
                data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 6)))
            else:
                data += bytes(rng.randrange(1, 4))
        yield bytes(data), len(source), zlib.crc32(source), rng.choice((1, 7, 100, 1 << 16))


@pytest.mark.skipif("isal" not in inflate.BACKENDS, reason="isal is not installed")
def test_isal_and_zlib_agree_on_mutated_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    verdicts = {"accepted": 0, "refused": 0}
    for stream, size, crc, chunk in _mutants(seed=0, count=1500):
        results = {}
        for name in ("zlib", "isal"):
            monkeypatch.setenv("RELEASE_INFLATE", name)
            results[name] = _verdict(stream, size, crc, chunk)
        assert results["isal"] == results["zlib"], (stream.hex(), size, chunk)
        verdicts[results["zlib"][0]] += 1
    assert min(verdicts.values()) > 100, verdicts  # both outcomes are exercised


@pytest.mark.parametrize("name", sorted(inflate.BACKENDS))
def test_a_compressible_chunk_comes_out_in_bounded_pieces(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELEASE_INFLATE", name)
    assert inflate.backend() == name
    source = bytes(9 * CHUNK + 12345)
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    stream = packer.compress(source) + packer.flush()
    assert _verdict(stream, len(source), zlib.crc32(source), len(stream)) == ("accepted", source)
    assert _verdict(stream + b"\0", len(source), zlib.crc32(source), len(stream) + 1) == (
        "refused",
        "bad-zip",
    )


def test_the_default_is_the_fastest_and_a_bad_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RELEASE_INFLATE", raising=False)
    assert inflate.backend() == ("isal" if "isal" in inflate.BACKENDS else "zlib")
    monkeypatch.setenv("RELEASE_INFLATE", "no-such-inflater")
    with pytest.raises(ReleaseError, match=r"RELEASE_INFLATE: expected one of .*'no-such-inflater'"):
        inflate.backend()


def test_crc32_is_zlibs() -> None:
    rng = random.Random(1)
    running = expected = 0
    for size in (0, 1, 3, 64, 1000, 1 << 16):
        data = bytes(rng.randrange(256) for _ in range(size))
        running, expected = inflate.crc32(data, running), zlib.crc32(data, expected)
        assert running == expected, size
