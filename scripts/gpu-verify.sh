#!/usr/bin/env bash
# On the GPU machine (device tool), one call: the GPU tests, the service as a user starts it under `qgemm loadtest`,
# a short GPU soak and a small bench.  Carry .whl and .carry (docs/install.md).  Writes into $OUT.
#   usage: scripts/gpu-verify.sh [test seconds] [soak seconds]
set -uo pipefail
tests_s=${1:-330}; soak_s=${2:-30}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 QGEMM_MODELS_DIR=$PWD/.carry/models
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -m app.cli fetch --demo-only > /dev/null
timeout "$tests_s" python3 -m pytest -m gpu -q -p no:cacheprovider --ignore=tests/test_openapi_conformance.py \
  --ignore=tests/test_ray_serve.py tests > "$OUT/gpu-tests.log" 2>&1
tail -n 3 "$OUT/gpu-tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log"
# the service with default settings (only the models directory given, as QGEMM_MODELS_DIR above)
python3 -m app.cli serve --port 8100 > "$OUT/serve.log" 2>&1 &
server=$!
t0=$SECONDS; for _ in $(seq 240); do curl -sf http://127.0.0.1:8100/healthz | grep -q '"status":"ok"' && break; sleep 0.25; done
echo "healthy after $((SECONDS - t0)) s"; head -n 8 "$OUT/serve.log"
run() { python3 -m app.cli loadtest --url http://127.0.0.1:8100 "$@" 2>&1 | grep -v '^ *[0-9.]*/' | grep -v '^\[' ; }
{ run --m 1 --clients 1,64,256 --format npy --seconds 5 --out "$OUT/load-npy.json"
  run --m 1 --clients 1 --format json --seconds 5 --out "$OUT/load-json.json"
  run --m 512 --clients 1 --format npy --seconds 5 --out "$OUT/load-512.json"; } | tee "$OUT/loadtest.log"
curl -s http://127.0.0.1:8100/metrics | grep -E "^qgemm_(batch_rows|batch_requests)_(sum|count)|^qgemm_gpu" \
  > "$OUT/metrics.txt"
kill $server; wait $server 2>/dev/null
timeout $((soak_s + 120)) python3 -m app.cli soak --backend cuda --clients 16 --seconds "$soak_s" \
  --out "$OUT/soak.json" 2>&1 | tail -n 6
timeout 200 python3 -m app.cli bench --types Q4_0,Q8_0 --k 14336 --m 1,8,128 --out "$OUT/bench" 2>&1 | grep -v "^|" \
  | tail -n 8
