#!/usr/bin/env bash
# Issue 25 on one GPU: the document-aware CP GPU tests, then bench_cp_documents.py's balance
# (long-tail and 64-1024 mixes at cp 2/4/8, both plans), overlap (long-tail, cp 2/4/8) and the
# uniform ring's balance at cp 8 on 1024-8192, in that order. Run from the repository root:
#
#   OUT=/path/to/out COMMIT=<sha> bash benchmarks/run_cp_documents_gpu.sh
#
# Wall time at most BUDGET_S seconds (default 230) plus one kill grace of 5 s: every step runs
# under `timeout` with the smaller of its cap and what is left, and the benchmarks write their
# JSON after every case, so a step cut short keeps what it measured. cp25-steps.txt in $OUT
# gives each step's exit status and wall time. EXTRA (default empty) is appended to every
# benchmark command (the CPU check of this script: EXTRA="--quick --device cpu --tokens 1024").
set -u
OUT=${OUT:?set OUT to the output directory}
COMMIT=${COMMIT:-unknown}
BUDGET_S=${BUDGET_S:-230}
PY=${PY:-python3}
read -r -a extra <<< "${EXTRA:-}"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" THD_AUTOTUNE=0
tag=${COMMIT:0:7}
start=$SECONDS
mkdir -p "$OUT"
steps="$OUT/cp25-steps.txt"

step() {  # step NAME CAP_S COMMAND...: COMMAND under `timeout`, its output in $OUT/cp25-NAME.log
    local name=$1 cap=$2
    shift 2
    local left=$((BUDGET_S - (SECONDS - start)))
    ((left < cap)) && cap=$left
    if ((cap < 10)); then
        echo "$name: skipped, ${left} s left of ${BUDGET_S}" | tee -a "$steps"
        return
    fi
    local t0=$SECONDS rc=0
    timeout -k 5 "$cap" "$@" > "$OUT/cp25-$name.log" 2>&1 || rc=$?
    echo "$name: rc=$rc wall=$((SECONDS - t0)) s limit=$cap s" | tee -a "$steps"
    tail -n 6 "$OUT/cp25-$name.log"
}

bench=("$PY" benchmarks/bench_cp_documents.py --commit "$COMMIT" --rep-ms 24 --trials 3 --warmup 2)
step pytest 85 "$PY" -m pytest -v -rfE -p no:cacheprovider -m gpu --durations=8 \
    --junitxml="$OUT/cp25-pytest.xml" tests/cp/test_documents.py tests/cp/test_document_partition.py
step balance 90 "${bench[@]}" --out "$OUT/cp-documents-balance-mixes-$tag.json" --parts balance \
    --mixes long-tail 64-1024 --cp 2 4 8 ${extra[@]+"${extra[@]}"}
step overlap 35 "${bench[@]}" --out "$OUT/cp-documents-overlap-$tag.json" --parts overlap \
    --mixes long-tail --cp 2 4 8 ${extra[@]+"${extra[@]}"}
step uniform8 20 "${bench[@]}" --out "$OUT/cp-documents-balance-uniform8-$tag.json" --parts balance \
    --mixes 1024-8192 --cp 8 --plans uniform ${extra[@]+"${extra[@]}"}
echo "total wall $((SECONDS - start)) s" | tee -a "$steps"
