#!/usr/bin/env bash
# On the GPU machine (device tool): where the engine process's time goes under load.  For each QGEMM_PIN_ARENAS
# value (a word "PIN[:GIL_SWITCH_US]"): `qgemm serve` (default settings otherwise), `qgemm loadtest` at 64 and 256 M=1 clients and M=512 alone,
# py-spy sampling the engine and one front during the 64-client run (raw stacks, non-idle).  Carry .whl and
# .whl-diag (py-spy).  Writes into $OUT.   usage: scripts/engine_profile.sh [pin values, default "false true"]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl .whl-diag/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
python3 -m app.cli fetch --demo-only > /dev/null
for spec in ${1:-false true}; do
  pin=${spec%%:*}; gil=${spec#*:}; [ "$gil" = "$spec" ] && gil=""
  QGEMM_PIN_ARENAS=${pin} QGEMM_GIL_SWITCH_US=${gil} python3 -m app.cli serve --port 8100 > "$OUT/serve-$spec.log" 2>&1 &
  server=$!
  for _ in $(seq 600); do curl -sf http://127.0.0.1:8100/healthz | grep -q '"status":"ok"' && break; sleep 0.1; done
  pids=$(curl -s http://127.0.0.1:8100/healthz | python3 -c 'import json, sys
print(" ".join(str(p["pid"]) for p in json.load(sys.stdin)["processes"] if p["role"] in ("engine", "front")))')
  engine=$(echo $pids | cut -d' ' -f1); front=$(echo $pids | cut -d' ' -f2)
  lt() { python3 -m app.cli loadtest --url http://127.0.0.1:8100 "$@" 2>&1 | grep -E '"(clients|m|requests_per_s|p50_ms|p99_ms|errors|gpu_share|server_overhead_p50_ms)"' | tr -d '\n '; echo; }
  lt --m 1 --clients 64 --seconds 3 > /dev/null  # warm: compiles, uploads
  (sleep 2; /tmp/site/bin/py-spy record -p "$engine" -d 6 -r 250 -f raw -o "$OUT/engine-$spec.raw" > /dev/null 2>&1) &
  (sleep 2; /tmp/site/bin/py-spy record -p "$front" -d 6 -r 250 -f raw -o "$OUT/front-$spec.raw" > /dev/null 2>&1) &
  { echo "spec=$spec 64:"; lt --m 1 --clients 64 --seconds 10; wait
    echo "spec=$spec 256:"; lt --m 1 --clients 256 --seconds 5
    echo "spec=$spec 1 client:"; lt --m 1 --clients 1 --seconds 4
    echo "spec=$spec M=512:"; lt --m 512 --clients 1 --seconds 5; } | tee -a "$OUT/load.txt"
  curl -s http://127.0.0.1:8100/metrics | grep -E "^qgemm_batch_requests_(sum|count)" | tee -a "$OUT/load.txt"
  kill -TERM $server; wait $server
done
