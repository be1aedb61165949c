#!/usr/bin/env bash
# Probe 10, not yet run on a GPU (bench/NOTES.md v33 Next 1): dq added up inside the head-dim-64
# dK/dV pass (v29's deterministic=False path), each computing warp staging its 16 rows of a
# step's dq partial in the accumulator's order (float4 per lane: no bank conflicts), two buffers
# a warp, one cp.reduce.async.bulk add.f32 of 4 KB per warp and step, no warpgroup barrier for
# it; the sums put back in row order by scale_sums<T, true>. v29's bulk variant staged rows in
# row order (8-way conflicts), behind a warpgroup barrier, in one buffer: 0.95-1.02x.
# Before the call, on the machine without a GPU:
#   rm -rf .probe && mkdir -p .probe/p10 && git archive HEAD | tar -x -C .probe/p10
#   (cd .probe/p10 && patch -s -p1 < ../../bench/results/h200-2026-12-04-dq-bulk/dq_bulk_fragments.patch)
# then run this with .probe carried.
export PYTHONUNBUFFERED=1 CUFLASH_PROBE=10
R=$PWD/bench/results/h200-2026-12-04-dq-bulk
cd .probe/p10
export PYTHONPATH=$PWD:$R
start=$SECONDS
timeout 150 python3 -m pytest -q -x -p probe_opts tests/test_backward.py -k "not_deterministic or loading_warpgroup" > $OUT/pytest.txt 2>&1
echo "pytest rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
start=$SECONDS
timeout 70 python3 $R/p59.py check > $OUT/check.txt 2>&1; echo "check rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
start=$SECONDS
timeout 200 python3 $R/p59.py speed float16 > $OUT/speed.txt 2>&1; echo "speed rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
for tool in memcheck racecheck; do
    timeout 90 compute-sanitizer --tool $tool --print-limit 20 python3 $R/p59.py san > $OUT/san_$tool.txt 2>&1
    echo "$tool rc=$?" >> $OUT/steps.txt; tail -2 $OUT/san_$tool.txt
done
tail -3 $OUT/pytest.txt; cat $OUT/steps.txt $OUT/check.txt $OUT/speed.txt
