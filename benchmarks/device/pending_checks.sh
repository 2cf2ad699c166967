#!/usr/bin/env bash
# The GPU checks still to run, most important first, one device call each (under 600 s). The
# tenth session of 2026-12-06 ran the backward's Nsight Compute profile, the bwd-dq-under-dk A/B,
# an FA4 iteration on 6dc7216 (memcheck passed; its prefer-gluon step cut by the budget), call 2
# below (the ring files under prefer-gluon: 6 passed, 2 skipped) and a cut run of the rest of the
# attention files. Not run since the eighth session: call 1 (family tests, the forward's wait
# profile) and call 3 whole. Call 4 (new): whether the 128-query dK/dV tile at head dim 64 (e1a6caa)
# is what slowed the forced Gluon backward on 64-1024-token documents (110 against 137 TFLOP/s
# between two FA4 runs); three to five minutes.
# Before these, if a lease allows: Triton 3.9 against 3.6 on the Gluon backward and forward
# (benchmarks/device/triton39.sh's header: one staging call, then the A/B in the next).
#   device: bash benchmarks/device/pending_checks.sh 4   (then 1, 3)
# Call 1: the family GPU tests, the Gluon forward's wait profile on the merged order and staged
#   output, then the prefer-gluon attention files.
# Call 2: the ring under prefer-gluon with a 300 s per-test limit (cold-cache compiles).
# Call 3: the rest of the prefer-gluon GPU suite (tests/ops, tests/cp); FA4 tests need
#   fa4-wheels.sh's stage call first.
# Call 4: the backward alone at head dim 64 on three layouts, in one process per layout: the old
#   64-query tile, today's 128-query tile, and today's with the worker consumer at 248 registers
#   (the default partition then gets 232; ptxas 3.6 moves spills from the worker to it, 564 bytes
#   in all against 588, no serialised wgmma).
set -o pipefail
export PYTHONUNBUFFERED=1 THD_AUTOTUNE=0
OUT=${OUT:-/tmp/pending}; mkdir -p "$OUT"
gpu_tests() {  # $1: seconds, the rest: pytest arguments
  local budget=$1; shift
  PYTHONPATH=src:. timeout "$budget" python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 300 -rf "$@" 2>&1 | tail -8
}
nvidia-smi --query-gpu=name --format=csv,noheader
case "${1:?usage: pending_checks.sh 1|2|3|4}" in
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
4)
  limit=250  # the first layout compiles the four kernels' variants; the others reuse them
  for layout in 16384:64-1024 16384:256-4096 32768:512-8192; do
    PYTHONPATH=src:benchmarks:. timeout "$limit" python3 benchmarks/bench_gluon_bwd.py --dims 64 --tokens "${layout%%:*}" \
      --docs "${layout#*:}" --providers tl gluon --dkdv-tiles 64x128s2c2 128x128s2c2 128x128s2c2r248 \
      --rep-ms 60 --out "$OUT/gluon-bwd-d64-tiles-${layout/:/-}.json" 2>&1 | grep -E '^D[0-9]'
    limit=150
  done
  ;;
esac
echo "== done $(date +%T)"
