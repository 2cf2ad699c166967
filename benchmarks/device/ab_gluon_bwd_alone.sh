#!/usr/bin/env bash
# A/B of the Gluon backward alone (bench_gluon_bwd.py: dK/dV, dQ, preprocess; no forward), this
# checkout's src/ (base) against other trees (exp), alternating processes, after each exp's
# tests/ops/gluon/test_backward_gpu.py. One device call; prints per round and head dim each tree's
# milliseconds and base/exp, and packs the run JSONs into $OUT/ab-bwd-alone-runs.tgz.
#   here:   mkdir -p .ab/<name> && git archive <exp-commit> | tar -x -C .ab/<name>
#   device: carry [".ab/<name>"], command: bash benchmarks/device/ab_gluon_bwd_alone.sh .ab/<name>/src[,...] [rounds]
# AB_DIMS (default "128 64"), AB_PROVIDERS (default gluon; "tl gluon" times both families),
# AB_REP_MS (60), AB_BUDGET_S (560; no process starts with less than AB_ROUND_S, default 45, left),
# AB_TEST_K / AB_TEST_ONLY_FIRST as in _ab_common.sh.
set -o pipefail
export PYTHONUNBUFFERED=1 THD_AUTOTUNE=0
source "$(dirname "$0")/_ab_common.sh"
IFS=, read -r -a TREES <<< "${1:?usage: ab_gluon_bwd_alone.sh EXP_SRC[,EXP_SRC...] [ROUNDS]}"
ROUNDS=${2:-2}
OUT=${OUT:-/tmp/ab}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
ab_test_trees tests/ops/gluon/test_backward_gpu.py 200 "${TREES[@]}" || exit 1
ab_bench() {  # SRC NAME ROUND
  # shellcheck disable=SC2086  # AB_DIMS and AB_PROVIDERS are lists
  PYTHONPATH=$1:benchmarks:. timeout 120 python3 benchmarks/bench_gluon_bwd.py --dims ${AB_DIMS:-128 64} \
    --providers ${AB_PROVIDERS:-gluon} --rep-ms "${AB_REP_MS:-60}" --out "$OUT/alone-$2-$3.json" 2>&1 | grep -E '^D[0-9]'
}
ab_rounds "$ROUNDS" "${AB_ROUND_S:-45}"
python3 - "$OUT" <<'PY'
import collections, glob, json, os, statistics, sys
ms = collections.defaultdict(lambda: collections.defaultdict(list))  # tree -> (provider, head dim) -> ms
for path in sorted(glob.glob(f"{sys.argv[1]}/alone-*-*.json")):
    tree = os.path.basename(path)[6:].rsplit("-", 1)[0]
    for r in json.load(open(path))["records"]:
        if r["status"] == "ok":
            ms[tree][(r["provider"], r["shape"]["head_dim"])].append(r["median_ms"])
base = ms.pop("base", {})
for (provider, dim), runs in sorted(base.items()):
    key = (provider, dim)
    cells = [f"{t} {statistics.median(v[key]):.3f} ms, base/exp per round {[round(b / e, 3) for b, e in zip(runs, v[key])]}"
             for t, v in sorted(ms.items()) if key in v]
    print(f"{provider} D{dim}: base {statistics.median(runs):.3f} ms | " + " | ".join(cells))
PY
ab_pack "$OUT" ab-bwd-alone-runs.tgz alone
