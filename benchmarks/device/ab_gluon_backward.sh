#!/usr/bin/env bash
# A/B of the Gluon backward on the GPU machine: this checkout's src/ (base) against one or more other
# trees' src/ (exp), alternating processes, after the Gluon backward GPU tests on each exp. One device call.
#
#   here:   rm -rf .ab && mkdir -p .ab/<name> && git archive <exp-commit> src [tests] | tar -x -C .ab/<name>
#   device: carry [".ab"], command: bash benchmarks/device/ab_gluon_backward.sh .ab/<name>/src[,...] [rounds]
# Each round times the thd-gluon provider (the Gluon forward and backward) forward+backward
# with bench_attention.py on AB_LAYOUTS at AB_HEAD_DIMS; prints each row's median TFLOP/s per mode and
# tree and exp/base (the forward is the same kernel in every tree unless the exp changes it).
# AB_BUDGET_S (default 560): no timing process starts with less than AB_ROUND_S (default 90) left.
# AB_TEST_K narrows exp's tests (pytest -k); AB_TEST_ONLY_FIRST=1 tests the first exp only. The run
# JSONs end up in $OUT/ab-bwd-runs.tgz. An exp whose tests fail or hang is left out of the timing
# (benchmarks/device/_ab_common.sh).
set -o pipefail
export PYTHONUNBUFFERED=1 THD_AUTOTUNE=0
source "$(dirname "$0")/_ab_common.sh"
IFS=, read -r -a TREES <<< "${1:?usage: ab_gluon_backward.sh EXP_SRC[,EXP_SRC...] [ROUNDS]}"
ROUNDS=${2:-2}
LAYOUTS=${AB_LAYOUTS:-"16384:256-4096 32768:512-8192 16384:64-1024"}
HEAD_DIMS=${AB_HEAD_DIMS:-"128 64"}
OUT=${OUT:-/tmp/ab}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
ab_test_trees tests/ops/gluon/test_backward_gpu.py 200 "${TREES[@]}" || exit 1
ab_bench() {  # SRC NAME ROUND
  # shellcheck disable=SC2086  # LAYOUTS and HEAD_DIMS are lists
  PYTHONPATH=$1:. timeout 200 python3 benchmarks/bench_attention.py \
    --out "$OUT/ab-$2-$3.json" --commit "$2" --providers thd-gluon --modes fwd fwd_bwd --layouts $LAYOUTS \
    --head-dims $HEAD_DIMS --rep-ms 40 --trials 1 --budget-s 150 > /dev/null 2>&1
}
ab_rounds "$ROUNDS" "${AB_ROUND_S:-90}"
ab_summarize "$OUT" thd-gluon
ab_pack "$OUT" ab-bwd-runs.tgz
