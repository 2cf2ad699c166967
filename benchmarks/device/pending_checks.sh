#!/usr/bin/env bash
# The GPU checks still to run, most important first, one device call each (under 600 s).
# Twenty-third session (2026-12-07): call 8 on 4a2ed0e 514 passed, none failed (cut at 330 s past
# 91%); the FA4 goal table ran (attention-4a2ed0e-h100.json); call 26 mixed (not merged); call 28
# (tiny JSONs only) and call 6 ran; call 29 (new: autograd's device thread) ran. Still to run, in
# order: call 30 (new: the short rows with and without autograd's device thread, FA4 included; stage
# .fa4/a with stage_fa4.sh first), call 8 to its end, call 26 with more rounds at head dim 64 alone.
# Twenty-second session (2026-12-07): call 27 passed (the calls return before the GPU is done);
# call 8 on 51c0159: 1 failed (the Gluon backward's work list on Triton's normal launch path,
# fixed in 2b3118d and 63ac1e2), 522 passed, 22 skipped, interrupted at 300 s; its first try was
# interrupted while pytest printed a long traceback, with no summary: the suite prints one line
# per failure now. Still to run, in order: call 8 on the fix, the FA4 goal table, call 26, call 28
# (new: the host's time on the benchmark's short documents), call 6.
# Twenty-first session (2026-12-07): two calls found no machine, one was taken back mid-call with
# no output, then loans were paused: nothing ran. Still to run, in order: call 8 (or 23 with
# SUITE_S=170 at least) on the late dQ, call 27 (short), the FA4 goal table (fa4-wheels.sh stage,
# then BENCH_ONLY=1 iteration.sh), call 26 (carry [".ab/scale-in-lse"]), call 6.
# Twentieth session (2026-12-07): fifteen calls found no machine; the one lease ran call 25 (the
# dq-atomics tree 1.6-1.8x slower than main: dropped; calls 21, 22 and 24, its longer A/Bs, were
# never run and are gone) and call 23, cut at 105 s with no summary. Still to run, in order: call 8
# (or 23 with SUITE_S=170 at least) on the late dQ, the FA4 goal table on it (fa4-wheels.sh stage,
# then BENCH_ONLY=1 iteration.sh), call 6.
# Nineteenth session (2026-12-07): call 19 ran (persistent dQ by rows level with columns: no change),
# the FA4 goal table ran on 350e9a2; the late dQ (293af86) passed test_backward_gpu.py only. Still
# to run: call 8 on the late dQ (every two-partition dK/dV program changed, the ring's too), call 6,
# and the FA4 goal table on the late dQ (fa4-wheels.sh stage, then BENCH_ONLY=1 iteration.sh).
# Eighteenth session (2026-12-07): call 18 ran on an H200 (the Gluon f+b on short documents is
# host-bound), call 20 on an H100 (host issue times per part; the suite of tests/ops and tests/cp
# under prefer-gluon: 417 passed, none failed, cut at 79%). Still to run: call 8 to its end,
# call 19, call 6, and the FA4 goal table (fa4-wheels.sh stage, then BENCH_ONLY=1 iteration.sh).
# Call 20: where the Gluon forward+backward's host time goes on short documents (call 18 found it
#   host-bound: ~800 us of issue per call against tl's ~350-490): profile_fwd_bwd_gpu.py with the
#   torch profiler's host events and the forward's and backward's issue times apart, then call 8's
#   suite under a shorter limit.
# Call 18: profile_fwd_bwd_gpu.py on the short-document rows: GPU time per call, the host's issue
#   time per call and the kernels of one call, per family. From the committed JSONs the Gluon
#   forward+backward at head dim 64 on 16k of 64-1024 runs ~300 us per call longer than its forward
#   (attention-9fe89b8-h100.json) and its backward alone (gluon-bwd-dynamic-9fe89b8-h100.json) add
#   up to (tl: ~90 us; head dim 128: ~60 us): host-bound, or kernels the parts do not run?
# Call 19: dQ by query rows in the persistent dK/dV programs (the head-dim-64 default up to
#   max_seqlen_kv 2048): two more rounds against the split by columns on three layouts.
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
# Call 8: the GPU tests of tests/ops and tests/cp under prefer-gluon, twelve pytest workers (xdist: the compiles run in
#   parallel and share the Triton cache on disk; pytest-benchmark off, its xdist warning is an error
#   under our filterwarnings); SIGINT at the limit, so pytest still prints its summary. FA4 tests
#   skip without the wheels. 280 s on an H100 (fifteenth session); the whole tests/ tree did not fit
#   540 s (sixteenth).
# Call 14 (carry [".fa4/b"], after the stage call): the Gluon backward's softcap tests, then
#   forward and forward+backward with softcap 50 against tl and FA4, and with one-partition tiles.
# Call 15: the GPU tests outside tests/ops and tests/cp (integrations, layout, release, CI tools)
#   under prefer-gluon, as call 8.
# Call 16: the forward's sequence-major work list (forward.SEQUENCE_MAJOR, compiled and tested on
#   the CPU only): its GPU tests, then the default tiles timed over both list orders in one
#   process, two rounds, on the 64k rows (two 25k-40k documents, where the Gluon forward at head dim
#   128 trails FA4 most and moved 535-614 TFLOP/s between runs) and on shorter documents.
# Call 17: the head-dim-64 dK/dV tile with dQ split by query rows (GluonTile.dq_rows, FA3's split,
#   compiled and launch-tested on the CPU only): its GPU tests, then the backward alone against the
#   default split by columns, per-tile and persistent, on three layouts.
set -o pipefail
export PYTHONUNBUFFERED=1 THD_AUTOTUNE=0
OUT=${OUT:-/tmp/pending}; mkdir -p "$OUT"
gpu_tests() {  # $1: seconds, the rest: pytest arguments
  local budget=$1; shift
  PYTHONPATH=src:. timeout "$budget" python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 300 -rf "$@" 2>&1 | tail -8
}
prefer_gluon_suite() {  # $1: seconds, the rest: paths; SIGINT at the limit, so pytest still prints its summary
  local budget=$1; shift
  THD_KERNELS=prefer-gluon PYTHONPATH=src:. timeout -s INT -k 20 "$budget" python3 -m pytest -q -m gpu -n 12 \
    -p no:cacheprovider -p no:benchmark --timeout 400 -rfE --tb=line "$@" -k "not autotuned" 2>&1 | tail -25
}
exp_tree() {  # $1: name under .ab/, $2: branch, the rest: what to archive; exits unless .ab/$1/src exists
  local name=$1 branch=$2
  shift 2
  [ -d ".ab/$name/src" ] || {
    echo "no .ab/$name/src: mkdir -p .ab/$name && git archive $branch $* | tar -x -C .ab/$name"
    exit 1
  }
}
nvidia-smi --query-gpu=name --format=csv,noheader
case "${1:?usage: pending_checks.sh 1|2|3|4|5|6|8|13|14|15|16|17|18|19|20|23|25|26|27|28|29|30}" in
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
8)  # SUITE_S (default 540): the suite's limit
  prefer_gluon_suite "${SUITE_S:-540}" tests/ops tests/cp
  ;;
25)  # the least that says something of the atomics tree (about 150 s): its smoke (tl and Gluon,
  # rel diff against tl), then this checkout's Gluon backward in the same shapes
  exp_tree dq-atomics bwd-dq-atomics src
  tree=.ab/dq-atomics/src
  echo "== smoke, the tree $(date +%T)"
  PYTHONPATH=$tree:benchmarks:. timeout 80 python3 benchmarks/bench_gluon_bwd.py --dims 64 128 --providers tl gluon \
    --rep-ms 20 --out "$OUT/dq-atomics-smoke.json" 2>&1 | grep -E '^D[0-9]' || { echo "smoke failed or hung"; exit 1; }
  echo "== this checkout $(date +%T)"
  PYTHONPATH=src:benchmarks:. timeout 70 python3 benchmarks/bench_gluon_bwd.py --dims 64 128 --providers gluon \
    --rep-ms 20 --out "$OUT/main-smoke.json" 2>&1 | grep -E '^D[0-9]'
  ;;
26)  # branch bwd-scale-in-lse (the softmax scale folded into the staged lse: one multiply less per
  # score in both families' dK/dV and dQ kernels; the tl kernels tested on the CPU, the Gluon ones
  # compiled only): its own Gluon backward GPU tests (a subset: the scale-range test, the gradient
  # oracle, accumulate mode), then the backward alone, tl and Gluon, against this checkout, two
  # alternating rounds (about 480 s)
  exp_tree scale-in-lse bwd-scale-in-lse src tests
  tree=.ab/scale-in-lse/src
  AB_PROVIDERS="tl gluon" AB_ROUND_S=70 AB_REP_MS=40 \
    AB_TEST_K="softmax_scales or accumulate or (gradients_match and bf16 and atomic)" \
    bash benchmarks/device/ab_gluon_bwd_alone.sh "$tree" 2
  ;;
27)  # does a call wait for the GPU? (twenty-first session: in profile-host-events-ceecaa0-h100.json the
  # backward alone issued in 423 us per call against 417 us of its kernels, tl and Gluon alike, where
  # the forward issued in 62 against 116, and a tiny problem's backward takes ~250 us of host time):
  # a forward+backward queued behind a 100 ms GPU sleep, both families and dQ modes (about 90 s)
  gpu_tests 150 tests/ops/test_attention_gpu.py -k "return_before or no_host_sync"
  ;;
28)  # where the host's time goes on the benchmark's short documents (call 27 passed: no call waits for
  # the GPU, yet the ceecaa0 profile issued a forward+backward in 694 us against 532 us of kernels,
  # the backward alone in ~425 us, where a tiny problem's takes ~250): cProfile of real launches on
  # 16k of 64-1024 at head dim 64, 16 heads, both families, then the tiny problem (about 120 s)
  for family in tl gluon; do
    for layout in 16384:64-1024 ""; do
      echo "== $family ${layout:-two documents of 64} $(date +%T)"
      PYTHONPATH=src:benchmarks:. timeout 100 python3 benchmarks/profile_host.py --launcher real --family "$family" \
        ${layout:+--layout "$layout"} --heads 16 --head-dim 64 --calls 50 --rounds 3 --profile-calls 30 --top 25 \
        --json "$OUT/host-$family-$(echo "${layout:-tiny}" | tr ':' '_').json" 2>&1 | head -60
    done
  done
  ;;
29)  # is the forward+backward's host floor autograd's device thread? (twenty-third session: on the H100
  # a tiny problem's backward added ~620 us of host time to thd's forward, ~710 to varlen_attn's, ~480
  # to FA4's, where thd's own Python backward costs ~90 us on the CPU): bench_host with autograd's
  # multithreading on and off, the elementwise floor beside thd (both families) and varlen_attn, then
  # the short-document row's host profile both ways (about 150 s)
  for threads in on off; do
    echo "== autograd threads $threads $(date +%T)"
    PYTHONPATH=src:benchmarks:. timeout 100 python3 benchmarks/bench_host.py --providers thd varlen_attn elementwise \
      --autograd-threads "$threads" --calls 300 --rounds 5 --out "$OUT/host-threads-$threads.json" 2>&1 | grep -E '^(host|thd)'
    THD_KERNELS=gluon PYTHONPATH=src:benchmarks:. timeout 60 python3 benchmarks/bench_host.py --providers thd \
      --autograd-threads "$threads" --calls 300 --rounds 5 --out "$OUT/host-threads-$threads-gluon.json" 2>&1 | grep -E '^host'
  done
  for threads in on off; do
    for family in tl gluon; do
      echo "== $family 16384:64-1024 autograd threads $threads $(date +%T)"
      PYTHONPATH=src:benchmarks:. timeout 60 python3 benchmarks/profile_host.py --launcher real --family "$family" \
        --layout 16384:64-1024 --heads 16 --head-dim 64 --calls 50 --rounds 3 --profile-calls 30 --top 12 \
        --autograd-threads "$threads" --modes fwd_bwd --json "$OUT/host-$family-16k-threads-$threads.json" 2>&1 | head -16
    done
  done
  ;;
30)  # (carry [".fa4/b"], after stage_fa4.sh part and wheels) the short-document rows with autograd's
  # device thread and without, every provider in the same process per setting: does thd's
  # forward+backward there lead FA4 once neither is bound by the host? (twenty-third session: tl's
  # took 687-1167 us per call with the thread, 532-535 without, its kernels' time; about 120 s)
  eval "$(bash .fa4/b/fa4-wheels.sh install)" || exit 1
  for threads in on off; do
    echo "== autograd threads $threads $(date +%T)"
    PYTHONPATH=src:.:$PYTHONPATH timeout 100 python3 benchmarks/bench_attention.py --autograd-threads "$threads" \
      --out "$OUT/attention-short-threads-$threads.json" --providers thd thd-tl thd-gluon fa4 cudnn varlen_attn \
      --layouts 16384:64-1024 --modes fwd_bwd --rep-ms 40 --trials 2 --rounds 2 --budget-s 80 2>&1 | tail -2
    PYTHONPATH=src:. python3 benchmarks/bench_attention.py --table "$OUT/attention-short-threads-$threads.json" 2>&1 \
      | grep -E '^\| (head|1|6|---)' | cut -c1-400
  done
  ;;
23)  # SUITE_S (default 170): call 8's part that runs the ring's Gluon steps and accumulate mode
  prefer_gluon_suite "${SUITE_S:-170}" tests/cp tests/ops/test_attention_accumulate.py
  ;;
15)
  prefer_gluon_suite 540 tests --ignore=tests/ops --ignore=tests/cp
  ;;
16)
  echo "== work-order tests (sequence-major included) $(date +%T)"
  PYTHONPATH=src:. timeout -s INT -k 10 150 python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider -p no:benchmark \
    --timeout 140 -rfE tests/ops/gluon/test_forward_gpu.py -k "work_orders" 2>&1 | tail -4
  for round in 1 2; do
    echo "== forward, longest-first against sequence-major lists, round $round $(date +%T)"
    PYTHONPATH=src:. timeout 170 python3 benchmarks/bench_gluon.py --sequence-major --rep-ms 40 \
      --rows 128,65536:25000-40000 128,32768:512-8192 64,65536:25000-40000 128,16384:256-4096 \
      --out "$OUT/gluon-fwd-sequence-major-r$round.json" 2>&1 | grep -E "TFLOP|WRONG|differs"
  done
  ;;
13)  # CALL_BUDGET_S (default 560): the dynamic persistent dK/dV programs' tests, then their timing
  started=$(date +%s)
  budget=${CALL_BUDGET_S:-560}
  echo "== persistent dK/dV tests, static (the default's sections of 4) and dynamic $(date +%T)"
  PYTHONPATH=src:. timeout -s INT -k 15 180 python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider -p no:benchmark \
    --timeout 170 -rfE tests/ops/gluon/test_backward_gpu.py -k "persistent or dynamic" > "$OUT/dynamic-tests.log" 2>&1
  tail -6 "$OUT/dynamic-tests.log"
  # DIM:TILE:TOKENS:DOCS; per process: tl, the default tiles with atomic and with split dQ (its own
  # kernel: no fp32 dQ to zero and cast, measured only on long documents so far), per-tile, static
  # sections of 4, dynamic sections of 1 and of 4
  for run in 64:128x128s2c2:32768:512-8192 64:128x128s2c2:16384:64-1024 128:64x128s3c2:32768:512-8192 \
             64:128x128s2c2:16384:256-4096 128:64x128s3c2:16384:64-1024; do
    IFS=: read -r dim tile tokens docs <<< "$run"
    left=$((budget - $(date +%s) + started)); limit=80
    [ "$left" -lt "$limit" ] && limit=$left
    [ "$limit" -lt 35 ] && { echo "== no time left for D$dim $tokens $docs"; continue; }
    echo "== backward alone, D$dim $tokens $docs ($limit s) $(date +%T)"
    PYTHONPATH=src:benchmarks:. timeout "$limit" python3 benchmarks/bench_gluon_bwd.py --dims "$dim" \
      --tokens "$tokens" --docs "$docs" --providers tl gluon gluon-split-dq \
      --dkdv-tiles "$tile" "${tile}ph4" "${tile}ph1d" "${tile}ph4d" --rep-ms 40 \
      --out "$OUT/gluon-bwd-dynamic-d$dim-$tokens-$docs.json" 2>&1 | grep -E '^D[0-9]'
  done
  ;;
14)  # after `fa4-wheels.sh stage`, carry .fa4/b: the Gluon backward's softcap, tests then timing
  eval "$(bash .fa4/b/fa4-wheels.sh install)" || exit 1
  echo "== softcap backward tests $(date +%T)"
  PYTHONPATH=src:. timeout -s INT -k 10 110 python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider -p no:benchmark \
    --timeout 100 -rfE tests/ops/gluon/test_backward_gpu.py -k "softcap or supports" 2>&1 | tail -6
  echo "== plain and softcap 50, thd tl / gluon / FA4 $(date +%T)"
  PYTHONPATH=src:.:$PYTHONPATH timeout 100 python3 benchmarks/bench_attention.py --variants --variant-names softcap \
    --out "$OUT/attention-softcap.json" --providers thd-tl thd-gluon fa4 --layouts 32768:512-8192 \
    --budget-s 80 --rep-ms 30 --trials 3 2>&1 | tail -1
  PYTHONPATH=src:. python3 benchmarks/bench_attention.py --table "$OUT/attention-softcap.json" 2>&1 | tail -6
  echo "== the same, one-partition backward tiles (THD_GLUON_BWD_CONSUMERS=1) $(date +%T)"
  THD_GLUON_BWD_CONSUMERS=1 PYTHONPATH=src:.:$PYTHONPATH timeout 60 python3 benchmarks/bench_attention.py --variants \
    --variant-names softcap --out "$OUT/attention-softcap-one-partition.json" --providers thd-gluon \
    --layouts 32768:512-8192 --modes fwd_bwd --budget-s 40 --rep-ms 30 --trials 3 2>&1 | tail -1
  PYTHONPATH=src:. python3 benchmarks/bench_attention.py --table "$OUT/attention-softcap-one-partition.json" 2>&1 | tail -6
  ;;
18)
  PYTHONPATH=src:benchmarks:. timeout 300 python3 benchmarks/device/profile_fwd_bwd_gpu.py \
    --rows 64,16384:64-1024 128,16384:64-1024 64,32768:512-8192 --out "$OUT/profile-fwd-bwd.json" 2>&1 | grep -v USDT
  ;;
20)
  PYTHONPATH=src:benchmarks:. timeout 120 python3 benchmarks/device/profile_fwd_bwd_gpu.py --rows 64,16384:64-1024 \
    --host-events 30 --out "$OUT/profile-host-events.json" 2>&1 | grep -v -e USDT -e Warn -e _warn
  prefer_gluon_suite "${SUITE_S:-230}" tests/ops tests/cp
  ;;
19)
  for round in 1 2; do  # one process per round: bench_gluon_bwd.py times each tile spec once
    for layout in 16384:64-1024 32768:512-8192 16384:256-4096; do
      echo "== D64 $layout, dQ by columns / by rows, persistent and per-tile, round $round $(date +%T)"
      PYTHONPATH=src:benchmarks:. timeout 120 python3 benchmarks/bench_gluon_bwd.py --dims 64 --tokens "${layout%%:*}" \
        --docs "${layout#*:}" --providers gluon --dkdv-tiles 128x128s2c2p 128x128s2c2qp 128x128s2c2 128x128s2c2q \
        --rep-ms 40 --out "$OUT/gluon-bwd-dq-rows-r$round-${layout/:/-}.json" 2>&1 | grep -E '^D[0-9]'
    done
  done
  ;;
17)
  echo "== dQ split by query rows, tests $(date +%T)"
  PYTHONPATH=src:. timeout -s INT -k 10 150 python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider -p no:benchmark \
    --timeout 140 -rfE tests/ops/gluon/test_backward_gpu.py -k "dq_split_by_query_rows" 2>&1 | tail -4
  for layout in 32768:512-8192 16384:256-4096 16384:64-1024; do
    echo "== backward alone, D64 $layout, dQ by columns / by rows $(date +%T)"
    PYTHONPATH=src:benchmarks:. timeout 100 python3 benchmarks/bench_gluon_bwd.py --dims 64 --tokens "${layout%%:*}" \
      --docs "${layout#*:}" --providers tl gluon --dkdv-tiles 128x128s2c2 128x128s2c2q 128x128s2c2p 128x128s2c2qp \
      --rep-ms 40 --out "$OUT/gluon-bwd-dq-rows-${layout/:/-}.json" 2>&1 | grep -E '^D[0-9]'
  done
  ;;
esac
echo "== done $(date +%T)"
