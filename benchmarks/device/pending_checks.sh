#!/usr/bin/env bash
# The GPU checks still to run, most important first, one device call each (under 600 s). The
# sixth session of 2026-12-06 ran the FA4 / cuDNN / varlen_attn benchmark (attention-9028dd2-h100.json),
# the backward's operand placements, the forward's work-order tests (26 passed), the Gluon backward
# and host-path files (41 of 42 passed), memcheck of the Gluon bounds tests, and found the cause of
# the "ring hang" (Triton compiling on a cold cache past the 120 s per-test limit) and of the
# fast-launch failure (fixed in e042ed5, not yet run on a GPU).
#   device: bash benchmarks/device/pending_checks.sh 1   (then ... 2, ... 3)
# Call 1: the fast-launch GPU tests on the fix, host time (bench_host.py; the ring against the single
#   call with profile_host.py --launcher real on one GPU), the Gluon forward's wait
#   profile on the merged order, then the prefer-gluon attention files (cut at 330 s last time
#   with 20 passed and none failed).
# Call 2: the ring under prefer-gluon with a 300 s per-test limit (cold-cache compiles).
# Call 3: the rest of the prefer-gluon GPU suite (tests/ops, tests/cp); FA4 tests need
#   fa4-wheels.sh's stage call first.
# Then the branches of docs/gluon.md, one call each:
#   here:   rm -rf .ab && for b in bwd-order bwd-dq-double bwd-order-dq-double fwd-q-ahead fwd-epilogue-smem \
#             fwd-ahead-epilogue fwd-d64-plain; do mkdir -p .ab/$b && git archive $b src tests | tar -x -C .ab/$b; done
#   device: carry [".ab"], command: bash benchmarks/device/ab_gluon_backward.sh \
#           .ab/bwd-order/src,.ab/bwd-dq-double/src,.ab/bwd-order-dq-double/src 2
#   device: carry [".ab"], command: AB_TEST_K="matches_reference or q_ahead or work_orders or accumulate" \
#           bash benchmarks/device/ab_gluon_forward.sh .ab/fwd-q-ahead/src,.ab/fwd-epilogue-smem/src,.ab/fwd-ahead-epilogue/src 2
#   (bwd-order-dq-double and fwd-ahead-epilogue: the two changes of each family together)
#   device: carry [".ab"] (with fwd-d64-plain archived too), command: AB_ROWS="64,16384:64-1024 64,16384:256-4096 \
#           64,32768:512-8192" AB_TEST_K=matches_reference bash benchmarks/device/ab_gluon_forward.sh .ab/fwd-d64-plain/src 2
#   (the head-dim-64 forward on short documents: 87 TFLOP/s at 9028dd2, 130 at a5507b0)
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
  echo "== fast launch $(date +%T)"
  gpu_tests 90 tests/ops/test_fast_launch.py
  echo "== host time $(date +%T)"
  PYTHONPATH=src:. timeout 90 python3 benchmarks/bench_host.py --providers thd varlen_attn \
    --out "$OUT/host-time.json" 2>&1 | grep -v Warn | tail -6
  echo "== ring host time against the single call, one GPU, real launches (issue 22: <= 2x) $(date +%T)"
  for ring in 0 2; do
    PYTHONPATH=src:. timeout 60 python3 benchmarks/profile_host.py --launcher real --modes fwd fwd_bwd --ring $ring \
      --calls 300 --rounds 5 --top 0 --json "$OUT/host-real-ring$ring.json" 2>&1 | grep -v Warn | tail -2
  done
  echo "== wait profile $(date +%T)"
  PYTHONPATH=src:. timeout 90 python3 benchmarks/device/profile_gluon_waits.py --out "$OUT/gluon-waits.json" \
    --commit "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" 2>&1 | tail -5
  echo "== prefer-gluon attention files $(date +%T)"
  THD_KERNELS=prefer-gluon gpu_tests 300 tests/ops/test_attention_gpu.py tests/ops/test_attention_variants_gpu.py \
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
