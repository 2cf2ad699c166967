"""benchmarks/bench_gluon_bwd.py's tile sweep options on CPU: the specs it reads, the ones it turns
down (before any device time is spent), and the providers they add."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_gluon_bwd

    monkeypatch.setattr(bench_gluon_bwd, "PROVIDERS", dict(bench_gluon_bwd.PROVIDERS))
    return bench_gluon_bwd


def test_tile_specs_read_back(bench: types.ModuleType) -> None:
    tile = bench._tile("128x128s3c2r232")
    assert (tile.block_m, tile.block_n, tile.num_stages, tile.consumers) == (128, 128, 3, 2)
    assert (tile.consumer_regs, tile.num_warps) == (232, 4)
    assert bench._spec(tile) == "128x128s3c2r232"
    assert bench._spec(bench._tile("64x128s2c1")) == "64x128s2c1"
    assert bench._spec(bench._tile("64x128s2c2r240")) == "64x128s2c2"  # FA3's 240 is the default
    assert not tile.persistent
    persistent = bench._tile("128x128s2c2p")
    assert persistent.persistent and (persistent.block_m, persistent.consumers) == (128, 2)
    assert bench._spec(persistent) == "128x128s2c2p"
    one_head = bench._tile("128x128s2c2ph1")
    assert one_head.persistent and one_head.head_section == 1
    assert bench._spec(one_head) == "128x128s2c2ph1" and not one_head.dynamic
    ticket = bench._tile("128x128s2c2ph1d")
    assert ticket.persistent and ticket.dynamic and ticket.head_section == 1
    assert bench._spec(ticket) == "128x128s2c2ph1d"
    assert bench._spec(bench._tile("128x128s2c2pd")) == "128x128s2c2pd"
    rows = bench._tile("128x128s2c2qph1")
    assert rows.dq_rows and rows.persistent and rows.head_section == 1 and not tile.dq_rows
    assert (
        bench._spec(rows) == "128x128s2c2qph1" and bench._spec(bench._tile("128x128s2c2q")) == "128x128s2c2q"
    )
    assert bench._docs("64-1024") == (64, 1024)


@pytest.mark.parametrize(
    "argv",
    [
        ["--dkdv-tiles", "64x128"],
        ["--dkdv-tiles", "32x128s2c2"],  # LLVM aborts on a 32-row tile: turned down here
        ["--dkdv-tiles", "64x96s2c2"],
        ["--dkdv-tiles", "64x128s2c3"],
        ["--dkdv-tiles", "64x128s0c2"],
        ["--dkdv-tiles", "64x128s2c2h4"],  # a head section without persistent programs
        ["--dkdv-tiles", "64x128s2c2d"],  # a ticket without persistent programs
        ["--dkdv-tiles", "64x128s3c2q"],  # dQ by rows of 64-query tiles: 32-row wgmma
        ["--dkdv-tiles", "128x128s2c1q"],  # dQ by rows without two partitions
        ["--dq-tiles", "128x64s2c1r232"],
        ["--dq-tiles", "128x64s2c2r250"],
        ["--docs", "8192-512"],
    ],
)
def test_bad_specs_are_argparse_errors(
    bench: types.ModuleType, argv: list[str], capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    assert "error: argument --" in capsys.readouterr().err


def test_tile_providers_replace_one_kernels_tile(bench: types.ModuleType) -> None:
    tiles = [bench._tile("64x128s3c2"), bench._tile("128x128s2c1")]
    assert bench.add_tile_providers("dkdv", tiles) == ["gluon-dkdv-64x128s3c2", "gluon-dkdv-128x128s2c1"]
    assert bench.add_tile_providers("dq", tiles[:1]) == ["gluon-dq-64x128s3c2"]
    defaults = bench.gluon_backward.TILES
    atomic, table = bench.PROVIDERS["gluon-dkdv-64x128s3c2"]
    assert atomic is None  # the default dQ per head dim, as the gluon provider
    assert table == {key: tiles[0] if key[0] == "dkdv" else t for key, t in defaults.items()}
    atomic, table = bench.PROVIDERS["gluon-dq-64x128s3c2"]
    assert atomic is False  # split dQ: the dQ kernel runs
    assert table == {key: tiles[0] if key[0] == "dq" else t for key, t in defaults.items()}
