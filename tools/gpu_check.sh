#!/usr/bin/env bash
# Every GPU check, for a session that is lent a GPU (the device tool runs commands in the
# repository root, at most 10 minutes each, so the checks come in parts):
#   bash tools/gpu_check.sh tests   # the CUDA tier: python -m pytest -q -m cuda (a few minutes)
#   bash tools/gpu_check.sh race    # bench_gpu.py: the fair race and memory, GPT-2 and ResNet-50
#   bash tools/gpu_check.sh fp8     # bench_fp8.py: FP8 GEMMs, the >= 350M GPT step, loss curves
#   bash tools/gpu_check.sh all     # all three in one command (where no time limit applies)
# Results land in $OUT (the folder the device tool brings back), else ./gpu_out. The GPU image
# has torch but not mixprec: the package is used from this tree.
set -uo pipefail
what=${1:-all}
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{ python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())'
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee "$out/machine.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -q -m cuda -p no:cacheprovider 2>&1 | tee "$out/cuda_tests.txt"
fi
if [ "$what" = race ] || [ "$what" = all ]; then
  python3 benchmarks/bench_gpu.py --device cuda --json "$out/bench_gpu.json" 2>&1 |
    tee "$out/bench_gpu.txt"
fi
if { [ "$what" = fp8 ] || [ "$what" = all ]; } && [ -f benchmarks/bench_fp8.py ]; then
  python3 benchmarks/bench_fp8.py --device cuda --json "$out/bench_fp8.json" 2>&1 |
    tee "$out/bench_fp8.txt"
fi
