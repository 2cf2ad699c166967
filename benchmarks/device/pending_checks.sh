#!/usr/bin/env bash
# The GPU checks still to run, most important first, one device call each (under 600 s). The
# eighth session of 2026-12-06 ran auto's family GPU tests (6 passed, the head-dim-128 rule at 512
# included), the backward tile sweep and A/B (gluon-bwd-tiles-ab-h100.json: new dK/dV tiles merged as
# e1a6caa, their test_backward_gpu.py passed, 38), two backward A/Bs (not merged) and the ring's host
# time before and after its trims (host-ring-trims-ab-h100.json). Not run since: the wait profile,
# the prefer-gluon attention and ring files, the rest of the prefer-gluon suite, and an FA4
# iteration on the new backward tiles (benchmarks/device/iteration.sh). The ninth session got no
# lease; it adds two checks, after these three calls or before them if time is short:
#   NCU_DIMS="128 64" bash benchmarks/device/ncu_backward.sh   (the backward's Nsight Compute summary)
#   bash benchmarks/device/ab_gluon_bwd_alone.sh .ab/bwd-dq-under-dk/src 2   (carry .ab/bwd-dq-under-dk:
#   git archive 9124a4e | tar -x -C .ab/bwd-dq-under-dk)
#   device: bash benchmarks/device/pending_checks.sh 1   (then ... 2, ... 3)
# Call 1: the family GPU tests, the Gluon forward's wait profile on the merged order and staged
#   output, then the prefer-gluon attention files.
# Call 2: the ring under prefer-gluon with a 300 s per-test limit (cold-cache compiles).
# Call 3: the rest of the prefer-gluon GPU suite (tests/ops, tests/cp); FA4 tests need
#   fa4-wheels.sh's stage call first.
set -o pipefail
export PYTHONUNBUFFERED=1 THD_AUTOTUNE=0
OUT=${OUT:-/tmp/pending}; mkdir -p "$OUT"
gpu_tests() {  # $1: seconds, the rest: pytest arguments
  local budget=$1; shift
  PYTHONPATH=src:. timeout "$budget" python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 300 -rf "$@" 2>&1 | tail -8
}
nvidia-smi --query-gpu=name --format=csv,noheader
case "${1:?usage: pending_checks.sh 1|2|3}" in
1)
  echo "== family tests $(date +%T)"
  gpu_tests 120 tests/ops/gluon/test_family_gpu.py
  echo "== wait profile $(date +%T)"
  PYTHONPATH=src:. timeout 90 python3 benchmarks/device/profile_gluon_waits.py --out "$OUT/gluon-waits.json" \
    --commit "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" 2>&1 | tail -5
  echo "== prefer-gluon attention files $(date +%T)"
  THD_KERNELS=prefer-gluon gpu_tests 330 tests/ops/test_attention_gpu.py tests/ops/test_attention_variants_gpu.py \
    tests/ops/test_attention_accumulate.py -k "not autotuned"
  ;;
2)
  THD_KERNELS=prefer-gluon gpu_tests 580 tests/cp/test_ring_variants.py tests/cp/test_ring.py tests/cp/test_plan_cache.py
  ;;
3)
  THD_KERNELS=prefer-gluon gpu_tests 580 tests/ops tests/cp --ignore=tests/ops/gluon -k "not autotuned"
  ;;
esac
echo "== done $(date +%T)"
