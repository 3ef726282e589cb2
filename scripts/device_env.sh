# Sourced on the GPU machine (device tool) by scripts/kernel_check.sh and scripts/float_check.sh: $OUT and its
# check.log, the carried wheels (.whl) installed, the environment, $OUT/device.txt, the demo model, and ggml
# (.parity, a copy of ../shared/ggml-parity) building niced in the background: $build is its pid, /tmp/build.log
# its log.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/check.log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 QGEMM_MODELS_DIR=$PWD/.carry/models
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u +%FT%TZ; } | tee "$OUT/device.txt"
python3 -m app.cli fetch --demo-only > /dev/null
(nice -n 19 bash .parity/build.sh qcheck test-backend-ops > /tmp/build.log 2>&1; echo "build rc $?" >> /tmp/build.log) &
build=$!
