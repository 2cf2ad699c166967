#!/usr/bin/env bash
# The hang seen on the H100 under THD_KERNELS=prefer-gluon (a5507b0, 2026-12-06): the threaded ring
# test below passed alone (with its neighbour: 2 passed in 5 s) but ran past 120 s, twice, when
# tests/ops/test_attention_accumulate.py ran before it in the same process. This reruns both orders
# with pytest-timeout's thread method, which prints every thread's stack when the limit hits (a
# rank thread blocked in a CUDA call points at a hung kernel; one waiting on the hub's lock at the
# host side), then the same with CUDA_LAUNCH_BLOCKING=1 (the stack then names the launch).
#   device: bash benchmarks/device/diagnose_ring_hang.sh      (about 4 minutes when it hangs)
set -o pipefail
export PYTHONUNBUFFERED=1 THD_AUTOTUNE=0 THD_KERNELS=prefer-gluon
RING="tests/cp/test_ring_variants.py::test_ring_as_threads_on_one_gpu[cp2-causal1-w256_0-cap30-sinks1]"
run() {  # $1: label; the rest: test ids
  local label=$1; shift
  echo "== $label $(date +%T)"
  PYTHONPATH=src:. timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 75 \
    --timeout-method=thread "$@" 2>&1 | grep -v "^\s*$" | tail -60
}
run "ring alone" "$RING"
run "accumulate, then ring" tests/ops/test_attention_accumulate.py "$RING"
CUDA_LAUNCH_BLOCKING=1 run "accumulate, then ring, CUDA_LAUNCH_BLOCKING=1" tests/ops/test_attention_accumulate.py "$RING"
echo "== done $(date +%T)"
