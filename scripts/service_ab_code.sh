#!/usr/bin/env bash
# On the GPU machine: two code versions under the same load, alternating, in one machine session
# (docs/reports/hardening.md).  Here first: `mkdir -p .ab/old && git archive REV | tar -x -C .ab/old` (.ab is
# git-ignored through .git/info/exclude); carry .whl, .carry and .ab/old.
#   usage: [W=workers] scripts/service_ab_code.sh [old dir, default .ab/old]
# Writes $OUT/abb-<i>-<old|new>.json: `.npy` M = 1 on blk.0.attn_q.weight, 1 and 64 clients, 5 s each.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 QGEMM_MODELS_DIR=$PWD/.carry/models
root=$PWD; old=$root/${1:-.ab/old}; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PYTHONPATH=/tmp/site:$root python3 -m app.cli fetch --demo-only > /dev/null
i=0
for side in old new old new old new new old; do
  i=$((i+1)); d=$root; [[ $side == old ]] && d=$old
  (cd "$d" && PYTHONPATH=/tmp/site:$d QGEMM_BACKEND=cuda QGEMM_WORKERS=${W:-1} \
     python3 -m app.cli serve --port 8100 > "/tmp/serve-$i.log" 2>&1) &
  for _ in $(seq 120); do curl -sf http://127.0.0.1:8100/healthz | grep -q '"status":"ok"' && break; sleep 1; done
  r=$(PYTHONPATH=/tmp/site:$root python3 -m app.cli loadtest --url http://127.0.0.1:8100 --tensor blk.0.attn_q.weight \
      --m 1 --clients 1,64 --format npy --seconds 5 --label "$side" --out "$OUT/abb-$i-$side.json" 2>&1 | grep -E "req/s" \
      | tr '\n' '|')
  echo "$i $side W=${W:-1} $r"
  pkill -f "app.cli serve"; sleep 2
done
