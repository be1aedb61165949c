#!/usr/bin/env bash
# Not yet run on a GPU (bench/NOTES.md v37, v38), about 500 s: the deterministic backward with
# dq added up in fixed point at head dims 64, 128 and 256 (dq_fixed.patch, branch d256-fixed,
# which also carries deterministic=False at 256) on a copy of the tree:
#  1. its tests and the backward's neighbours;
#  2. memcheck and racecheck on one call at each head dim, fixed point and any order;
#  3. p_fixed.py: fixed point against the dq pass it replaces, float32 sums and cuDNN (env
#     DTYPES, LENGTHS and HEAD_DIMS widen or narrow it);
#  4. if racecheck reported hazards on the shared dq chunks (head dim 128; v35's reading: it
#     does not count a named barrier's arrive as ordering) and the call has the time: the same with both warpgroups waiting at that barrier (both_sync.patch), its
#     racecheck and speed.
export PYTHONUNBUFFERED=1
HERE=$PWD/bench/results/h200-2026-12-06-dq-fixed
step() { local name=$1 limit=$2; shift 2; local start=$SECONDS
    timeout $limit "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $((SECONDS-start)) s: $(tail -1 $OUT/$name.txt)" >> $OUT/steps.txt; }
mkdir -p /tmp/fixed && cp -r cuflash kernels bench tools tests docs /tmp/fixed/
(cd /tmp/fixed && patch -p1 < $HERE/dq_fixed.patch) > $OUT/patch_fixed.txt 2>&1
cd /tmp/fixed && export PYTHONPATH=/tmp/fixed
step fixed_pytest 200 python3 -m pytest -q --maxfail=5 tests/test_backward.py tests/test_layout.py \
    -k "fixed_point or dq_added or loading_warpgroup_passes or not_deterministic or falls_back or specializations or pointers"
CASE="import cupy, cuflash; r = cupy.random.default_rng(1)
for d, n in ((64, 2064), (128, 2064), (256, 2080)):
    q, k, v, do = (r.standard_normal((1, 2, n, d), dtype=cupy.float32).astype(cupy.float16) for _ in range(4))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    for det in (True, False):
        g = cuflash.attention_backward(do, q, k, v, out, lse, causal=True, deterministic=det)
cupy.cuda.Device().synchronize(); print('san done')"
step fixed_memcheck 80 compute-sanitizer --tool memcheck --print-limit 20 python3 -c "$CASE"
step fixed_racecheck 120 compute-sanitizer --tool racecheck --print-limit 20 python3 -c "$CASE"
step fixed_speed 180 python3 $HERE/p_fixed.py ${DTYPES:-float16} ${LENGTHS:-2048,4096,8192,16384} ${HEAD_DIMS:-64,128,256}
if ! grep -q "0 hazards displayed" $OUT/fixed_racecheck.txt && [ $SECONDS -lt 430 ]; then
    rm -rf /tmp/fixed_sync && cp -r /tmp/fixed /tmp/fixed_sync && cd /tmp/fixed_sync && export PYTHONPATH=/tmp/fixed_sync
    patch -p1 < $HERE/../h200-2026-12-05-dq-sync/both_sync.patch > $OUT/patch_sync.txt 2>&1
    step sync_racecheck 90 compute-sanitizer --tool racecheck --print-limit 20 python3 -c "$CASE"
    step sync_speed 60 python3 $HERE/p_fixed.py float16 4096,16384 64,128
fi
cat $OUT/steps.txt; cat $OUT/fixed_speed.txt; cat $OUT/sync_speed.txt 2>/dev/null
