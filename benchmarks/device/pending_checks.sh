#!/usr/bin/env bash
# The GPU checks still to run, most important first, one device call each (under 600 s).
# Twelfth session (2026-12-07, H100): the prefer-gluon GPU suite of tests/ops and tests/cp under
# twelve xdist workers ran 379 passed, 22 skipped, no failure in 250 s before its limit stopped the
# last few percent (call 8); the shared-delta and host-time GPU tests passed (7); call 6 ran two of
# its rounds (host-ring-real-3dd98b2-h100.json); the polynomial-exp2 A/B ran and lost (0.767 / 0.869x,
# gluon-fwd-exp-poly-ab-h100.json; its code left main, see docs/gluon.md). Not run since: call 5;
# call 8 to its end; call 7 (new, compiled on the CPU only).
# Thirteenth session: call 7 ran once (H100): the row-sum tests failed (the [128, 8] ones layout;
# gluon-fwd-rowsum-ab-failed-h100.json), fixed on the CPU (8dec3d2); no machine started after it.
#   device: bash benchmarks/device/pending_checks.sh 9   (7 + 8 in one call; 5 after fa4-wheels.sh stage)
# Fourteenth session: no device machine started (eleven failed starts). Added call 10 (the
# persistent backward's tests and timing; carry [".ab"], it falls back to call 7's A/B) and 11.
# Call 1: the family GPU tests, the Gluon forward's wait profile on the merged order and staged
#   output, then the prefer-gluon attention files.
# Call 2: the ring under prefer-gluon with a 300 s per-test limit (cold-cache compiles).
# Call 3: the rest of the prefer-gluon GPU suite (tests/ops, tests/cp); FA4 tests need
#   fa4-wheels.sh's stage call first.
# Call 4: the backward alone at head dim 64 on three layouts, in one process per layout: the old
#   64-query tile, today's 128-query tile, and today's with the worker consumer at 248 registers.
# Call 5 (carry [".fa4/b"], right after `bash .fa4/a/fa4-wheels.sh stage` with carry [".fa4/a"]):
#   issue 24's variants goal on its own, every variant (window, window on one document, softcap,
#   sinks) with the plain rows it is compared to, both thd families and FA4, with the budget the
#   iteration's variants step lacks.
# Call 6: issue 22's ring goal on one GPU: the ring (rank 0 of cp = 2 alone, exchanges idle) against
#   the single call, real launches, three alternating rounds (about four minutes).
# Call 7 (carry [".ab"]; here first: bash benchmarks/device/pending_checks.sh trees): the head dim 64
#   forward with its row sums on the tensor cores (ROWSUM_MMA: P @ ones[128, 8] issued before each
#   P V; the softmax blocks' SASS 707 -> 635 instructions, FADD 426 -> 30, 80 bytes of spills outside
#   the key loop, Triton 3.6), after its GPU tests (reference, NaN, accumulate) under xdist: this
#   checkout (adds) against .ab/rowsum (its src with TILES[64].rowsum_mma = True). The polynomial
#   exp2's A/B (gluon-fwd-exp-poly-ab-h100.json) says this forward's time follows its softmax's
#   instruction count.
# Call 9 (carry [".ab"], after `trees`): call 7 with two timing rounds, then call 8 for the rest of 560 s.
# Call 10 (fourteenth session; carry [".ab"] after `trees`): the persistent dK/dV programs
#   (backward.PERSISTENT, off in every tile; compiled on the CPU only): their GPU tests, then the
#   backward alone against the per-tile programs and tl, head dims 64 and 128, short and long
#   documents, one process per layout; if the tests do not pass, call 7's A/B instead.
# Fifteenth session: call 10 ran (H100): the persistent tests passed, the backward alone 1.08x the
#   per-tile programs at head dim 64 on 64-1024, 0.93x at 128, 0.54-0.55x on 32k of 512-8192: the
#   static rounds in sections of one head (busiest program 1.87x the mean work there). Call 12: the
#   same with one section of all heads (the new default) on five layouts, in CALL_BUDGET_S (380).
# Call 8: every GPU test under prefer-gluon, twelve pytest workers (xdist: the compiles run in
#   parallel and share the Triton cache on disk; pytest-benchmark off, its xdist warning is an error
#   under our filterwarnings); SIGINT at the limit, so pytest still prints its summary. FA4 tests
#   skip without the wheels.
set -o pipefail
export PYTHONUNBUFFERED=1 THD_AUTOTUNE=0
OUT=${OUT:-/tmp/pending}; mkdir -p "$OUT"
gpu_tests() {  # $1: seconds, the rest: pytest arguments
  local budget=$1; shift
  PYTHONPATH=src:. timeout "$budget" python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 300 -rf "$@" 2>&1 | tail -8
}
rowsum_tests() {  # $1: seconds; the row-sum GPU tests under xdist, their log kept in $OUT
  PYTHONPATH=src:. timeout "$1" python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider -p no:benchmark \
    --timeout $(($1 - 10)) -rfE tests/ops/gluon/test_forward_gpu.py -k "row_sums or mma-sums" > "$OUT/rowsum-tests.log" 2>&1
  tail -6 "$OUT/rowsum-tests.log"
}
rowsum_ab() {  # $1: timing rounds, $2: their budget in seconds
  AB_ROWS="64,32768:512-8192 64,16384:256-4096 64,65536:25000-40000" AB_BUDGET_S=$2 AB_ROUND_S=40 \
    AB_SKIP_TESTS=1 bash benchmarks/device/ab_gluon_forward.sh .ab/rowsum/src "$1"
}
prefer_gluon_suite() {  # $1: seconds; SIGINT at the limit, so pytest still prints its summary
  THD_KERNELS=prefer-gluon PYTHONPATH=src:. timeout -s INT -k 20 "$1" python3 -m pytest -q -m gpu -n 12 \
    -p no:cacheprovider -p no:benchmark --timeout 400 -rfE tests -k "not autotuned" 2>&1 | tail -25
}
nvidia-smi --query-gpu=name --format=csv,noheader
case "${1:?usage: pending_checks.sh 1|2|3|4|5|6|7|8|9|10|11|12|trees}" in
trees)  # on the CPU machine: call 7's tree
  rm -rf .ab/rowsum && mkdir -p .ab/rowsum && cp -r src .ab/rowsum/
  sed -i "s/consumer_regs=160, serpentine=True)/consumer_regs=160, serpentine=True, rowsum_mma=True)/" \
    .ab/rowsum/src/thd/ops/attention/gluon/forward.py
  grep -c "rowsum_mma=True)" .ab/rowsum/src/thd/ops/attention/gluon/forward.py
  exit 0
  ;;
1)
  echo "== family tests $(date +%T)"
  gpu_tests 120 tests/ops/gluon/test_family_gpu.py
  echo "== wait profile $(date +%T)"
  PYTHONPATH=src:. timeout 90 python3 benchmarks/device/profile_gluon_waits.py --out "$OUT/gluon-waits.json" \
    --commit "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" 2>&1 | tail -5
  echo "== prefer-gluon attention files $(date +%T)"
  THD_KERNELS=prefer-gluon gpu_tests 330 tests/ops/test_attention_gpu.py tests/ops/test_attention_variants_gpu.py \
    tests/ops/test_attention_accumulate.py tests/ops/test_backward_delta.py -k "not autotuned"
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
5)
  eval "$(bash .fa4/b/fa4-wheels.sh install)" || exit 1
  PYTHONPATH=src:.:$PYTHONPATH timeout 540 python3 benchmarks/bench_attention.py --variants \
    --out "$OUT/attention-variants-$(git rev-parse --short HEAD 2>/dev/null || echo unknown).json" \
    --providers thd-tl thd-gluon fa4 --layouts 32768:512-8192 --budget-s 420 --rep-ms 40 --trials 3 2>&1 | tail -3
  PYTHONPATH=src:. python3 benchmarks/bench_attention.py --table "$OUT"/attention-variants-*.json 2>&1 | tail -12
  ;;
6)
  for round in 1 2 3; do
    for ring in 0 2; do
      PYTHONPATH=src:benchmarks:. timeout 100 python3 benchmarks/profile_host.py --launcher real --modes fwd fwd_bwd \
        --ring "$ring" --calls 200 --rounds 3 --top 0 --json "$OUT/host-ring$ring-r$round.json" 2>&1 | grep -E '^fwd'
    done
  done
  ;;
7)
  echo "== row-sum tests $(date +%T)"
  rowsum_tests 200
  rowsum_ab 3 330
  ;;
9)  # 7 with two rounds, then 8 for what is left of 560 s (device starts were scarce: one call)
  started=$(date +%s)
  echo "== row-sum tests $(date +%T)"
  rowsum_tests 150
  rowsum_ab 2 200
  left=$((560 - $(date +%s) + started))
  echo "== every GPU test under prefer-gluon, ${left} s $(date +%T)"
  prefer_gluon_suite "$left"
  ;;
8)
  prefer_gluon_suite 540
  ;;
11)  # the persistent dK/dV programs' correctness alone, in what a nearly spent budget leaves (90 s)
  PYTHONPATH=src:. timeout -s INT -k 10 90 python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider -p no:benchmark \
    --timeout 80 -rfE tests/ops/gluon/test_backward_gpu.py \
    -k "many_items or (persistent and gradients_match and atomic and bf16) or (persistent and (nan or graph))" 2>&1 | tail -12
  ;;
10)  # CALL_BUDGET_S (default 560): the call's seconds, the timing runs cut to fit; TESTS_S the tests' (140)
  started=$(date +%s)
  budget=${CALL_BUDGET_S:-560}
  echo "== persistent dK/dV tests $(date +%T)"
  tests_s=${TESTS_S:-140}
  PYTHONPATH=src:. timeout -s INT -k 15 "$tests_s" python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider -p no:benchmark \
    --timeout $((tests_s - 10)) -rfE tests/ops/gluon/test_backward_gpu.py -k persistent > "$OUT/persistent-tests.log" 2>&1
  tail -8 "$OUT/persistent-tests.log"
  if ! grep -q " passed" "$OUT/persistent-tests.log" || grep -qE "[0-9]+ (failed|errors?)" "$OUT/persistent-tests.log"; then
    echo "== the persistent tests did not pass: the row sums' A/B instead (carry .ab) $(date +%T)"
    rowsum_ab 2 $((budget - 150))
    exit 0
  fi
  # LIMIT:DIM:TILE:TOKENS:DOCS, short documents first; the first process of a head dim compiles tl's
  # and both Gluon backwards
  for run in 130:64:128x128s2c2p:16384:64-1024 120:128:64x128s3c2p:16384:64-1024 \
             80:64:128x128s2c2p:32768:512-8192 90:128:64x128s3c2p:32768:512-8192; do
    IFS=: read -r limit dim tile tokens docs <<< "$run"
    left=$((budget - $(date +%s) + started))
    [ "$left" -lt "$limit" ] && limit=$left
    [ "$limit" -lt 45 ] && { echo "== no time left for D$dim $tokens $docs"; continue; }
    echo "== backward alone, D$dim $tokens $docs ($limit s) $(date +%T)"
    PYTHONPATH=src:benchmarks:. timeout "$limit" python3 benchmarks/bench_gluon_bwd.py --dims "$dim" \
      --tokens "$tokens" --docs "$docs" --providers tl gluon --dkdv-tiles "$tile" --rep-ms 40 \
      --out "$OUT/gluon-bwd-persistent-d$dim-$tokens-$docs.json" 2>&1 | grep -E '^D[0-9]'
  done
  ;;
12)  # CALL_BUDGET_S (default 380): the persistent tests, then the backward alone on five layouts
  started=$(date +%s)
  budget=${CALL_BUDGET_S:-380}
  echo "== persistent dK/dV tests $(date +%T)"
  PYTHONPATH=src:. timeout -s INT -k 15 100 python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider -p no:benchmark \
    --timeout 90 -rfE tests/ops/gluon/test_backward_gpu.py -k persistent > "$OUT/persistent-tests.log" 2>&1
  tail -4 "$OUT/persistent-tests.log"
  for run in 64:128x128s2c2p:16384:64-1024 128:64x128s3c2p:16384:64-1024 64:128x128s2c2p:16384:256-4096 \
             64:128x128s2c2p:32768:512-8192 128:64x128s3c2p:32768:512-8192; do
    IFS=: read -r dim tile tokens docs <<< "$run"
    left=$((budget - $(date +%s) + started)); limit=60
    [ "$left" -lt "$limit" ] && limit=$left
    [ "$limit" -lt 30 ] && { echo "== no time left for D$dim $tokens $docs"; continue; }
    echo "== backward alone, D$dim $tokens $docs ($limit s) $(date +%T)"
    PYTHONPATH=src:benchmarks:. timeout "$limit" python3 benchmarks/bench_gluon_bwd.py --dims "$dim" \
      --tokens "$tokens" --docs "$docs" --providers tl gluon --dkdv-tiles "$tile" --rep-ms 40 \
      --out "$OUT/gluon-bwd-persistent-all-heads-d$dim-$tokens-$docs.json" 2>&1 | grep -E '^D[0-9]'
  done
  ;;
esac
echo "== done $(date +%T)"
