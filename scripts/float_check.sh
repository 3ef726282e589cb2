#!/usr/bin/env bash
# On the GPU machine (device tool), one call after a change to the float-matrix path: ggml's own F16 and BF16
# products (../shared/ggml-parity/run.sh) at the shapes where ggml runs mul_mat_vec_f, mul_mat_f and cuBLAS, held
# against qgemm (tools.parity); the small F16 fixture for tests/data/ggml_parity_f16 (N = 95 and 96, K = 512); the
# float tests of `pytest -m gpu`; and the float kernels' times beside ggml's MUL_MAT (perf.sh) in the same session.
# Carry .whl, .carry and .parity.  Writes $OUT: device.txt, check.log, gpu-tests.log, parity-511.json,
# parity-4096.json, fixture.tgz, bench.json, perf.txt.
set -uo pipefail
. "$(dirname "$0")/device_env.sh"  # $OUT, check.log, wheels, environment, device.txt, ggml building ($build)
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_registry.py tests/test_parity.py \
  tests/test_gpu.py -k "cublas or F16 or f16 or BF16 or bf16 or parity or registry" > "$OUT/gpu-tests.log" 2>&1
echo "pytest at ${SECONDS}s:"; tail -n 1 "$OUT/gpu-tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log"
wait $build; tail -n 1 /tmp/build.log; echo "built at ${SECONDS}s"
grep -o "libcublas[^ ]*" /proc/$$/maps 2>/dev/null | head -1
ldd /tmp/ggml-parity-build/qcheck 2>/dev/null | grep -i cublas
python3 -c "from kernels.cuda import cublas; print('cupy loads', cublas._library_path())"
bash .parity/run.sh /tmp/g511 "f16 bf16" 511 4096 1,2,5,8,9,16,17,64,256 > /dev/null
python3 -m tools.parity /tmp/g511 --k 4096 --json "$OUT/parity-511.json" | grep -E "auto|cublas|F16 \| [0-9]+ \| f16_h"
bash .parity/run.sh /tmp/g4096 "f16 bf16" 4096 4096 2,8,16,32 > /dev/null  # the perf shapes: mmf up to 16 rows
python3 -m tools.parity /tmp/g4096 --k 4096 --json "$OUT/parity-4096.json" | grep -E "auto"
for n in 95 96; do bash .parity/run.sh "/tmp/fx/n$n" f16 "$n" 512 2,5,16,17,33 > /dev/null; done
python3 -m tools.parity /tmp/fx/n95 --k 512 | grep -E "auto|cublas"
python3 -m tools.parity /tmp/fx/n96 --k 512 | grep -E "auto|cublas"
tar czf "$OUT/fixture.tgz" -C /tmp/fx .
python3 -m app.cli bench --types F16,BF16 --k 4096 --kernels mmvf_f16,mmv_bf16,cublas_f16,cublas_f16_h,cublas_bf16 \
  --reps 10 --out /tmp/bench > /tmp/bench.log 2>&1; echo "bench rc $? at ${SECONDS}s"; tail -3 /tmp/bench.log
cp /tmp/bench/bench.json "$OUT/bench.json"
PERF_ARGS="-p type_a=(f16|bf16),.*k=4096" bash .parity/perf.sh "$OUT/perf.txt" 200
echo "done at ${SECONDS}s"
