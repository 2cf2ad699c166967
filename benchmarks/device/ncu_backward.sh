#!/usr/bin/env bash
# Nsight Compute of the Gluon dK/dV kernel on the default backward path (dQ added from the dK/dV
# kernel: profile_attention.py --no-deterministic), per head dim: the sections' text and the stall
# samples per SASS line as CSV (SourceCounters), for finding where the backward's warps wait.
#   device: NCU_DIMS="128 64" bash benchmarks/device/ncu_backward.sh   (about 60-90 s per head dim)
# Keeps the text and the CSV per head dim; KEEP_REP=1 keeps the report and the run's log too.
# First run in the tenth session of 2026-12-06 (ncu-gluon-bwd-6dc7216-*); summarize a CSV with
# benchmarks/ncu_stalls.py.
set -o pipefail
export PYTHONUNBUFFERED=1 THD_AUTOTUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for d in ${NCU_DIMS:-128 64}; do
  echo "== ncu dkdv d$d $(date +%T)"
  PYTHONPATH=src:. timeout 150 ncu --clock-control none --profile-from-start off -k regex:_dkdv -c 1 \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters --section ComputeWorkloadAnalysis \
    --section LaunchStats --section Occupancy --section InstructionStats --export "$OUT/ncu-bwd-d$d" \
    python3 benchmarks/profile_attention.py --family gluon --head-dim "$d" --no-deterministic > "$OUT/ncu-run-d$d.log" 2>&1
  tail -2 "$OUT/ncu-run-d$d.log"
  timeout 40 ncu --import "$OUT/ncu-bwd-d$d.ncu-rep" > "$OUT/ncu-bwd-d$d.txt" 2>&1
  timeout 60 ncu --import "$OUT/ncu-bwd-d$d.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu-bwd-d$d-sass.csv" 2>&1
  wc -l "$OUT/ncu-bwd-d$d.txt" "$OUT/ncu-bwd-d$d-sass.csv"
  [ "${KEEP_REP:-0}" = 1 ] || rm -f "$OUT/ncu-bwd-d$d.ncu-rep" "$OUT/ncu-run-d$d.log"  # the device returns few files
done
echo "== done $(date +%T)"
