#!/usr/bin/env bash
# Nsight Compute of the Gluon dK/dV kernel on the default backward path (dQ added from the dK/dV
# kernel: profile_attention.py --no-deterministic), per head dim: the sections' text and the stall
# samples per SASS line as CSV (SourceCounters), for finding where the backward's warps wait.
#   device: NCU_DIMS="128 64" bash benchmarks/device/ncu_backward.sh   (about 60-90 s per head dim)
# Keeps the text, the CSV and its stall summary per head dim; KEEP_REP=1 keeps the report and the
# run's log too.
# First run in the tenth session of 2026-12-06 (ncu-gluon-bwd-6dc7216-*); summarize a CSV with
# benchmarks/ncu_stalls.py (the device writes its JSON beside the CSV as well).
# NCU_KERNEL=fwd profiles the Gluon forward kernel of the same run instead (files ncu-fwd-*).
set -o pipefail
export PYTHONUNBUFFERED=1 THD_AUTOTUNE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
case "${NCU_KERNEL:-bwd}" in
  bwd) tag=bwd regex=regex:_dkdv ;;
  fwd) tag=fwd regex=regex:attention_fwd_kernel ;;
  *) echo "ERROR: NCU_KERNEL=${NCU_KERNEL}: expected bwd or fwd" >&2; exit 1 ;;
esac
for d in ${NCU_DIMS:-128 64}; do
  echo "== ncu $tag d$d $(date +%T)"
  base="$OUT/ncu-$tag-d$d"
  PYTHONPATH=src:. timeout 150 ncu --clock-control none --profile-from-start off -k "$regex" -c 1 \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters --section ComputeWorkloadAnalysis \
    --section LaunchStats --section Occupancy --section InstructionStats --export "$base" \
    python3 benchmarks/profile_attention.py --family gluon --head-dim "$d" --no-deterministic > "$base.log" 2>&1
  tail -2 "$base.log"
  timeout 40 ncu --import "$base.ncu-rep" > "$base.txt" 2>&1
  timeout 60 ncu --import "$base.ncu-rep" --page source --print-source sass --csv > "$base-sass.csv" 2>&1
  wc -l "$base.txt" "$base-sass.csv"
  python3 benchmarks/ncu_stalls.py --json "$base-sass.csv" > "$base-stalls.json" || true
  [ "${KEEP_REP:-0}" = 1 ] || rm -f "$base.ncu-rep" "$base.log"  # the device returns few files
done
echo "== done $(date +%T)"
