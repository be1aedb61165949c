#!/usr/bin/env bash
# Not yet run on a GPU (bench/NOTES.md v37), about 300 s: the deterministic backward at head
# dim 64 with dq added up in fixed point (dq_fixed.patch, branch dq-fixed) on a copy of the
# tree: its tests and the backward's neighbours, the sanitizer on one call of it, then
# p_fixed.py (fixed point against the dq pass it replaces, float32 sums and cuDNN; env DTYPES
# and LENGTHS narrow it, e.g. DTYPES=float16 for the trimmed call).
export PYTHONUNBUFFERED=1
HERE=$PWD/bench/results/h200-2026-12-06-dq-fixed
step() { local name=$1 limit=$2; shift 2; local start=$SECONDS
    timeout $limit "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $((SECONDS-start)) s: $(tail -1 $OUT/$name.txt)" >> $OUT/steps.txt; }
mkdir -p /tmp/fixed && cp -r cuflash kernels bench tools tests docs /tmp/fixed/
(cd /tmp/fixed && patch -p1 < $HERE/dq_fixed.patch) > $OUT/patch_fixed.txt 2>&1
cd /tmp/fixed && export PYTHONPATH=/tmp/fixed
step fixed_pytest 150 python3 -m pytest -q --maxfail=5 tests/test_backward.py tests/test_layout.py \
    -k "fixed_point or dq_added or loading_warpgroup_passes or not_deterministic or falls_back or specializations or pointers"
CASE="import cupy, cuflash; r = cupy.random.default_rng(1)
q, k, v, do = (r.standard_normal((1, 2, 2064, 64), dtype=cupy.float32).astype(cupy.float16) for _ in range(4))
out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
g = cuflash.attention_backward(do, q, k, v, out, lse, causal=True); cupy.cuda.Device().synchronize(); print('san done')"
for tool in memcheck initcheck racecheck; do
    step fixed_$tool 60 compute-sanitizer --tool $tool --print-limit 20 python3 -c "$CASE"
done
step fixed_speed 200 python3 $HERE/p_fixed.py ${DTYPES:-float16,bfloat16} ${LENGTHS:-2048,4096,8192,16384}
cat $OUT/steps.txt; cat $OUT/fixed_speed.txt
