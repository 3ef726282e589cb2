#!/usr/bin/env bash
# On the GPU machine: the same load against two servers started with different settings, in one
# machine session (service figures differ between machines of one kind by up to 2x, so compare here).
#   usage: scripts/service_ab.sh "ENV=A ..." "ENV=B ..." [loadtest args...]
# Two code versions instead: extract the old one (git archive REV | tar -x -C .ab/old, .ab git-ignored
# in .git/info/exclude), carry .ab, and start side A's server from .ab/old (docs/reports/service.md, attempt 7).
set -uo pipefail
a=$1; b=$2; shift 2
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 QGEMM_MODELS_DIR=$PWD/.carry/models
python3 -m app.cli fetch --demo-only > /dev/null
for side in A B; do
  envs=$a; [[ $side == B ]] && envs=$b
  env QGEMM_BACKEND=cuda $envs python3 -m app.cli serve --port 8100 > "$OUT/serve-$side.log" 2>&1 &
  server=$!
  for _ in $(seq 120); do curl -sf http://127.0.0.1:8100/healthz | grep -q '"status":"ok"' && break; sleep 1; done
  echo "== $side: $envs"
  python3 -m app.cli loadtest --url http://127.0.0.1:8100 --label "$side" --out "$OUT/ab-$side.json" "$@" 2>&1 \
    | grep -E "req/s|^M="
  kill $server; wait $server 2>/dev/null
done
exit 0
