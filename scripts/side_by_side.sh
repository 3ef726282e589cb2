#!/usr/bin/env bash
# On the GPU machine (device tool), one call: `qgemm bench` on every format and llama.cpp's own MUL_MAT times
# (../shared/ggml-parity/perf.sh) in the same machine session.  Carry .whl and .parity (a copy of
# ../shared/ggml-parity).  ggml builds (CPU only, niced) while the bench runs: the bench times CUDA-graph replays
# on the GPU, which the build's CPU load does not enter; perf.sh runs alone after both, for what time is left
# (it keeps the cases that finished).  Then here: qgemm side-by-side --bench B/bench.json --llama-cpp B/perf.txt
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; budget=${1:-570}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/device.txt"
python3 -m app.cli fetch --demo-only > /dev/null
(nice -n 19 bash .parity/build.sh test-backend-ops > "$OUT/build.log" 2>&1; echo "build rc $?" >> "$OUT/build.log") &
build=$!
python3 -m app.cli bench --types Q4_0,Q8_0,Q4_1,Q5_0,Q5_1,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,IQ4_NL,IQ4_XS,MXFP4,F16,BF16 \
  --kernels gemv,gemv_rows,vec_dp4a,tiled_dp4a,mmq,mmq_wgmma,mmvf_f16,mmv_bf16,cublas_f16,cublas_bf16 \
  --reps 10 --out "$OUT/bench" > "$OUT/bench.log" 2>&1
echo "bench rc $? at ${SECONDS}s"; rm -f "$OUT/bench/bench.md"
wait $build; tail -2 "$OUT/build.log"; echo "built at ${SECONDS}s"
left=$((budget - SECONDS)); echo "perf for ${left}s"
[ "$left" -gt 30 ] && bash .parity/perf.sh "$OUT/perf.txt" "$left"
grep -c "us/run" "$OUT/perf.txt"
