#!/usr/bin/env bash
# The GPU checks the pending host-path patches need, in one device call (H200; budget ~8 minutes).
#
# CPU side first (repository root):
#   git checkout -b host-path && git apply notes/pending/host-time6.patch && git apply notes/pending/plan-fresh.patch
#   rm -rf .base && mkdir .base && git archive main src | tar -x -C .base   # .base/ in .git/info/exclude
# Device call: carry [".base"], command: bash notes/pending/gpu_checks.sh
#
# Step 1 tells whether the fast-path test's failure in this order (seen on the H200 on 2026-12-06
# with host-time6 applied) is the patch's or the test's; steps 2-3 are the GPU tests the patches
# touch; step 4 the host time of base and patched source, alternating processes.
set -o pipefail
export PYTHONUNBUFFERED=1 THD_AUTOTUNE=0
T0=$(date +%s)
left() { echo $(($1 - ($(date +%s) - T0))); }
FAST=tests/ops/test_fast_launch.py::test_gpu_attention_through_fast_path_matches_normal_path
echo "== 1a. order check, base source"
PYTHONPATH=.base/src:. timeout "$(left 100)" python3 -m pytest -q -p no:cacheprovider \
  tests/ops/gluon/test_family_gpu.py "$FAST" 2>&1 | tail -3
echo "== 1b. order check, patched source"
PYTHONPATH=src:. timeout "$(left 200)" python3 -m pytest -q -p no:cacheprovider \
  tests/ops/gluon/test_family_gpu.py tests/ops/test_host_path.py "$FAST" 2>&1 | grep -E "^E |passed|failed" | head -20
echo "== 2. GPU tests of the host path, patched source"
PYTHONPATH=src:. timeout "$(left 380)" python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/ops/test_fast_launch.py tests/ops/test_attention_accumulate.py tests/ops/test_zero_padding.py \
  tests/cp/test_ring.py tests/cp/test_ring_variants.py 2>&1 | tail -5
echo "== 3. attention GPU tests (CUDA graphs with new cu_seqlens, no host sync, torch.compile)"
PYTHONPATH=src:. timeout "$(left 470)" python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/ops/test_attention_gpu.py -k "graph or sync or compile" 2>&1 | tail -5
echo "== 4. host time per call, base and patched source alternating"
for i in 1 2; do
  for tree in base patched; do
    src=src; [ "$tree" = base ] && src=.base/src
    PYTHONPATH=$src timeout "$(left 560)" python3 benchmarks/bench_host.py --providers thd varlen_attn \
      --calls 300 --rounds 5 --out "$OUT/host-$tree-$i.json" > /dev/null 2>&1
  done
done
python3 - <<'PY'
import glob, json, os
for f in sorted(glob.glob(os.path.join(os.environ["OUT"], "host-*.json"))):
    records = json.load(open(f))["records"]
    print(os.path.basename(f), [(r["provider"], r["mode"], round(r.get("wall_us") or -1, 1)) for r in records])
PY
