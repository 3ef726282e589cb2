#!/usr/bin/env bash
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 QGEMM_MODELS_DIR=$PWD/.carry/models
python3 -m app.cli fetch --demo-only > /dev/null
for pin in 1 0; do
  QGEMM_PIN_ARENAS=$pin python3 -m app.cli serve --port 8100 > "$OUT/serve-$pin.log" 2>&1 &
  server=$!
  for _ in $(seq 600); do curl -sf http://127.0.0.1:8100/healthz | grep -q '"status":"ok"' && break; sleep 0.1; done
  sleep 3
  echo "== pin=$pin"; grep "arena" "$OUT/serve-$pin.log" | head -3
  python3 scripts/diag_client.py http://127.0.0.1:8100 | grep -E "engine|request|wall"
  timeout 40 python3 -m app.cli loadtest --url http://127.0.0.1:8100 --m 1 --clients 64,256 --seconds 4 2>&1 | grep "req/s"
  kill -TERM $server; wait $server
done
