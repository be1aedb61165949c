#!/usr/bin/env bash
# Not yet run on a GPU (bench/NOTES.md v38). The probes of v37 and v38 cut to one call (about
# 560 s) so that the session that runs it still has the time for the run of record: one tree
# with fwd_turns.patch and dq_fixed.patch (branches fwd-turns and d256-fixed) applied, then
#  1. their tests (the forward's schedules, fixed-point and float32 dq at D 64/128/256), in
#     four processes;
#  2. p_fixed.py: the backward, fp16, D 64/128/256, N 2048-16K: fixed point (the candidate
#     default), the dq pass (today's default), float32 sums, cuDNN;
#  3. p_turns.py: the forward at D 128, fp16: each schedule against the default and cuDNN;
#  4. racecheck on one fixed-point call at D 64 and 128 (the shared dq chunks).
# The fuller probes (dq_fixed.sh, turns.sh: sanitizer at every head dim, bf16, D 64 and 256
# forwards, the tile boundary) stay for a session with the time.
export PYTHONUNBUFFERED=1
R=$PWD/bench/results
step() { local name=$1 limit=$2; shift 2; local start=$SECONDS
    timeout $limit "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $((SECONDS-start)) s: $(tail -1 $OUT/$name.txt)" >> $OUT/steps.txt; }
mkdir -p /tmp/next && cp -r cuflash kernels bench tools tests docs /tmp/next/
(cd /tmp/next && patch -p1 < $R/h200-2026-12-06-fwd-turns/fwd_turns.patch \
              && patch -p1 < $R/h200-2026-12-06-dq-fixed/dq_fixed.patch) > $OUT/patch.txt 2>&1
cd /tmp/next && export PYTHONPATH=/tmp/next
step pytest 230 python3 -m pytest -q -n 4 --maxfail=10 tests/test_backward.py tests/test_layout.py \
    tests/test_tensor_map.py -k "fixed_point or dq_added or not_deterministic or falls_back or specializations \
    or loading_warpgroup_variants or tiles_in_turn or defaults_at_head_dim_128"
step fixed_speed 170 python3 $R/h200-2026-12-06-dq-fixed/p_fixed.py float16 2048,4096,8192,16384 64,128,256
step turns_speed 100 python3 $R/h200-2026-12-06-fwd-turns/p_turns.py float16 128 2048,8192,16384
CASE="import cupy, cuflash; r = cupy.random.default_rng(1)
for d in (64, 128):
    q, k, v, do = (r.standard_normal((1, 2, 2064, d), dtype=cupy.float32).astype(cupy.float16) for _ in range(4))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    g = cuflash.attention_backward(do, q, k, v, out, lse, causal=True)
cupy.cuda.Device().synchronize(); print('san done')"
step racecheck 50 compute-sanitizer --tool racecheck --print-limit 10 python3 -c "$CASE"
cat $OUT/steps.txt; tail -3 $OUT/pytest.txt; cat $OUT/fixed_speed.txt $OUT/turns_speed.txt; tail -4 $OUT/racecheck.txt
