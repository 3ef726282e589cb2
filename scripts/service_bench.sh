#!/usr/bin/env bash
# On the GPU machine (device tool): the service benchmark of docs/reports/service.md.  Carry .whl and .carry
# (as for gpu-check.sh).  Starts `qgemm serve` on the CUDA backend with batching on or off and drives it
# with `qgemm loadtest` (client processes on the same machine), writing $OUT/service-<mode>.json.
#   usage: scripts/service_bench.sh on|off [seconds per run]
set -uo pipefail
mode=${1:-on}; secs=${2:-2}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 QGEMM_MODELS_DIR=$PWD/.carry/models
python3 -m app.cli fetch --demo-only > /dev/null
wait_us=100; [[ $mode == off ]] && wait_us=0
QGEMM_BACKEND=cuda QGEMM_BATCH_WAIT_US=$wait_us python3 -m app.cli serve --port 8100 > "$OUT/serve-$mode.log" 2>&1 &
server=$!
for _ in $(seq 120); do curl -sf http://127.0.0.1:8100/healthz | grep -q '"status":"ok"' && break; sleep 1; done
curl -s http://127.0.0.1:8100/healthz; echo
run() { python3 -m app.cli loadtest --url http://127.0.0.1:8100 --seconds "$secs" --label "batching-$mode" "$@"; }
{
  run --m 1,8,64,512 --clients 1,8,64,256 --format npy --out "$OUT/npy-$mode.json"
  run --m 1,8,64 --clients 1,8,64,256 --format json --out "$OUT/json-$mode.json"
  run --m 512 --clients 1,8 --format json --out "$OUT/json512-$mode.json"  # 20 MB bodies: more clients only queue
} 2>&1 | grep -v '^ *[0-9.]*/' | tee "$OUT/loadtest-$mode.log"
curl -s http://127.0.0.1:8100/metrics | grep -E "^qgemm_(batch_rows|batch_requests)_(sum|count)|^qgemm_gpu" > "$OUT/metrics-$mode.txt"
kill $server; wait $server 2>/dev/null
python3 - "$OUT" "$mode" <<'PY'
import json, sys, pathlib
out, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
rows = [r for f in ("npy", "json", "json512") for r in json.loads((out / f"{f}-{mode}.json").read_text())]
(out / f"service-{mode}.json").write_text(json.dumps(rows, indent=1))
for f in ("npy", "json", "json512"):
    (out / f"{f}-{mode}.json").unlink()
PY
