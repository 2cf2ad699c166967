#!/usr/bin/env bash
# A/B of the Gluon forward on the GPU machine: this checkout's src/ (base) against another tree's
# src/ (exp), alternating processes, then the Gluon forward GPU tests on exp. One device call.
#
#   here:   rm -rf .ab && mkdir .ab && git archive <exp-commit> src | tar -x -C .ab   (.ab/ in .git/info/exclude)
#   device: carry [".ab"], command: bash benchmarks/device/ab_gluon_forward.sh .ab/src [rounds]
# Prints each row's median TFLOP/s per tree and exp/base; the JSONs land in $OUT/ab-<tree>-<round>.json.
# AB_TEST_ARGS: pytest arguments narrowing exp's tests (e.g. -k "matches_reference"); AB_ROWS: the rows.
set -o pipefail
export PYTHONUNBUFFERED=1 THD_AUTOTUNE=0
EXP=${1:?usage: ab_gluon_forward.sh EXP_SRC [ROUNDS]}
ROUNDS=${2:-2}
ROWS=${AB_ROWS:-"128,16384:256-4096 128,32768:512-8192 128,16384:64-1024 64,32768:512-8192"}
OUT=${OUT:-/tmp/ab}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== exp: Gluon forward GPU tests"
# a kernel that hangs is cut by `timeout` (the call's own limit would take the whole lease)
PYTHONPATH=$EXP:. timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 120 \
  tests/ops/gluon/test_forward_gpu.py ${AB_TEST_ARGS:-} 2>&1 | tail -3 || { echo "exp: forward tests failed or hung"; exit 1; }
for i in $(seq "$ROUNDS"); do
  for tree in base exp; do
    src=src; [ "$tree" = exp ] && src=$EXP
    PYTHONPATH=$src:. timeout 150 python3 benchmarks/bench_gluon.py --out "$OUT/ab-$tree-$i.json" --commit "$tree" \
      --rep-ms 40 --rows $ROWS > /dev/null 2>&1 || echo "$tree round $i failed"
  done
done
python3 - "$OUT" <<'PY'
import glob, json, statistics, sys
def tflops(tree):
    rows = {}
    for path in glob.glob(f"{sys.argv[1]}/ab-{tree}-*.json"):
        for r in json.load(open(path))["records"]:
            if r["provider"] == "gluon" and r["status"] == "ok":
                s = r["shape"]
                rows.setdefault((s["head_dim"], s["tokens"], s["mix"], s["slot_multiple"]), []).append(r["tflops"])
    return rows
base, exp = tflops("base"), tflops("exp")
for key in sorted(base):
    if key in exp:
        b, e = statistics.median(base[key]), statistics.median(exp[key])
        print(f"D{key[0]} {key[1]} {key[2]} slots{key[3]}: base {b:.1f} exp {e:.1f} TFLOP/s, exp/base {e / b:.3f}")
PY
