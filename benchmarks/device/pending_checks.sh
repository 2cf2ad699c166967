#!/usr/bin/env bash
# The GPU checks still to run, most important first, one device call each (under 600 s). The
# fifth session of 2026-12-06 measured the wait profile, the kfirst / s0 branches and the work
# order (results in benchmarks/results/: gluon-waits-7dd9cae-h100.json, gluon-fwd-*-ab-h*.json).
#   device: bash benchmarks/device/pending_checks.sh 1   (then ... 2, ... 3)
# Call 1: the Gluon forward GPU test file's work-order tests (the 10 parametrizations the merge's
#   call did not reach), the wait profile of the merged order, then
#   the backward file and fast launch on main.
# Call 2: the threaded-ring hang under prefer-gluon, with every thread's stack in $OUT.
# Call 3: the rest of the prefer-gluon GPU suite (attention, variants, ring); FA4 tests need
#   fa4-wheels.sh's stage call first. Then the FA4 / cuDNN / varlen_attn run: iteration.sh.
set -o pipefail
export PYTHONUNBUFFERED=1 THD_AUTOTUNE=0
gpu_tests() {  # $1: seconds, the rest: pytest arguments
  local budget=$1; shift
  PYTHONPATH=src:. timeout "$budget" python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 120 -rf "$@" 2>&1 | tail -8
}
nvidia-smi --query-gpu=name --format=csv,noheader
case "${1:?usage: pending_checks.sh 1|2|3}" in
1)
  echo "== Gluon forward work orders $(date +%T)"
  gpu_tests 150 tests/ops/gluon/test_forward_gpu.py -k "work_orders or graph_replay"
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
esac
echo "== done $(date +%T)"
