#!/usr/bin/env bash
# One GPU iteration of the attention work, in one device call right after `fa4-wheels.sh stage`
# (see ../shared/tools/fa4-wheels.sh): FA4 install, the attention benchmark with thd as users get it (auto) and both families,
# FA4, cuDNN and varlen_attn, host time per eager call against varlen_attn and FA4, the attention/ring/Gluon GPU tests under THD_KERNELS=prefer-gluon, and
# the Gluon kernels' bounds tests under compute-sanitizer memcheck. Each step is cut at a time
# budget (seconds from the start) so the whole fits one 600-second call.
# When the tree plus `.fa4/a` outgrow a call's 64 MiB, benchmarks/device/stage_fa4.sh stages it in two calls.
#   device: carry [".fa4/b"], command: SHA=<commit> [VARIANTS=1] [TESTS="<paths>"] [BENCH_ONLY=1] bash benchmarks/device/iteration.sh
# The benchmark takes two rounds, the providers of a row taking turns: with one, the first-timed
# provider (thd) measured its forward 1.02-1.11x the forced-Gluon provider's, the same kernels
# (attention-350e9a2-h100.json).
# BENCH_ONLY=1 stops after the benchmark and host-time steps: a call of at most ~370 s (420 with
# VARIANTS=1), as long calls were lost when a machine was taken back mid-call.
set -o pipefail
export PYTHONUNBUFFERED=1 THD_AUTOTUNE=0
T0=$(date +%s); left() { echo $(($1 - ($(date +%s) - T0))); }
SHA=${SHA:?set SHA to the commit being measured}
OUT=${OUT:-/tmp/iteration}; mkdir -p "$OUT"
eval "$(bash .fa4/b/fa4-wheels.sh install)" || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
echo "== bench $(date +%T)"
PYTHONPATH=src:.:$PYTHONPATH timeout "$(left 330)" python3 benchmarks/bench_attention.py \
  --out "$OUT/attention-$SHA.json" --commit "$SHA" --providers thd thd-tl thd-gluon fa4 cudnn varlen_attn \
  --budget-s 240 --rep-ms 50 --trials 2 --rounds 2 2>&1 | tail -4
PYTHONPATH=src:. python3 benchmarks/bench_attention.py --table "$OUT/attention-$SHA.json" 2>&1 | head -40
echo "== host time per eager call (bench_host.py: thd, varlen_attn, FA4) $(date +%T)"
PYTHONPATH=src:.:benchmarks:$PYTHONPATH timeout "$(left 370)" python3 benchmarks/bench_host.py \
  --out "$OUT/host-time-$SHA.json" --commit "$SHA" 2>&1 | tail -12
if [ "${VARIANTS:-0}" = 1 ]; then  # window / softcap / sinks, both families against FA4
  echo "== variants $(date +%T)"
  PYTHONPATH=src:.:$PYTHONPATH timeout "$(left 420)" python3 benchmarks/bench_attention.py --variants \
    --out "$OUT/attention-variants-$SHA.json" --commit "$SHA" --providers thd-tl thd-gluon fa4 \
    --layouts 32768:512-8192 --budget-s 80 --rep-ms 40 --trials 3 2>&1 | tail -2
fi
if [ "${BENCH_ONLY:-0}" = 1 ]; then  # the measurements alone: the tests run in calls of their own
  echo "== done $(date +%T)"
  exit 0
fi
echo "== tests, THD_KERNELS=prefer-gluon $(date +%T)"
# TESTS overrides the list (the whole list takes longer than one call: split it over calls)
TESTS=${TESTS:-"tests/ops/gluon tests/ops/test_attention_gpu.py tests/ops/test_attention_fa4_gpu.py
  tests/ops/test_attention_variants_gpu.py tests/ops/test_attention_accumulate.py tests/ops/test_fast_launch.py
  tests/cp/test_plan_cache.py tests/cp/test_ring.py tests/cp/test_ring_variants.py"}
# shellcheck disable=SC2086  # TESTS is a list of paths
# twelve xdist workers, SIGINT at the budget so pytest prints its summary (serial, the list was cut at
# 42% in the sixteenth session; pytest-benchmark off: its xdist warning is an error under our filters)
THD_KERNELS=prefer-gluon PYTHONPATH=src:.:$PYTHONPATH timeout -s INT -k 15 "$(left 520)" python3 -m pytest -q -m gpu \
  -n 12 -p no:cacheprovider -p no:benchmark -k "not autotuned" --timeout 300 -rfE $TESTS 2>&1 | tail -15
echo "== memcheck, Gluon bounds $(date +%T)"
PYTHONPATH=src:. timeout "$(left 590)" compute-sanitizer --tool memcheck --error-exitcode 1 python3 -m pytest -q \
  -m gpu -p no:cacheprovider tests/ops/test_attention_bounds.py -k gluon 2>&1 | tail -4
echo "== done $(date +%T)"
