#!/usr/bin/env bash
# A/B of the Gluon forward on the GPU machine: this checkout's src/ (base) against one or more other
# trees' src/ (exp), alternating processes, after the Gluon forward GPU tests on each exp. One device call.
#
#   here:   rm -rf .ab && mkdir -p .ab/<name> && git archive <exp-commit> src [tests] | tar -x -C .ab/<name>
#           (.ab/ in .git/info/exclude; one folder per experiment)
#   device: carry [".ab"], command: bash benchmarks/device/ab_gluon_forward.sh .ab/<name>/src[,.ab/<other>/src] [rounds]
# Prints each row's median TFLOP/s per tree and exp/base; the JSONs land in $OUT/ab-<tree>-<round>.json.
# AB_TEST_K: a pytest -k expression narrowing exp's tests (e.g. "matches_reference or head_sections");
# AB_TEST_ARGS: more pytest arguments (split on spaces); AB_ROWS: the rows. The run JSONs end up in
# $OUT/ab-runs.tgz (one file: the device returns a limited number of files). AB_TEST_ONLY_FIRST=1:
# only the first exp is tested (trees that differ from it in a setting only).
# An exp whose tests fail or hang is left out of the timing.
set -o pipefail
export PYTHONUNBUFFERED=1 THD_AUTOTUNE=0
IFS=, read -r -a TREES <<< "${1:?usage: ab_gluon_forward.sh EXP_SRC[,EXP_SRC...] [ROUNDS]}"
ROUNDS=${2:-2}
ROWS=${AB_ROWS:-"128,16384:256-4096 128,32768:512-8192 128,16384:64-1024 64,32768:512-8192"}
OUT=${OUT:-/tmp/ab}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
name_of() { basename "$(dirname "$1")"; }  # .ab/kfirst/src -> kfirst; .ab/src -> .ab
tests_of() {  # the exp's own test file when its tree has tests/ (git archive <commit> src tests)
  local own; own="$(dirname "$1")/tests/ops/gluon/test_forward_gpu.py"
  if [ -f "$own" ]; then echo "$own"; else echo tests/ops/gluon/test_forward_gpu.py; fi
}
passed=()
for tree in "${TREES[@]}"; do
  if [ "${AB_TEST_ONLY_FIRST:-0}" = 1 ] && [ ${#passed[@]} -gt 0 ]; then passed+=("$tree"); continue; fi
  echo "== $(name_of "$tree"): Gluon forward GPU tests $(date +%T)"
  # a kernel that hangs is cut by `timeout` (the call's own limit would take the whole lease)
  # shellcheck disable=SC2086  # AB_TEST_ARGS is a list of arguments
  if PYTHONPATH=$tree:. timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 120 \
      "$(tests_of "$tree")" ${AB_TEST_K:+-k "$AB_TEST_K"} ${AB_TEST_ARGS:-} 2>&1 | tail -3; then
    passed+=("$tree")
  else
    echo "$(name_of "$tree"): forward tests failed or hung, left out"
  fi
done
[ ${#passed[@]} -gt 0 ] || exit 1
for i in $(seq "$ROUNDS"); do
  for src in src "${passed[@]}"; do
    name=base; [ "$src" = src ] || name=$(name_of "$src")
    # shellcheck disable=SC2086  # ROWS is a list
    PYTHONPATH=$src:. timeout 150 python3 benchmarks/bench_gluon.py --out "$OUT/ab-$name-$i.json" --commit "$name" \
      --rep-ms 40 --rows $ROWS > /dev/null 2>&1 || echo "$name round $i failed"
  done
done
python3 - "$OUT" <<'PY'
import collections, glob, json, os, statistics, sys
rows = collections.defaultdict(lambda: collections.defaultdict(list))  # tree -> row -> TFLOP/s
for path in glob.glob(f"{sys.argv[1]}/ab-*-*.json"):
    tree = os.path.basename(path)[3:].rsplit("-", 1)[0]
    for r in json.load(open(path))["records"]:
        if r["provider"] == "gluon" and r["status"] == "ok":
            s = r["shape"]
            rows[tree][(s["head_dim"], s["tokens"], s["mix"], s["slot_multiple"])].append(r["tflops"])
base = rows.pop("base", {})
for key in sorted(base):
    b = statistics.median(base[key])
    cells = [f"{t} {statistics.median(v[key]):.1f} ({statistics.median(v[key]) / b:.3f})" for t, v in sorted(rows.items()) if key in v]
    print(f"D{key[0]} {key[1]} {key[2]} slots{key[3]}: base {b:.1f} | " + " | ".join(cells))
PY
tar -czf "$OUT/ab-runs.tgz" -C "$OUT" $(cd "$OUT" && ls ab-*-*.json) && (cd "$OUT" && rm -f ab-*-*.json)
