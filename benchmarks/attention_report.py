"""What the attention benchmark derives from its records: speedups of each thd provider over each
peer, the cost of padded slots, host time, the console summary and the README tables."""

from __future__ import annotations

from typing import Any

from attention_providers import ONE_DOCUMENT, PEERS, PROVIDERS, is_thd

__all__ = [
    "GOALS",
    "MODES",
    "PADDED_GOAL",
    "attention_records",
    "host_summary",
    "label",
    "markdown_tables",
    "padding_costs",
    "print_summary",
    "speedups",
    "thd_providers",
]

MODES = ("fwd", "fwd_bwd")
# Goals, as thd's speedup (peer ms / thd ms) per mode: issue 24 (FlashAttention-4; issue 10 had
# 0.9 / 0.85) and issue 4.
GOALS = {
    ("fa4", "fwd"): 1.05,
    ("fa4", "fwd_bwd"): 1.05,
    ("varlen_attn", "fwd"): 1.3,
    ("varlen_attn", "fwd_bwd"): 1.15,
    ("flex", "fwd"): 1.5,
    ("flex", "fwd_bwd"): 1.5,
}
PADDED_GOAL = 0.97  # padded-slot TFLOP/s within 3% of the packed layout's (issue 24; issue 10: 0.95)
NAMES = {"thd": "thd", "thd-tl": "thd tl", "thd-gluon": "thd gluon", "fa4": "FA4", "cudnn": "cuDNN",
         "varlen_attn": "varlen_attn", "flex": "flex"}  # fmt: skip
MODE_NAMES = {"fwd": "fwd", "fwd_bwd": "fwd+bwd"}
_EN_DASH = "\u2013"  # document-length ranges in the README tables


def label(shape: dict[str, Any]) -> str:
    """``T{tokens}-H{heads}-D{head_dim}-docs{mix}[-slots{n}][-{variant}]``: one workload."""
    docs = shape["mix"] if shape["mix"] == ONE_DOCUMENT else f"docs{shape['mix']}"
    text = f"T{shape['tokens']}-H{shape['heads']}-D{shape['head_dim']}-{docs}"
    if shape.get("slot_multiple", 1) > 1:
        text += f"-slots{shape['slot_multiple']}"
    if shape.get("variant", "causal") != "causal":
        text += f"-{shape['variant']}"
    return text


def attention_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The attention records that were measured."""
    return [r for r in records if r.get("status") == "ok" and r.get("op") == "attention"]


def thd_providers(names: Any) -> list[str]:
    """The thd providers among ``names``, in :data:`PROVIDERS` order (old files' ``thd`` included)."""
    present = set(names)
    return [p for p in PROVIDERS if p in present and is_thd(p)]


def speedups(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per shape and mode: each thd provider's speedup over each peer (peer ms / thd ms, = TFLOP/s ratio)."""
    times: dict[tuple[str, str], dict[str, float]] = {}
    for r in attention_records(records):
        times.setdefault((label(r["shape"]), r["mode"]), {})[r["provider"]] = r["median_ms"]
    rows = []
    for (lab, mode), by_provider in times.items():
        row: dict[str, Any] = {"shape": lab, "mode": mode}
        for thd in thd_providers(by_provider):
            for peer in (x for x in PEERS if x in by_provider):
                ratio = by_provider[peer] / by_provider[thd]
                row[f"{thd}/{peer}"] = ratio
                if (peer, mode) in GOALS:
                    row[f"{thd}/{peer}_meets_goal"] = ratio >= GOALS[(peer, mode)]
        rows.append(row)
    return rows


def padding_costs(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Padded-slot TFLOP/s over the packed layout's (same documents), per provider and mode."""
    packed: dict[tuple[Any, ...], float] = {}
    for r in attention_records(records):
        s = r["shape"]
        if s.get("slot_multiple", 1) == 1 and s.get("variant", "causal") == "causal":
            packed[(s["tokens"], s["mix"], s["head_dim"], r["provider"], r["mode"])] = r["median_ms"]
    rows = []
    for r in attention_records(records):
        s = r["shape"]
        key = (s["tokens"], s["mix"], s["head_dim"], r["provider"], r["mode"])
        if s.get("slot_multiple", 1) > 1 and key in packed:
            ratio = packed[key] / r["median_ms"]
            rows.append({
                "shape": label(s), "provider": r["provider"], "mode": r["mode"],
                "padded/packed": ratio, "meets_goal": ratio >= PADDED_GOAL,
            })  # fmt: skip
    return rows


def host_summary(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each thd provider's host time per call against each peer's (peer us / thd us; > 1: thd cheaper)."""
    by: dict[str, dict[str, float]] = {}
    for r in records:
        if r.get("op") == "host_time" and r.get("status") == "ok":
            by.setdefault(r["mode"], {})[r["provider"]] = r["wall_us"]
    rows = []
    for mode, us in by.items():
        row: dict[str, Any] = {"mode": mode, **{f"{k}_us": v for k, v in us.items()}}
        for thd in thd_providers(us):
            for peer in (x for x in ("fa4", "cudnn", "varlen_attn") if x in us):
                row[f"{thd}/{peer}"] = us[peer] / us[thd]
            if "varlen_attn" in us:
                row[f"{thd}_meets_goal"] = us[thd] <= us["varlen_attn"]
        rows.append(row)
    return rows


def print_summary(payload: dict[str, Any]) -> None:
    dense = payload.get("dense_matmul_tflops")
    if dense:
        print(f"dense bf16 matmul: {dense:.0f} TFLOP/s")
    print(f"{'shape':<44} {'mode':<8} {'provider':<12} {'ms':>9} {'TFLOP/s':>8} {'/dense':>7}  status")
    for r in payload["records"]:
        if r.get("op") != "attention":
            continue
        ms = f"{r['median_ms']:.3f}" if "median_ms" in r else "-"
        tf = f"{r['tflops']:.1f}" if "tflops" in r else "-"
        frac = f"{r['fraction_of_dense']:.2f}" if "fraction_of_dense" in r else "-"
        status = r["status"] + (f" ({r['error'][:80]})" if "error" in r else "")
        status += f" [{r['kernel_family']}]" if "kernel_family" in r else ""
        print(
            f"{label(r['shape']):<44} {r['mode']:<8} {r['provider']:<12} {ms:>9} {tf:>8} {frac:>7}  {status}"
        )
    for row in payload["ratios"]:
        parts = [f"{k}={v:.2f}" for k, v in row.items() if is_thd(k.split("/")[0]) and isinstance(v, float)]
        if parts:
            print(f"{row['shape']:<44} {row['mode']:<8} speedup {'  '.join(parts)}")
    for row in payload["padding"]:
        ratio = row["padded/packed"]
        print(f"{row['shape']:<44} {row['mode']:<8} {row['provider']:<12} padded/packed {ratio:.2f}")
    for r in payload["records"]:
        if r.get("op") == "host_time":
            us = f"{r['wall_us']:.0f} us/call" if "wall_us" in r else r["status"]
            print(f"host time {r['provider']:<12} {r['mode']:<8} {us}")


# ----------------------------------------------------------------------------- README tables


def _tokens_text(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def layout_text(shape: dict[str, Any]) -> str:
    """``16k / 64-1024`` (with an en dash) and the like: a workload as the README names it."""
    if shape["mix"] == ONE_DOCUMENT:
        return f"one document of {_tokens_text(shape['tokens'])}"
    text = f"{_tokens_text(shape['tokens'])} / {shape['mix'].replace('-', _EN_DASH)}"
    if shape.get("slot_multiple", 1) > 1:
        text += f", slots rounded up to {shape['slot_multiple']} rows"
    return text


def _fmt(value: float | None, digits: int = 0) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _ratio(ms: dict[tuple[str, str, str], float], lab: str, thd: str, peer: str, mode: str) -> float | None:
    thd_ms, peer_ms = ms.get((lab, thd, mode)), ms.get((lab, peer, mode))
    return peer_ms / thd_ms if thd_ms and peer_ms else None


def _preamble(payload: dict[str, Any]) -> str:
    env = payload.get("env", {})
    dense = payload.get("dense_matmul_tflops")
    commit = payload.get("commit", env.get("git_sha", "?"))
    versions = (
        f"torch {env.get('torch', '?')}, Triton {env.get('triton', '?')}, FA4 {env.get('fa4') or 'absent'}"
    )
    if env.get("cudnn_frontend"):
        versions += f", cudnn-frontend {env['cudnn_frontend']}"
    rounds = payload.get("config", {}).get("rounds", 1)
    timing = (
        "calls back to back between one pair of CUDA events"
        if "timing_definition" in payload
        else "triton.testing.do_bench (L2 flush between calls)"
    )
    return (
        f"Measured on {env.get('device', '?')} ({versions}; code at `{commit}`), "
        f"bf16, causal packed documents, TFLOP/s on real tokens (fwd+bwd counted as 3.5x fwd), {timing}"
        + (f" (median of {rounds} rounds, the providers taking turns)" if rounds > 1 else "")
        + (f"; dense bf16 matmul in the same run: {dense:.0f} TFLOP/s." if dense else ".")
    )


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def markdown_tables(payload: dict[str, Any]) -> str:
    """The README performance tables (markdown) of one result file."""
    dense = payload.get("dense_matmul_tflops")
    tf: dict[tuple[str, str, str], float] = {}
    ms: dict[tuple[str, str, str], float] = {}
    shapes: dict[str, dict[str, Any]] = {}
    for r in attention_records(payload.get("records", [])):
        lab = label(r["shape"])
        shapes.setdefault(lab, r["shape"])
        tf[(lab, r["provider"], r["mode"])] = r["tflops"]
        ms[(lab, r["provider"], r["mode"])] = r["median_ms"]
    providers = [p for p in PROVIDERS if any(k[1] == p for k in tf)]
    thds = thd_providers(providers)
    lines = [_preamble(payload)]
    ratio_peers = [p for p in ("fa4", "cudnn", "varlen_attn") if p in providers]
    for head_dim in sorted({s["head_dim"] for s in shapes.values()}, reverse=True):
        labels = [
            lab
            for lab, s in shapes.items()
            if s["head_dim"] == head_dim and s.get("variant", "causal") == "causal"
        ]
        if not labels:
            continue
        cols = [f"{NAMES[p]} {MODE_NAMES[m]}" for m in MODES for p in providers]
        cols += [f"{NAMES[t]}/{NAMES[p]} {MODE_NAMES[m]}" for t in thds for p in ratio_peers for m in MODES]
        cols += [f"{NAMES[t]} {MODE_NAMES[m]} / dense" for t in thds for m in MODES] if dense else []
        rows = []
        for lab in labels:
            cells = [_fmt(tf.get((lab, p, m))) for m in MODES for p in providers]
            cells += [_fmt(_ratio(ms, lab, t, p, m), 2) for t in thds for p in ratio_peers for m in MODES]
            if dense:
                cells += [
                    _fmt(tf[(lab, t, m)] / dense if (lab, t, m) in tf else None, 2)
                    for t in thds
                    for m in MODES
                ]
            rows.append([layout_text(shapes[lab]), *cells])
        heads = shapes[labels[0]]["heads"]
        lines += ["", f"head_dim {head_dim}, {heads} heads:", ""]
        lines += _table(["tokens / document lengths", *cols], rows)
    lines += _host_table(payload.get("records", []))
    lines += _variant_table(shapes, tf, ms, thds)
    skipped = payload.get("variants_skipped") or []
    if skipped:
        lines += [
            "",
            "Variants not measured: " + "; ".join(f"{v['variant']} ({v['reason']})" for v in skipped),
        ]
    return "\n".join(lines)


def _host_table(records: list[dict[str, Any]]) -> list[str]:
    host = [r for r in records if r.get("op") == "host_time"]
    if not host:
        return []
    names = [p for p in PROVIDERS if any(r["provider"] == p for r in host)]
    shape = host[0]["shape"]
    rows = []
    for mode in MODES:
        by = {r["provider"]: r.get("wall_us") for r in host if r["mode"] == mode}
        rows.append([MODE_NAMES[mode], *(_fmt(by.get(p)) for p in names)])
    return [
        "",
        "Host time per eager call, µs (wall clock over back-to-back calls, "
        f"{shape['docs']} documents of {shape['tokens'] // shape['docs']} tokens, "
        f"{shape['heads']} heads, head_dim {shape['head_dim']}):",
        "",
        *_table(["mode", *(NAMES[p] for p in names)], rows),
    ]


def _variant_table(
    shapes: dict[str, dict[str, Any]],
    tf: dict[tuple[str, str, str], float],
    ms: dict[tuple[str, str, str], float],
    thds: list[str],
) -> list[str]:
    variants = [lab for lab, s in shapes.items() if s.get("variant", "causal") != "causal"]
    if not variants:
        return []
    providers = [*thds, "fa4"]
    cols = [f"{NAMES[p]} {MODE_NAMES[m]}" for m in MODES for p in providers]
    cols += [f"{NAMES[t]}/FA4 {MODE_NAMES[m]}" for t in thds for m in MODES]
    rows = []
    for lab in variants:
        s = shapes[lab]
        cells = [_fmt(tf.get((lab, p, m))) for m in MODES for p in providers]
        cells += [_fmt(_ratio(ms, lab, t, "fa4", m), 2) for t in thds for m in MODES]
        rows.append([s["variant"], f"{layout_text(s)}, D {s['head_dim']}", *cells])
    title = "Variants (thd and FA4 with the same settings), TFLOP/s on visible pairs:"
    return ["", title, "", *_table(["variant", "shape", *cols], rows)]
