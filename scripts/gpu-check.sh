#!/usr/bin/env bash
# The GPU check: the reference suites and the cuda tests on a real GPU, then the same suites on
# the simulated device, and the sim/real ratios of their peaks. Takes a few minutes on one GPU.
#
#   bash scripts/gpu-check.sh [OUTPUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-check}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

echo "== device"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
python - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0),
      "total", torch.cuda.get_device_properties(0).total_memory)
PY

echo "== cuda tests (real allocator and NVML)"
python -m pytest tests/test_cuda_real.py -v -p no:cacheprovider 2>&1 | tee "$out/cuda-tests.txt"

echo "== suites on cuda"
python -m pytest suites --vram-backend=cuda --vram-report -p no:cacheprovider \
  --vram-json "$out/cuda.json" --junitxml "$out/cuda.xml" 2>&1 | tee "$out/suites-cuda.txt"

echo "== suites on sim"
python -m pytest suites --vram-backend=sim --vram-report -p no:cacheprovider \
  --vram-json "$out/sim.json" 2>&1 | tee "$out/suites-sim.txt"

echo "== sim / cuda"
python scripts/sim_vs_cuda.py "$out/sim.json" "$out/cuda.json" | tee "$out/ratios.txt"
