#!/usr/bin/env bash
# The GPU checks still to run, most important first, one device call each (under 600 s). The
# branch checks of the earlier list ran on 2026-12-06 (H100): results in benchmarks/results/
# (gluon-fwd-meta-, gluon-fwd-vstages-, gluon-bwd-early-exit-ab-h100.json, gluon-d256-8871d33-h100.json).
#   device: bash benchmarks/device/pending_checks.sh 1   (then ... 2, ... 3)
# Call 1: main's whole Gluon forward GPU test file (with the wait profile's test), then the wait
#   profile itself (benchmarks/device/profile_gluon_waits.py: where each partition's cycles go), then
#   the backward file and fast launch. The merges of
#   head dim 256, GQA packing and the backward's early exit passed at their branch tips; on the merged
#   main (8871d33) the forward file without head dim 256 was cut by the time limit after 43 passed.
# Call 2: the threaded-ring hang under prefer-gluon, with every thread's stack in $OUT.
# Call 3: the rest of the prefer-gluon GPU suite (attention, variants, ring); FA4 tests need
#   fa4-wheels.sh's stage call first.
# Call 4: the A/B of branch fwd-kfirst (the producer issues K one tile ahead of V); first, here:
#   rm -rf .ab && mkdir .ab && git archive fwd-kfirst src | tar -x -C .ab   (carry [".ab"])
#   The same call with branch fwd-s0-overlap (the next item's first Q K^T under this item's last
#   P V and epilogue) or fwd-s0-kfirst (both changes) in .ab measures those.
set -o pipefail
export PYTHONUNBUFFERED=1 THD_AUTOTUNE=0
gpu_tests() {  # $1: seconds, the rest: pytest arguments
  local budget=$1; shift
  PYTHONPATH=src:. timeout "$budget" python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 120 -rf "$@" 2>&1 | tail -8
}
nvidia-smi --query-gpu=name --format=csv,noheader
case "${1:?usage: pending_checks.sh 1|2|3|4}" in
1)
  echo "== Gluon forward $(date +%T)"
  gpu_tests 300 tests/ops/gluon/test_forward_gpu.py
  echo "== wait profile $(date +%T)"
  PYTHONPATH=src:. timeout 90 python3 benchmarks/device/profile_gluon_waits.py --out "${OUT:-/tmp}/gluon-waits.json" \
    --commit "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" 2>&1 | tail -5
  echo "== Gluon backward and fast launch $(date +%T)"
  gpu_tests 180 tests/ops/gluon/test_backward_gpu.py tests/ops/test_fast_launch.py
  ;;
2)
  timeout 590 bash benchmarks/device/diagnose_ring_hang.sh
  ;;
3)
  THD_KERNELS=prefer-gluon gpu_tests 580 tests/ops tests/cp --ignore=tests/ops/gluon
  ;;
4)
  timeout 580 bash benchmarks/device/ab_gluon_forward.sh .ab/src 2
  ;;
esac
echo "== done $(date +%T)"
