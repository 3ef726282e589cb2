#!/usr/bin/env bash
# On the GPU machine (device tool), one call: the GPU tests of the M <= 8 kernels, then `qgemm bench` of chosen kernels
# for this tree, for variants of it (compile-time constants changed by sed in a copy) and for other trees copied
# beside it (an older commit), all in one machine session, so their times compare.  Carry .whl.
#   usage: scripts/gemv_sweep.sh [NAME=TREE | NAME=FILE:SED[|FILE:SED...]] ...
#   e.g.   scripts/gemv_sweep.sh old=abtree st2='kernels/cuda/fast.cu:s/SKINNY_STAGES 3/SKINNY_STAGES 2/'
# Env: TYPES, KS, MS, KERNELS (bench's lists), TESTS (pytest arguments; empty: none), METRIC (the table's column:
# total_same_us, the default, or total_us with weights from HBM).  Writes $OUT/sweep.json (rows of every run:
# variant, type, K, M, kernel, total_same_us, total_us, gbps), $OUT/sweep.txt (a table) and the logs.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONUNBUFFERED=1 QGEMM_MODELS_DIR=/tmp/models
TYPES=${TYPES:-Q4_0,Q8_0,Q4_1,Q5_0,Q5_1,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,IQ4_NL,IQ4_XS,MXFP4}
KS=${KS:-4096,14336}; MS=${MS:-1,2,4,8}; KERNELS=${KERNELS:-gemv}
[ -n "${TESTS+set}" ] || TESTS='tests/test_gpu.py tests/test_gpu_groups.py -k "skinny or matches_reference or extreme or back_to_back or grouped"'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
date -u +%FT%TZ >> "$OUT/device.txt"
if [ -n "$TESTS" ]; then
  eval "PYTHONPATH=/tmp/site:$PWD timeout 400 python3 -m pytest -m gpu -q -p no:cacheprovider $TESTS" \
    > "$OUT/tests.log" 2>&1
  tail -n 2 "$OUT/tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
fi
bench() {  # name tree
  (cd "$2" && PYTHONPATH=/tmp/site:$PWD python3 -m app.cli bench --types "$TYPES" --k "$KS" --m "$MS" \
     --kernels "$KERNELS" --reps 10 --out "/tmp/bench-$1" > "/tmp/bench-$1.log" 2>&1)
  echo "$1: rc $? at ${SECONDS}s"; tail -n 3 "/tmp/bench-$1.log" >> "$OUT/bench-logs.txt"
}
names=(now); bench now "$PWD"
for spec in "$@"; do
  name=${spec%%=*}; what=${spec#*=}
  if [ -d "$what" ]; then tree=$what; else
    tree=/tmp/tree-$name; rm -rf "$tree"; mkdir -p "$tree"
    git ls-files -z | xargs -0 cp --parents -t "$tree"
    IFS='|' read -ra edits <<< "$what"
    for e in "${edits[@]}"; do sed -i "${e#*:}" "$tree/${e%%:*}"; done
  fi
  names+=("$name"); bench "$name" "$tree"
done
METRIC=${METRIC:-total_same_us} python3 - "$OUT" "${names[@]}" <<'EOF'
import json, os, sys
from collections import defaultdict
out, names, metric = sys.argv[1], sys.argv[2:], os.environ["METRIC"]
rows, table = [], defaultdict(dict)
for name in names:
    try:
        d = json.load(open(f"/tmp/bench-{name}/bench.json"))
    except OSError:
        continue
    for r in d["rows"]:
        rows.append({"variant": name, "type": r["type"], "K": r["K"], "M": r["M"], "kernel": r["kernel"],
                     "total_same_us": r["total_same_us"], "total_us": r["total_us"], "gbps": r["gbps"], "nmse": r["nmse"],
                     "device": d["device"], "date": d["date"]})
        table[(r["type"], r["K"], r["M"], r["kernel"])][name] = r[metric]
json.dump(rows, open(f"{out}/sweep.json", "w"), indent=0)
with open(f"{out}/sweep.txt", "w") as f:
    what = "weights from HBM" if metric == "total_us" else "on the same buffers"
    print("type K M kernel " + " ".join(names) + f"   (µs, quantize + GEMM {what})", file=f)
    for (t, k, m, kern), v in sorted(table.items()):
        print(t, k, m, kern, " ".join(f"{v[n]:.1f}" if n in v else "-" for n in names), file=f)
print(open(f"{out}/sweep.txt").read())
EOF
