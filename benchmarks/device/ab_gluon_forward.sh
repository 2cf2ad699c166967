#!/usr/bin/env bash
# A/B of the Gluon forward on the GPU machine: this checkout's src/ (base) against one or more other
# trees' src/ (exp), alternating processes, after the Gluon forward GPU tests on each exp. One device call.
#
#   here:   rm -rf .ab && mkdir -p .ab/<name> && git archive <exp-commit> src [tests] | tar -x -C .ab/<name>
#           (.ab/ in .git/info/exclude; one folder per experiment)
#   device: carry [".ab"], command: bash benchmarks/device/ab_gluon_forward.sh .ab/<name>/src[,.ab/<other>/src] [rounds]
# Prints each row's median TFLOP/s per tree and exp/base; the JSONs land in $OUT/ab-<tree>-<round>.json.
# AB_BUDGET_S (default 560): no timing process starts with less than AB_ROUND_S (default 60) left.
# AB_TEST_K: a pytest -k expression narrowing exp's tests (e.g. "matches_reference or head_sections");
# AB_TEST_ARGS: more pytest arguments (split on spaces); AB_ROWS: the rows. The run JSONs end up in
# $OUT/ab-runs.tgz (one file: the device returns a limited number of files). AB_TEST_ONLY_FIRST=1:
# only the first exp is tested (trees that differ from it in a setting only).
# An exp whose tests fail or hang is left out of the timing (benchmarks/device/_ab_common.sh).
set -o pipefail
export PYTHONUNBUFFERED=1 THD_AUTOTUNE=0
source "$(dirname "$0")/_ab_common.sh"
IFS=, read -r -a TREES <<< "${1:?usage: ab_gluon_forward.sh EXP_SRC[,EXP_SRC...] [ROUNDS]}"
ROUNDS=${2:-2}
ROWS=${AB_ROWS:-"128,16384:256-4096 128,32768:512-8192 128,16384:64-1024 64,32768:512-8192"}
OUT=${OUT:-/tmp/ab}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
ab_test_trees tests/ops/gluon/test_forward_gpu.py 120 "${TREES[@]}" || exit 1
ab_bench() {  # SRC NAME ROUND
  # shellcheck disable=SC2086  # ROWS is a list
  PYTHONPATH=$1:. timeout 150 python3 benchmarks/bench_gluon.py --out "$OUT/ab-$2-$3.json" --commit "$2" \
    --rep-ms 40 --rows $ROWS > /dev/null 2>&1
}
ab_rounds "$ROUNDS" "${AB_ROUND_S:-60}"
ab_summarize "$OUT" gluon
ab_pack "$OUT" ab-runs.tgz
