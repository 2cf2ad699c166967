"""Figure of an attention benchmark result: TFLOP/s per workload, thd's kernel families against
FA4, cuDNN and varlen_attn, one panel per mode (forward, forward+backward).

    python benchmarks/plot_attention.py benchmarks/results/attention.json --out attention.png

Reads the JSON that ``bench_attention.py`` writes; a provider that was not measured on a workload
(unavailable, failed, or without that layout) has no bar there. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attention_report import MODE_NAMES, MODES, NAMES, attention_records, label, layout_text

__all__ = ["FIGURE_PROVIDERS", "FigureData", "figure_data", "main", "plot"]

FIGURE_PROVIDERS = ("thd-tl", "thd-gluon", "thd", "fa4", "cudnn", "varlen_attn")


@dataclass(frozen=True)
class FigureData:
    """What the figure shows: workloads (x axis), providers (bars), TFLOP/s per (mode, provider)
    in workload order (``None``: not measured there)."""

    workloads: list[str]
    providers: list[str]
    tflops: dict[tuple[str, str], list[float | None]]
    title: str


def figure_data(payload: dict[str, Any]) -> FigureData:
    """The causal workloads of ``payload`` (variants left out), largest head dim first."""
    records = [
        r
        for r in attention_records(payload.get("records", []))
        if r["shape"].get("variant", "causal") == "causal"
    ]
    shapes: dict[str, dict[str, Any]] = {}
    for r in records:
        shapes.setdefault(label(r["shape"]), r["shape"])
    order = sorted(shapes, key=lambda lab: -shapes[lab]["head_dim"])  # stable: run order within a head dim
    measured = {(label(r["shape"]), r["provider"], r["mode"]): float(r["tflops"]) for r in records}
    providers = [p for p in FIGURE_PROVIDERS if any(key[1] == p for key in measured)]
    tflops = {(mode, p): [measured.get((lab, p, mode)) for lab in order] for mode in MODES for p in providers}
    workloads = [f"D{shapes[lab]['head_dim']} {layout_text(shapes[lab])}" for lab in order]
    env = payload.get("env", {})
    commit = payload.get("commit") or env.get("git_sha", "?")
    title = f"{env.get('device', '?')}, bf16, causal packed documents, code at {commit}"
    return FigureData(workloads, providers, tflops, title)


def plot(payload: dict[str, Any], out: Path) -> Path:
    """Draw :func:`figure_data` of ``payload`` into the PNG ``out`` (written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = figure_data(payload)
    n = len(data.workloads)
    fig, axes = plt.subplots(len(MODES), 1, figsize=(max(8.0, 1.6 * n + 2), 4.2 * len(MODES)), squeeze=False)
    width = 0.8 / max(len(data.providers), 1)
    for ax, mode in zip(axes[:, 0], MODES, strict=True):
        for i, provider in enumerate(data.providers):
            values = data.tflops[(mode, provider)]
            xs = [x + (i - (len(data.providers) - 1) / 2) * width for x in range(n) if values[x] is not None]
            ax.bar(xs, [v for v in values if v is not None], width, label=NAMES.get(provider, provider))
        ax.set_xticks(range(n), data.workloads, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("TFLOP/s (real tokens)")
        ax.set_title(MODE_NAMES[mode])
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].legend(ncol=len(data.providers), fontsize=8, loc="upper left")
    fig.suptitle(data.title, fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".png", dir=out.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("result", type=Path, help="JSON written by bench_attention.py")
    parser.add_argument("--out", type=Path, required=True, help="PNG to write")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("ERROR: plot_attention needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 1
    try:
        payload = json.loads(args.result.read_text())
    except (OSError, ValueError) as exc:
        print(f"ERROR: plot_attention: {args.result}: {exc}", file=sys.stderr)
        return 1
    if not figure_data(payload).workloads:
        print(f"ERROR: plot_attention: {args.result}: no measured causal attention records", file=sys.stderr)
        return 1
    print(plot(payload, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
