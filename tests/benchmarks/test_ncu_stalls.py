"""benchmarks/ncu_stalls.py on a small hand-made ncu source-page export: classes, idle warps,
code regions and excess sectors against shares worked out by hand."""

from __future__ import annotations

import csv
import gzip
import io
import re
from pathlib import Path

import pytest

from benchmarks import ncu_stalls

HEADER = [
    "Address",
    "Source",
    "Warp Stall Sampling (All Samples)",
    "Instructions Executed",
    "stall_barrier",
    "stall_long_sb",
    "stall_short_sb",
    "stall_barrier (Not Issued)",
    "L2 Theoretical Sectors Global Excessive",
]
LINES = [  # source, samples, executed, barrier, long_sb, short_sb, excess
    ("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0", 0, 4, 0, 0, 0, 0),
    ("FFMA R14, R0, R152, -R16", 30, 100, 0, 0, 30, 0),
    ("@!P0  BRA 0x7f57ff7df670", 20, 50, 2, 18, 0, 0),  # an mbarrier try-wait's retry
    ("HGMMA.64x64x16.F32.BF16 R152, gdesc[UR56], RZ, !UPT", 10, 8, 0, 0, 10, 0),
    ("USETMAXREG.DEALLOC.CTAPOOL 0x18", 0, 4, 0, 0, 0, 0),
    ("NOP", 40, 2, 40, 0, 0, 0),  # a padding warp parked at a barrier
    ("@!P1  STG.E desc[UR6][R12.64+0xc0], R73", 0, 6, 0, 0, 0, 7),
    ("NOP", 5, 3, 2, 0, 3, 0),  # a NOP that mostly waits on something else: not idle
]


def _export(tmp_path: Path, gz: bool) -> Path:
    text = io.StringIO()
    writer = csv.writer(text, quoting=csv.QUOTE_ALL)
    writer.writerow(["Kernel Name", "_dkdv_kernel"])
    writer.writerow(HEADER)
    for i, (src, samples, executed, barrier, long_sb, short_sb, excess) in enumerate(LINES):
        writer.writerow(
            [hex(16 * i), f"      {src}", samples, f"{executed:,}", barrier, long_sb, short_sb, 0, excess]
        )
    path = tmp_path / ("s.csv.gz" if gz else "s.csv")
    path.write_bytes(gzip.compress(text.getvalue().encode()) if gz else text.getvalue().encode())
    return path


@pytest.mark.parametrize("gz", [False, True])
def test_shares_of_active_samples(tmp_path: Path, gz: bool) -> None:
    result = ncu_stalls.report(ncu_stalls.summarize(_export(tmp_path, gz)))
    assert result["samples"] == 105
    assert result["idle_pct_of_all"] == round(100 * 40 / 105, 1)
    active = 65  # the two lines of the idle NOP excluded
    shares = {kind: entry["share_pct"] for kind, entry in result["active_by_class"].items()}
    assert shares == {
        "math": round(100 * 30 / active, 1),
        "mbarrier wait": round(100 * 20 / active, 1),
        "wgmma": round(100 * 10 / active, 1),
        "other": round(100 * 5 / active, 1),
    }
    assert result["active_by_class"]["mbarrier wait"]["reasons_pct"] == {
        "long_sb": round(100 * 18 / active, 1),
        "barrier": round(100 * 2 / active, 1),
    }
    assert [line["class"] for line in result["top_lines"]] == ["math", "mbarrier wait", "wgmma", "other"]
    assert result["excess_global_sectors"] == {"STG": 7}


def test_regions_split_at_setmaxnreg(tmp_path: Path) -> None:
    regions = ncu_stalls.report(ncu_stalls.summarize(_export(tmp_path, gz=False)))["regions"]
    # the kernel entry has no samples and is left out; the rest split at the two USETMAXREG lines
    assert [r["starts_at"] for r in regions] == [LINES[0][0], LINES[4][0]]
    assert [r["share_pct_of_all"] for r in regions] == [round(100 * 60 / 105, 1), round(100 * 45 / 105, 1)]
    assert [r["executed_instructions"] for r in regions] == [4 + 100 + 50 + 8, 4 + 2 + 6 + 3]
    assert regions[1]["classes_pct_of_region"] == {
        "idle": round(100 * 40 / 45, 1),
        "other": round(100 * 5 / 45, 1),
    }


def test_opcode_and_classes() -> None:
    assert ncu_stalls.opcode("@!P0  BRA 0x7f57") == "BRA"
    assert ncu_stalls.opcode("WARPGROUP.DEPBAR.LE gsb0, 0x0") == "WARPGROUP"
    spin = ncu_stalls.collections.Counter(stall_long_sb=1, stall_wait=3)
    assert ncu_stalls.classify("@!P0  BRA 0x10", spin) == "other"  # a branch not waiting on a barrier
    one = ncu_stalls.collections.Counter(stall_long_sb=1)
    assert (
        ncu_stalls.classify("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R6+URZ+0x387d0], R0", one) == "mbarrier wait"
    )
    assert ncu_stalls.classify("@!P1  SYNCS.ARRIVE.TRANS64.A1T0 RZ, [R20+URZ+0x387c0], RZ", one) == (
        "CTA sync and fences"
    )


def test_not_an_export_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text('"Kernel Name","k"\n"a","b"\n')
    with pytest.raises(SystemExit, match=r"ERROR: .*no 'Address' header row"):
        ncu_stalls.summarize(bad)
    with pytest.raises(SystemExit, match=r"ERROR: csv: .* is not a file"):
        ncu_stalls.main([str(tmp_path / "missing.csv")])


def test_main_prints_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ncu_stalls.main([str(_export(tmp_path, gz=True)), "--top", "2"])
    out = capsys.readouterr().out
    assert "idle warps 38.1% of them" in out
    assert re.search(r"^\s+math\s+46\.2%  \(short_sb 46\.2%\)$", out, re.M)
    assert len(re.findall(r"^\s+[\d.]+%  (?:math|mbarrier wait|wgmma|other) ", out, re.M)) == 2  # --top 2
