#!/usr/bin/env bash
# On the GPU machine (device tool), one call: `qgemm serve` as a user starts it (fronts and an engine process, the
# CUDA backend, default settings) under `qgemm loadtest`, then the process-fault tests on the GPU.  Carry .whl and
# .carry (docs/install.md).  Writes into $OUT.   usage: scripts/service_check.sh [seconds per run]
set -uo pipefail
secs=${1:-5}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 QGEMM_MODELS_DIR=$PWD/.carry/models
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
nproc
python3 -m app.cli fetch --demo-only > /dev/null
python3 -m app.cli serve --port 8100 > "$OUT/serve.log" 2>&1 &
server=$!
t0=$SECONDS; for _ in $(seq 400); do curl -sf http://127.0.0.1:8100/healthz | grep -q '"status":"ok"' && break; sleep 0.1; done
echo "healthy after $((SECONDS - t0)) s"; grep "qgemm:" "$OUT/serve.log" | head -n 12
python3 scripts/one_client_timing.py http://127.0.0.1:8100 | tee "$OUT/one-client-timing.txt"
run() { python3 -m app.cli loadtest --url http://127.0.0.1:8100 --seconds "$secs" "$@" 2>&1 \
  | grep -v '^ *[0-9.]*/' | grep -v '^\[' | grep -v '^ *{' ; }
{ run --m 1 --clients 1,64,256,1024 --format npy --out "$OUT/load-npy.json"
  run --m 1 --clients 1 --format json --out "$OUT/load-json.json"
  run --m 512 --clients 1 --format npy --out "$OUT/load-512.json"; } | tee "$OUT/loadtest.log"
curl -s http://127.0.0.1:8100/metrics | grep -E "^qgemm_(batch_requests|batch_rows)_(sum|count)|^qgemm_gpu|^qgemm_device_resident" \
  | tee "$OUT/metrics.txt"
curl -s http://127.0.0.1:8100/healthz > "$OUT/healthz.json"
kill -TERM $server; wait $server; echo "serve exited with $?"
ls /dev/shm | grep -c qgemm
# the process-fault tests (tests/test_processes.py) against the CUDA backend
QGEMM_TEST_PROCESS_BACKEND=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_processes.py \
  > "$OUT/processes.log" 2>&1
echo "process-fault tests on cuda:"; tail -n 1 "$OUT/processes.log"; grep -E "^(FAILED|ERROR)" "$OUT/processes.log"
