"""Where a kernel's warps wait, from Nsight Compute's per-SASS-line source counters.

Reads the CSV of ``ncu --import R.ncu-rep --page source --print-source sass --csv`` (plain or
``.gz``) and prints each instruction class's share of the warp-stall samples, the stall reasons
inside it, the lines with the most samples, and which instructions make the excess global sectors.

Warp sampling picks among resident warps, so warps that never run (the 3 padding warps of a
warpgroup holding a 1-warp producer) still collect samples: a ``NOP`` whose samples are almost all
``stall_barrier`` is counted as ``idle`` and left out of the active shares.

    python benchmarks/ncu_stalls.py benchmarks/results/ncu-gluon-bwd-6dc7216-d128-h100-sass.csv.gz
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXCESS = "L2 Theoretical Sectors Global Excessive"
MIN_REGION_SHARE = 0.01  # code regions with fewer of the samples are left out of the report
IDLE_BARRIER_SHARE = 0.95  # a NOP's share of stall_barrier samples above which its warps count as idle

CLASSES: dict[str, tuple[str, ...]] = {
    "wgmma": ("HGMMA", "WARPGROUP"),
    "math": ("FFMA", "FADD", "FMUL", "MUFU", "FMNMX", "FSETP", "FSEL", "F2FP", "FCHK", "HADD2", "HMUL2"),
    "shared memory": ("LDS", "STS", "LDSM", "STSM"),
    "global memory": (
        "LDG",
        "STG",
        "RED",
        "ATOM",
        "ATOMG",
        "REDG",
        "UBLKRED",
        "UTMALDG",
        "UTMASTG",
        "UTMAREDG",
    ),
    "CTA sync and fences": ("BAR", "FENCE", "MEMBAR"),  # and mbarrier arrives (classify)
}


@dataclass
class CodeRegion:
    """SASS lines from one ``USETMAXREG`` to the next: in a warp-specialized kernel each partition's
    code starts with one, so a region with many samples is one partition's (or the prologue's)."""

    marker: str
    samples: int = 0
    executed: int = 0
    by_class: collections.Counter = field(default_factory=collections.Counter)


@dataclass
class StallSummary:
    """Samples per class and reason, the top lines, excess global sectors per opcode."""

    total: int = 0
    idle: int = 0
    by_class: collections.Counter = field(default_factory=collections.Counter)
    reasons: dict[str, collections.Counter] = field(default_factory=dict)
    top_lines: list[tuple[int, str, str]] = field(default_factory=list)
    excess_by_opcode: collections.Counter = field(default_factory=collections.Counter)
    regions: list[CodeRegion] = field(default_factory=list)

    @property
    def active(self) -> int:
        return self.total - self.idle


def _number(text: str) -> int:
    text = text.replace(",", "").strip()
    return int(float(text)) if text and text != "-" else 0


def opcode(source: str) -> str:
    """The base opcode of a SASS line: ``@!P0 BRA 0x..`` -> ``BRA``, ``HGMMA.64x64x16...`` -> ``HGMMA``."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def classify(source: str, reasons: collections.Counter) -> str:
    """The class of one line: ``idle``, ``mbarrier wait`` (a try-wait, or a ``BRA`` whose samples
    are mostly ``stall_long_sb``: its retry), a :data:`CLASSES` key (an mbarrier's arrive counts as
    a CTA sync), or ``other``."""
    op = opcode(source)
    samples = sum(reasons.values())
    if op == "NOP" and samples and reasons["stall_barrier"] >= IDLE_BARRIER_SHARE * samples:
        return "idle"
    if op == "BRA" and samples and reasons["stall_long_sb"] * 2 > samples:
        return "mbarrier wait"
    if op == "SYNCS":  # an mbarrier's try-wait, or its arrive / init
        return "mbarrier wait" if "TRYWAIT" in source else "CTA sync and fences"
    return next((name for name, ops in CLASSES.items() if op in ops), "other")


def _rows(path: Path) -> list[list[str]]:
    raw = path.read_bytes()
    text = gzip.decompress(raw).decode() if path.suffix == ".gz" else raw.decode()
    return list(csv.reader(io.StringIO(text)))


def summarize(path: Path, top: int = 12) -> StallSummary:
    rows = _rows(path)
    start = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if start is None:
        raise SystemExit(f"ERROR: {path}: no 'Address' header row (not an ncu --page source --csv export)")
    header = rows[start]
    column = {name: i for i, name in enumerate(header)}
    for needed in ("Source", SAMPLES):
        if needed not in column:
            raise SystemExit(f"ERROR: {path}: no '{needed}' column")
    stall_columns = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    executed_column = column.get("Instructions Executed")
    excess_column = column.get(EXCESS)
    summary = StallSummary()
    lines = []
    region = CodeRegion(marker="kernel entry")
    summary.regions.append(region)
    for row in rows[start + 1 :]:
        if len(row) != len(header):
            continue
        source = row[column["Source"]].strip()
        reasons = collections.Counter({h: _number(row[column[h]]) for h in stall_columns})
        samples = _number(row[column[SAMPLES]])
        kind = classify(source, reasons)
        op = opcode(source)
        if op == "USETMAXREG":
            region = CodeRegion(marker=source)
            summary.regions.append(region)
        region.samples += samples
        if executed_column is not None:
            region.executed += _number(row[executed_column])
        region.by_class[kind] += samples
        summary.total += samples
        if kind == "idle":
            summary.idle += samples
        else:
            summary.by_class[kind] += samples
            summary.reasons.setdefault(kind, collections.Counter()).update(reasons)
            if samples:
                lines.append((samples, kind, source))
        if excess_column is not None:
            summary.excess_by_opcode[op] += _number(row[excess_column])
    summary.top_lines = sorted(lines, key=lambda line: -line[0])[:top]
    summary.excess_by_opcode = +summary.excess_by_opcode  # drops zero counts
    return summary


def report(summary: StallSummary) -> dict:
    """Shares in percent of the active (non-idle) samples, as printed and written."""
    active = max(summary.active, 1)
    classes = {}
    for kind, samples in summary.by_class.most_common():
        if not samples:
            continue
        reasons = summary.reasons[kind]
        classes[kind] = {
            "share_pct": round(100 * samples / active, 1),
            "reasons_pct": {r[6:]: round(100 * n / active, 1) for r, n in reasons.most_common(3) if n},
        }
    return {
        "samples": summary.total,
        "idle_pct_of_all": round(100 * summary.idle / max(summary.total, 1), 1),
        "active_by_class": classes,
        "top_lines": [
            {"share_pct": round(100 * s / active, 1), "class": k, "sass": src}
            for s, k, src in summary.top_lines
        ],
        "excess_global_sectors": dict(summary.excess_by_opcode.most_common()),
        "regions": [
            {
                "starts_at": region.marker,
                "share_pct_of_all": round(100 * region.samples / max(summary.total, 1), 1),
                "executed_instructions": region.executed,
                "classes_pct_of_region": {
                    kind: round(100 * n / region.samples, 1)
                    for kind, n in region.by_class.most_common(4)
                    if n
                },
            }
            for region in summary.regions
            if region.samples >= MIN_REGION_SHARE * summary.total
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path, nargs="+", help="ncu source-page CSV exports (.csv or .csv.gz)")
    parser.add_argument("--top", type=int, default=12, help="lines with the most samples to list")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    for path in args.csv:
        if not path.is_file():
            raise SystemExit(f"ERROR: csv: {path} is not a file")
        result = report(summarize(path, top=args.top))
        if args.json:
            print(json.dumps({str(path): result}, indent=1))
            continue
        print(f"== {path.name}: {result['samples']} samples, idle warps {result['idle_pct_of_all']}% of them")
        for kind, entry in result["active_by_class"].items():
            reasons = ", ".join(f"{r} {p}%" for r, p in entry["reasons_pct"].items())
            print(f"  {kind:20s} {entry['share_pct']:5.1f}%  ({reasons})")
        for line in result["top_lines"]:
            print(f"  {line['share_pct']:5.1f}%  {line['class']:14s} {line['sass'][:72]}")
        print(f"  excess global sectors: {result['excess_global_sectors']}")
        for region in result["regions"]:
            classes = ", ".join(f"{k} {p}%" for k, p in region["classes_pct_of_region"].items())
            print(
                f"  region from {region['starts_at'][:40]!r}: {region['share_pct_of_all']}% of samples, "
                f"{region['executed_instructions']:,} instructions; {classes}"
            )


if __name__ == "__main__":
    main()
