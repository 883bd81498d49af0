#!/usr/bin/env bash
# Every GPU check, for a session that is lent a GPU (the device tool runs commands in the
# repository root, at most 10 minutes each, so the checks come in parts):
#   bash tools/gpu_check.sh quick   # all of it in about 8 minutes: the one command for a short
#                                   # lease (the CUDA tier, the bf16 fair race, FP8 vs bf16)
#   bash tools/gpu_check.sh quick --dry-run   # the same script on a CPU, tiny shapes (< 90 s)
#   bash tools/gpu_check.sh tests   # the CUDA tier: python -m pytest -q -m cuda (a few minutes)
#   bash tools/gpu_check.sh race    # bench_gpu.py: the fair race and memory, GPT-2 and ResNet-50
#   bash tools/gpu_check.sh fp8     # bench_fp8.py: FP8 GEMMs, the >= 350M GPT step, loss curves
#   bash tools/gpu_check.sh all     # tests, race and fp8 in one command (no time limit)
# Results land in $OUT (the folder the device tool brings back), else ./gpu_out: a JSON file and
# a Markdown table per part, and for quick a summary.md of all of them. The GPU image has torch
# but not mixprec: the package is used from this tree. It has no torchao either and cannot
# download: wheels in ./wheels (ignored by git; carried with the device tool's carry=["wheels"],
# e.g. `pip download torchao==0.18.0 --no-deps -d wheels`, 3.4 MB, built for torch >= 2.11) are
# installed first, and the race then adds torchao's AdamW8bit as a row.
set -uo pipefail
what=${1:-all}
dry=0
[ "${2:-}" = --dry-run ] && dry=1
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
if [ "$dry" = 0 ] && compgen -G "wheels/*.whl" > /dev/null; then
  "$py" -m pip install --quiet --no-deps --no-index wheels/*.whl || echo "(wheels: not installed)"
fi

machine() {
  if [ "$dry" = 1 ]; then
    "$py" -c 'import torch; print(torch.__version__, "CPU dry run")'
  else
    "$py" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())'
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  fi
}

# quick: each part has a time budget inside the script (it stops early and still writes its
# tables) and a hard limit outside it (timeout), so the whole stays near 8 minutes. Measured on
# an H200 with cold compile caches: the CUDA tier about 150 s, the race 146 s (7 modes; now 8,
# with "lean" eager and compiled in place of the graph pass, 9 where torchao is installed, so
# its budget is 230 s), FP8 about 135 s.
# It leaves 7 files in $out (the device tool brings back at most 8).
quick() {
  local dev=cuda race_args=() fp8_args=()
  if [ "$dry" = 1 ]; then
    dev=cpu
    race_args=(--smoke --rounds 1 --steps 1 --modes "torch.autocast bf16" "mixprec O2 bf16"
      "mixprec lean bf16" "torch.autocast bf16 + compile" "mixprec lean bf16 + compile")
    fp8_args=(--smoke --rounds 1)
  fi
  local t0=$SECONDS
  timeout 170 "$py" -m pytest -q -m cuda -p no:cacheprovider tests/cuda 2>&1 |
    tee "$out/cuda_tests.txt"
  echo "(cuda tests: $((SECONDS - t0)) s)"
  t0=$SECONDS
  timeout 270 "$py" benchmarks/bench_gpu.py --device "$dev" --quick --budget-s 230 \
    --json "$out/race.json" --markdown "$out/race.md" "${race_args[@]}" 2>&1
  echo "(race: $((SECONDS - t0)) s)"
  t0=$SECONDS
  timeout 180 "$py" benchmarks/bench_fp8.py --device "$dev" --quick --budget-s 120 \
    --json "$out/fp8.json" --markdown "$out/fp8.md" "${fp8_args[@]}" 2>&1
  echo "(fp8: $((SECONDS - t0)) s)"
  {
    echo "# tools/gpu_check.sh quick: $(head -n 1 "$out/machine.txt")"
    echo
    echo "CUDA tier: $(grep -E '(passed|failed|skipped|error)' "$out/cuda_tests.txt" | tail -n 1)"
    for part in race fp8; do
      echo
      if [ -s "$out/$part.md" ]; then cat "$out/$part.md"; else echo "$part: no table written"; fi
    done
  } >"$out/summary.md"
  cat "$out/summary.md"
}

machine | tee "$out/machine.txt"
if [ "$what" = quick ]; then
  quick
  exit 0
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  "$py" -m pytest -q -m cuda -p no:cacheprovider 2>&1 | tee "$out/cuda_tests.txt"
fi
if [ "$what" = race ] || [ "$what" = all ]; then
  "$py" benchmarks/bench_gpu.py --device cuda --json "$out/bench_gpu.json" \
    --markdown "$out/bench_gpu.md" 2>&1 | tee "$out/bench_gpu.txt"
fi
if [ "$what" = fp8 ] || [ "$what" = all ]; then
  "$py" benchmarks/bench_fp8.py --device cuda --json "$out/bench_fp8.json" \
    --markdown "$out/bench_fp8.md" 2>&1 | tee "$out/bench_fp8.txt"
fi
