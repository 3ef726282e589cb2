#!/usr/bin/env bash
# A/B of the service in one machine session: each word "TREE:ENV=V,ENV=V" serves from TREE (. or a copy of an
# older commit) with those variables, and runs the same loads.  Carry .whl.  Writes $OUT/ab.txt.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; root=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
PYTHONPATH=/tmp/site:$root python3 -m app.cli fetch --demo-only > /dev/null
for spec in "$@"; do
  tree=${spec%%:*}; envs=${spec#*:}; [ "$envs" = "$spec" ] && envs=""
  ( cd "$root/$tree" && env $(echo "$envs" | tr ',' ' ') PYTHONPATH=/tmp/site:$root/$tree python3 -m app.cli serve --port 8100 > "$OUT/serve.log" 2>&1 ) &
  server=$!
  for _ in $(seq 600); do curl -sf http://127.0.0.1:8100/healthz | grep -q '"status":"ok"' && break; sleep 0.1; done
  lt() { PYTHONPATH=/tmp/site:$root python3 -m app.cli loadtest --url http://127.0.0.1:8100 "$@" 2>&1 | grep -E '"(clients|requests_per_s|p50_ms|p99_ms|errors|gpu_share)"' | tr -d '\n '; echo; }
  lt --m 1 --clients 64 --seconds 2 > /dev/null
  { echo "== $spec"; lt --m 1 --clients 64 --seconds 6; lt --m 1 --clients 256 --seconds 4; lt --m 1 --clients 1 --seconds 3
    lt --m 512 --clients 1 --seconds 3; curl -s http://127.0.0.1:8100/metrics | grep -E "^qgemm_batch_requests_(sum|count)" | tr '\n' ' '; echo; } | tee -a "$OUT/ab.txt"
  pkill -TERM -f "app.cli serve"; wait $server; sleep 1
done
