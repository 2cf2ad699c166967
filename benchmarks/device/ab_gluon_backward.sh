#!/usr/bin/env bash
# A/B of the Gluon backward on the GPU machine: this checkout's src/ (base) against one or more other
# trees' src/ (exp), alternating processes, after the Gluon backward GPU tests on each exp. One device call.
#
#   here:   rm -rf .ab && mkdir -p .ab/<name> && git archive <exp-commit> src [tests] | tar -x -C .ab/<name>
#   device: carry [".ab"], command: bash benchmarks/device/ab_gluon_backward.sh .ab/<name>/src[,...] [rounds]
# Each round times the thd-gluon provider (the Gluon forward and backward) forward+backward
# with bench_attention.py on AB_LAYOUTS at AB_HEAD_DIMS; prints each row's median forward+backward
# TFLOP/s per tree and exp/base (the forward is the same kernel in every tree unless the exp changes it).
# AB_TEST_K narrows exp's tests (pytest -k); AB_TEST_ONLY_FIRST=1 tests the first exp only. The run
# JSONs end up in $OUT/ab-bwd-runs.tgz. An exp whose tests fail or hang is left out of the timing.
set -o pipefail
export PYTHONUNBUFFERED=1 THD_AUTOTUNE=0
IFS=, read -r -a TREES <<< "${1:?usage: ab_gluon_backward.sh EXP_SRC[,EXP_SRC...] [ROUNDS]}"
ROUNDS=${2:-2}
LAYOUTS=${AB_LAYOUTS:-"16384:256-4096 32768:512-8192 16384:64-1024"}
HEAD_DIMS=${AB_HEAD_DIMS:-"128 64"}
OUT=${OUT:-/tmp/ab}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
name_of() { basename "$(dirname "$1")"; }
tests_of() {
  local own; own="$(dirname "$1")/tests/ops/gluon/test_backward_gpu.py"
  if [ -f "$own" ]; then echo "$own"; else echo tests/ops/gluon/test_backward_gpu.py; fi
}
passed=()
for tree in "${TREES[@]}"; do
  if [ "${AB_TEST_ONLY_FIRST:-0}" = 1 ] && [ ${#passed[@]} -gt 0 ]; then passed+=("$tree"); continue; fi
  echo "== $(name_of "$tree"): Gluon backward GPU tests $(date +%T)"
  if PYTHONPATH=$tree:. timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 200 \
      "$(tests_of "$tree")" ${AB_TEST_K:+-k "$AB_TEST_K"} 2>&1 | tail -3; then
    passed+=("$tree")
  else
    echo "$(name_of "$tree"): backward tests failed or hung, left out"
  fi
done
[ ${#passed[@]} -gt 0 ] || exit 1
for i in $(seq "$ROUNDS"); do
  for src in src "${passed[@]}"; do
    name=base; [ "$src" = src ] || name=$(name_of "$src")
    # shellcheck disable=SC2086  # LAYOUTS and HEAD_DIMS are lists
    PYTHONPATH=$src:. timeout 200 python3 benchmarks/bench_attention.py \
      --out "$OUT/ab-$name-$i.json" --commit "$name" --providers thd-gluon --modes fwd fwd_bwd --layouts $LAYOUTS \
      --head-dims $HEAD_DIMS --rep-ms 40 --trials 1 --budget-s 150 > /dev/null 2>&1 || echo "$name round $i failed"
  done
done
python3 - "$OUT" <<'PY'
import collections, glob, json, os, statistics, sys
rows = collections.defaultdict(lambda: collections.defaultdict(list))  # tree -> (row, mode) -> TFLOP/s
for path in glob.glob(f"{sys.argv[1]}/ab-*-*.json"):
    tree = os.path.basename(path)[3:].rsplit("-", 1)[0]
    for r in json.load(open(path))["records"]:
        if r.get("op") == "attention" and r.get("provider") == "thd-gluon" and r.get("status") == "ok":
            s = r["shape"]
            rows[tree][(s["head_dim"], s["tokens"], s["mix"], r["mode"])].append(r["tflops"])
base = rows.pop("base", {})
for key in sorted(base):
    b = statistics.median(base[key])
    cells = [f"{t} {statistics.median(v[key]):.1f} ({statistics.median(v[key]) / b:.3f})" for t, v in sorted(rows.items()) if key in v]
    print(f"D{key[0]} {key[1]} {key[2]} {key[3]}: base {b:.1f} | " + " | ".join(cells))
PY
tar -czf "$OUT/ab-bwd-runs.tgz" -C "$OUT" $(cd "$OUT" && ls ab-*-*.json) && (cd "$OUT" && rm -f ab-*-*.json)
