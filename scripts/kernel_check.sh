#!/usr/bin/env bash
# On the GPU machine (device tool), one call after a kernel change: `pytest -m gpu`, the products of the formats
# touched against llama.cpp's own (../shared/ggml-parity/run.sh, then tools.parity), and their times beside ggml's
# MUL_MAT (perf.sh, filtered to the formats and M touched) with `qgemm bench` in the same machine session.
# Carry .whl, .carry and .parity (a copy of ../shared/ggml-parity).  ggml builds niced while the tests run.
#   usage: scripts/kernel_check.sh "q4_0 q8_0" [MS for parity, 1,2,5,8] [perf's M list, 1|8] [bench's kernels]
# STEP=tests (pytest and the build) or STEP=compare (parity, bench, perf) splits it over two calls of a warm machine
# (a call runs 10 minutes at most).  Writes $OUT: gpu-tests.log, parity-4096.json, parity-14336.json, bench.json,
# perf.txt, device.txt, check.log.
set -uo pipefail
types=${1:?usage: kernel_check.sh "TYPES" [MS] [PERF_M] [KERNELS]}; ms=${2:-1,2,5,8}; perf_m=${3:-1|8}
kernels=${4:-gemv}; step=${STEP:-all}
. "$(dirname "$0")/device_env.sh"  # $OUT, check.log, wheels, environment, device.txt, ggml building ($build)
if [ "$step" != compare ]; then
  timeout 480 python3 -m pytest -m gpu -q -p no:cacheprovider --ignore=tests/test_openapi_conformance.py \
    --ignore=tests/test_ray_serve.py tests > "$OUT/gpu-tests.log" 2>&1
  echo "pytest -m gpu at ${SECONDS}s:"; tail -n 1 "$OUT/gpu-tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log"
fi
wait $build; tail -n 1 /tmp/build.log; echo "built at ${SECONDS}s"
[ "$step" = tests ] && exit 0
for k in 4096 14336; do  # N = 512: 32 row blocks, so K is split over blocks at both K
  bash .parity/run.sh "/tmp/g$k" "$types" 512 "$k" "$ms" > /dev/null
  python3 -m tools.parity "/tmp/g$k" --k "$k" --json "$OUT/parity-$k.json" 2>&1 | grep -E "auto|gemv|held" | head -40
done
upper=$(echo "$types" | tr a-z A-Z | tr ' ' ','); alt=$(echo "$types" | tr ' ' '|')
python3 -m app.cli bench --types "$upper" --k 4096,14336 --m "$(echo "$perf_m" | tr '|' ',')" --kernels "$kernels" \
  --reps 10 --out /tmp/bench > /tmp/bench.log 2>&1; echo "bench rc $? at ${SECONDS}s"
cp /tmp/bench/bench.json "$OUT/bench.json"
PERF_ARGS="-p type_a=($alt),.*,n=($perf_m)," bash .parity/perf.sh "$OUT/perf.txt" 300
echo "done at ${SECONDS}s"
