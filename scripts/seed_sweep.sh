#!/usr/bin/env bash
# The CPU suite's seeded tests over many seeds in one pytest process a shard (issue 18's proof that no test
# fails by chance): every test that draws random inputs runs once per seed, with the seeds of consecutive
# runs from a fresh (or given) base; the others run once.
#   scripts/seed_sweep.sh [SEEDS=1000] [SHARDS=2] [BASE=random]   logs in ./seed-sweep/
set -euo pipefail
case ${1:-} in -h|--help) sed -n 2,5p "$0"; exit 0 ;; esac
cd "$(dirname "$0")/.."
seeds=${1:-1000}; shards=${2:-2}; base=${3:-$(python3 -c 'import secrets; print(secrets.randbits(31))')}
per=$(( (seeds + shards - 1) / shards ))
mkdir -p seed-sweep
echo "seed sweep: $seeds seeds from QGEMM_TEST_SEED=$base in $shards shards of $per"
pids=()
for s in $(seq 0 $((shards - 1))); do
  OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 QGEMM_TEST_SEED=$((base + s * per)) QGEMM_TEST_SEEDS=$per \
    .venv/bin/python -m pytest -q -p no:cacheprovider -m "not gpu" >"seed-sweep/shard-$s.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
tail -n 2 seed-sweep/shard-*.log
exit $rc
