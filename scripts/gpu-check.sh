#!/usr/bin/env bash
# On the GPU machine (device tool): install the carried wheels, write the demo model, run the GPU
# tests and the bench.  Carry .whl (../shared/device/wheels.sh) and .carry/models (a GGUF holding
# SmolLM2's token_embd.weight: `qgemm cut SmolLM2-135M-Instruct.Q4_1.gguf
# .carry/models/SmolLM2-135M-Instruct.token_embd.gguf --tensor token_embd.weight`).
#   usage: scripts/gpu-check.sh [tests|bench|profile|all] [bench args...]
#          scripts/gpu-check.sh repeat N SECONDS   (N full GPU test runs, each on fresh seeds, within SECONDS)
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 QGEMM_MODELS_DIR=$PWD/.carry/models
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
python3 -m app.cli fetch --demo-only
rc=0
if [[ $what == repeat ]]; then
  n=${1:-20}; budget=${2:-540}; start=$SECONDS; runs=0; failed=0
  while (( runs < n && SECONDS - start < budget - 45 )); do
    runs=$((runs + 1))
    timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py > /tmp/run.log 2>&1 || failed=$((failed + 1))
    { echo "run $runs: $(grep -E 'QGEMM_TEST_SEED' /tmp/run.log) | $(tail -n 1 /tmp/run.log)"
      grep -E '^(FAILED|ERROR)' /tmp/run.log; } | tee -a "$OUT/gpu-repeat.log"
  done
  echo "$runs full GPU runs, $failed with a failure" | tee -a "$OUT/gpu-repeat.log"
  exit $(( failed > 0 ))
fi
if [[ $what == tests || $what == all ]]; then
  timeout 420 python3 -m pytest -m gpu -q -p no:cacheprovider -x tests/test_gpu.py 2>&1 | tee "$OUT/gpu-tests.log"
  rc=${PIPESTATUS[0]}
fi
if [[ $what == profile || $what == all ]]; then
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  timeout 300 "$ncu" --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section MemoryWorkloadAnalysis -k regex:'mmq|gemv|quantize' python3 scripts/profile_kernels.py \
    > "$OUT/ncu.txt" 2>&1
  grep -E "^  [a-z_0-9]+ \(|Duration|Compute \(SM\) Throughput|DRAM Throughput|Registers Per|Achieved Occ" "$OUT/ncu.txt"
fi
if [[ $what == bench || $what == all ]]; then
  timeout 540 python3 -m app.cli bench --out "$OUT/bench" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^|" | tail -400
fi
exit $rc
