#!/usr/bin/env bash
# The hang seen on the H100 under THD_KERNELS=prefer-gluon (a5507b0, 2026-12-06): the threaded ring
# test below passed alone (with its neighbour: 2 passed in 5 s) but ran past 120 s, twice, when
# tests/ops/test_attention_accumulate.py ran before it in the same process. This reruns both orders
# with pytest-timeout's thread method, which prints every thread's stack when the limit hits (a
# rank thread blocked in a CUDA call points at a hung kernel; one waiting on the hub's lock at the
# host side), then the same with CUDA_LAUNCH_BLOCKING=1 (the stack then names the launch).
#   device: bash benchmarks/device/diagnose_ring_hang.sh      (about 4 minutes when it hangs)
# On 2026-12-06 (code b69e8b7) it also hung alone once, passed alone once, and passed ten tests under
# CUDA_LAUNCH_BLOCKING=1; the stacks were lost to the output's tail, hence the logs in $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 THD_AUTOTUNE=0 THD_KERNELS=prefer-gluon
export THD_THREAD_RING_TIMEOUT_S=60  # below --timeout 75: the rank threads' stacks land in the failure message
RING="tests/cp/test_ring_variants.py::test_ring_as_threads_on_one_gpu[cp2-causal1-w256_0-cap30-sinks1]"
OUT=${OUT:-/tmp/ring-hang}; mkdir -p "$OUT"
run() {  # $1: label; the rest: test ids. The whole log (every thread's stack) lands in $OUT.
  local label=$1; shift
  local log="$OUT/ring-hang-${label//[^A-Za-z0-9_]/-}.txt"
  echo "== $label $(date +%T)"
  PYTHONPATH=src:. timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 75 \
    --timeout-method=thread "$@" > "$log" 2>&1
  # the rank threads' frames in thd and the tests (the main thread only joins them)
  grep -n "Thread\|File \"/[^\"]*/\(src/thd\|tests\)/" "$log" | grep -v "_pytest\|pluggy" | tail -40
  tail -3 "$log"
}
run "ring alone" "$RING"
run "accumulate, then ring" tests/ops/test_attention_accumulate.py "$RING"
CUDA_LAUNCH_BLOCKING=1 run "accumulate, then ring, CUDA_LAUNCH_BLOCKING=1" tests/ops/test_attention_accumulate.py "$RING"
echo "== done $(date +%T)"
