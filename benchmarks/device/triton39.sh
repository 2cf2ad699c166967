#!/usr/bin/env bash
# Triton 3.9 on the GPU machine (which has 3.6 under torch 2.11), as a tree the A/B scripts time
# against this checkout: .ab/triton39/src holds Triton 3.9 beside a link to this checkout's
# src/thd, so `PYTHONPATH=.ab/triton39/src` runs the same kernels through the newer compiler.
# Why: compiled on the CPU, Triton 3.9's dK/dV kernel spills 120 bytes at head dim 128 against
# 356 with 3.6, and its worker consumer partition loses the extra R2UR / S2R / local loads that
# make it the backward's critical path under 3.6 (docs/gluon.md, "Balance the two consumer
# partitions").
# The cp312 wheel is 286 MB; `prepare` keeps what compiling and launching need (no AMD backend,
# CUPTI, proton, Blackwell ptxas) in one tar.xz of about 105 MB, split in two parts that travel in
# two device calls back to back (the machine keeps /root about 30 s after a call).
#   here (once; add /.t39/ to .git/info/exclude):  bash benchmarks/device/triton39.sh prepare
#   device call 1, carry [".t39/a"]:  bash .t39/a/triton39.sh stage
#   device call 2, carry [".t39/b"]:
#     eval "$(bash .t39/b/triton39.sh install)" && bash benchmarks/device/ab_gluon_bwd_alone.sh .ab/triton39/src 2
# A later call on the same warm machine: eval "$(bash benchmarks/device/triton39.sh env)" && bash
#   benchmarks/device/ab_gluon_forward.sh .ab/triton39/src 2
# `install` (and `env`) print the exports the 3.9 tree needs: only in-tree backends (the 3.6 install's entry
# points name an AMD backend this tree lacks), ptxas 12.9 from the wheel for sm_90 (3.9 would take
# its CUDA 13.4 "ptxas-blackwell", dropped here; 3.6 reads neither setting for sm_90) and FP fusion
# on, as in 3.6. Checked on the CPU: with them the trimmed tree compiles the Gluon kernels for sm_90
# (tests/ops/gluon/_compile_sm90.py --ptxas: dK/dV spills 120 / 676 bytes at head dims 128 / 64).
set -euo pipefail
VERSION=3.9.0
tree_exports() {  # what the 3.9 tree needs, as shell for the caller to evaluate (see above)
  echo "export TRITON_BACKENDS_IN_TREE=1 TRITON_DEFAULT_FP_FUSION=1"
  echo "export TRITON_PTXAS_BLACKWELL_PATH=$(pwd)/.ab/triton39/src/triton/backends/nvidia/bin/ptxas"
}
case "${1:-}" in
prepare)
  d=.t39; rm -rf "$d"; mkdir -p "$d/a" "$d/b" "$d/tmp/x"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d "$d/tmp" "triton==$VERSION" 2>&1 \
    | grep -v '^WARNING' || true
  (cd "$d/tmp/x" && unzip -q ../triton-"$VERSION"-*.whl)
  rm -rf "$d"/tmp/x/triton/backends/amd "$d"/tmp/x/triton/backends/nvidia/lib/cupti \
    "$d"/tmp/x/triton/backends/nvidia/lib/cupti-blackwell "$d"/tmp/x/triton/backends/nvidia/bin/ptxas-blackwell \
    "$d"/tmp/x/triton/_C/libproton.so "$d"/tmp/x/triton/instrumentation
  tar -C "$d/tmp/x" -cf - triton | xz -T2 -6 > "$d/tmp/triton.tar.xz"
  split -b 52m "$d/tmp/triton.tar.xz" "$d/tmp/part."
  [ ! -e "$d/tmp/part.ac" ] || { echo "ERROR: triton.tar.xz needs more than two parts" >&2; exit 1; }
  mv "$d/tmp/part.aa" "$d/a/"; mv "$d/tmp/part.ab" "$d/b/"
  sha256sum "$d/tmp/triton.tar.xz" | cut -d' ' -f1 > "$d/b/SHA256"
  rm -rf "$d/tmp"
  cp "$0" "$d/a/triton39.sh"; cp "$0" "$d/b/triton39.sh"
  du -sh "$d/a" "$d/b" >&2
  ;;
stage)
  mkdir -p /root/t39parts && cp .t39/a/part.aa /root/t39parts/ && echo "staged part 1" >&2
  ;;
install)
  [ -f /root/t39parts/part.aa ] || { echo "ERROR: part 1 missing (the machine was not warm): stage again" >&2; exit 1; }
  # everything below reports on stderr: stdout is the exports the caller evaluates
  cat /root/t39parts/part.aa .t39/b/part.ab > /root/triton.tar.xz
  [ "$(sha256sum /root/triton.tar.xz | cut -d' ' -f1)" = "$(cat .t39/b/SHA256)" ] \
    || { echo "ERROR: the joined parts do not match SHA256" >&2; exit 1; }
  rm -rf .ab/triton39 && mkdir -p .ab/triton39/src
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" /root/triton.tar.xz .ab/triton39/src
  ln -s "$(pwd)/src/thd" .ab/triton39/src/thd
  if ! TRITON_BACKENDS_IN_TREE=1 PYTHONPATH=.ab/triton39/src python3 -c \
      "import triton, thd; print('triton', triton.__version__, 'thd from', thd.__file__)" >&2; then
    echo "false  # the tree did not import (see above)"; exit 1
  fi
  tree_exports
  ;;
env)  # a later call on the same warm machine: the tree is still there, print its exports again
  [ -d .ab/triton39/src/triton ] || { echo "false  # no .ab/triton39 here (the machine was given back)"; exit 1; }
  tree_exports
  ;;
*)
  echo "usage: triton39.sh prepare|stage|install|env" >&2; exit 2 ;;
esac
