#!/usr/bin/env bash
# The GPU checks the session of 2026-12-06 left pending, in two device calls (each under 600 s),
# most important first. Branch trees travel in .br/ (add .br/ to .git/info/exclude):
#   here:   rm -rf .br && mkdir -p .br/d256 .br/pack .br/meta
#           git archive gluon-d256 src tests benchmarks | tar -x -C .br/d256
#           git archive gluon-gqa-pack src tests | tar -x -C .br/pack
#           git archive fwd-meta src | tar -x -C .br/meta
#           git archive bwd-early-exit src | tar -x -C .br/early
#   device: carry [".br"], command: bash benchmarks/device/pending_checks.sh 1   (then ... 2, ... 3)
# Call 1: main's Gluon launch plans on the GPU (host time, the Gluon GPU tests, fast launch), the
# head-dim-256 branch (its GPU tests, then Gluon against tl at 256) and the GQA-packing branch.
# Call 2: the forward A/B of fwd-meta against main, then the ring hang's diagnosis.
# Call 3: bwd-early-exit: the Gluon backward GPU tests on it, then forward+backward of the Gluon
# family on short documents, main and the branch in alternating processes.
set -o pipefail
export PYTHONUNBUFFERED=1 THD_AUTOTUNE=0
T0=$(date +%s); left() { echo $(($1 - ($(date +%s) - T0))); }
OUT=${OUT:-/tmp/pending}; mkdir -p "$OUT"
gpu_tests() {  # $1: tree root, $2: seconds, the rest: pytest arguments
  local root=$1 budget=$2; shift 2
  (cd "$root" && PYTHONPATH=src:. timeout "$budget" python3 -m pytest -q -m gpu -p no:cacheprovider \
    --timeout 120 -rf "$@" 2>&1 | tail -8)
}
nvidia-smi --query-gpu=name --format=csv,noheader
case "${1:?usage: pending_checks.sh 1|2|3}" in
1)
  echo "== main: host time per tiny forward, tl and Gluon $(date +%T)"
  PYTHONPATH=src:. timeout 90 python3 benchmarks/device/profile_host_gpu.py tl gluon 2>&1 | grep "^=="
  echo "== main: Gluon GPU tests and fast launch (the cached plans) $(date +%T)"
  gpu_tests . "$(left 300)" tests/ops/gluon tests/ops/test_fast_launch.py
  echo "== gluon-d256: head dim 256 tests $(date +%T)"
  gpu_tests .br/d256 "$(left 420)" tests/ops/gluon/test_forward_gpu.py -k 256
  echo "== gluon-d256: Gluon against tl at head dim 256 $(date +%T)"
  (cd .br/d256 && PYTHONPATH=src:. timeout "$(left 500)" python3 benchmarks/bench_gluon.py --rep-ms 40 \
    --out "$OUT/gluon-d256.json" --commit gluon-d256 --rows 256,16384:256-4096 256,32768:512-8192 2>&1 | tail -6)
  echo "== gluon-gqa-pack: packing tests $(date +%T)"
  gpu_tests .br/pack "$(left 590)" tests/ops/gluon/test_forward_gpu.py -k "packing or matches_reference"
  ;;
2)
  echo "== fwd-meta A/B $(date +%T)"
  timeout 330 bash benchmarks/device/ab_gluon_forward.sh .br/meta/src 2
  echo "== ring hang $(date +%T)"
  timeout "$(left 590)" bash benchmarks/device/diagnose_ring_hang.sh
  ;;
3)
  echo "== bwd-early-exit: Gluon backward GPU tests $(date +%T)"
  (PYTHONPATH=.br/early/src:. timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 120 -rf \
    tests/ops/gluon/test_backward_gpu.py 2>&1 | tail -4)
  for i in 1 2; do
    for tree in base exp; do
      src=src; [ "$tree" = exp ] && src=.br/early/src
      echo "-- $tree round $i"
      PYTHONPATH=$src:. timeout 75 python3 benchmarks/bench_attention.py --providers thd-gluon --budget-s 50 \
        --rep-ms 40 --trials 1 --layouts 16384:64-1024 16384:256-4096 --out "$OUT/early-$tree-$i.json" \
        --commit "$tree" 2>&1 | tail -1
      PYTHONPATH=src:. python3 benchmarks/bench_attention.py --table "$OUT/early-$tree-$i.json" 2>&1 | grep "^| 16k"
    done
  done
  ;;
esac
echo "== done $(date +%T)"
