#!/usr/bin/env bash
# Stages `.fa4/a` (../shared/tools/fa4-wheels.sh prepare) on the device machine in two calls, for when
# the working tree plus `.fa4/a` outgrow a call's 64 MiB (the tree was 7.6 MB and `.fa4/a` 58 MB on
# 2026-12-07: `fa4-wheels.sh stage` with carry [".fa4/a"] was refused). Back to back, the machine warm:
#   device: carry [".fa4/a/part.aa"], command: bash benchmarks/device/stage_fa4.sh part
#   device: carry [".fa4/a/<the cudnn-frontend wheel>"], command: bash benchmarks/device/stage_fa4.sh wheels
# then, as after `fa4-wheels.sh stage`, carry [".fa4/b"]: iteration.sh (or `fa4-wheels.sh install`).
set -euo pipefail
case "${1:-}" in
part) files=(.fa4/a/part.aa) ;;
wheels) files=(.fa4/a/*.whl) ;;
*) echo "ERROR: stage_fa4.sh: step '${1:-}': expected part or wheels" >&2; exit 1 ;;
esac
mkdir -p /root/fa4parts
cp "${files[@]}" /root/fa4parts/
ls -la /root/fa4parts >&2
