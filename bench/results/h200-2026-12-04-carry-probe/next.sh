#!/usr/bin/env bash
# A probe call (bench/NOTES.md v31 Next 1; run in v32, refuted, its outputs in 3-rescale/): the output's rescale moved under
# the next block's scores
# (next_rescale_under_scores.patch; every loading-warpgroup forward compiles with it for sm_90a
# under --werror, no spills, no serialization advisory).
# Before the call, on the machine without a GPU:
#   mkdir -p .probe/old && git archive HEAD cuflash kernels | tar -x -C .probe/old
#   git apply bench/results/h200-2026-12-04-carry-probe/next_rescale_under_scores.patch
# then run this with .probe carried, and take the patch back out (git checkout kernels).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
start=$SECONDS
timeout 240 python3 bench/ab_trees.py .probe/old --dtype float16 bfloat16 --head-dims 128 256 64 \
    --seqlens 2048 4096 16384 --causal 0 1 --processes 2 --rounds 3 > $OUT/ab.txt 2>&1
echo "ab rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
start=$SECONDS
timeout 200 python3 -m pytest -q -x tests/test_tensor_map.py tests/test_edges.py tests/test_forward.py > $OUT/pytest.txt 2>&1
echo "pytest rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
tail -3 $OUT/pytest.txt; cat $OUT/steps.txt; grep -A50 "^old:" $OUT/ab.txt
