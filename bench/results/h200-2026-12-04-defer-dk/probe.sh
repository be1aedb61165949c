#!/usr/bin/env bash
# dk's product of step j left running under step j + 1's score products, its stage released
# after the next step's s^T (defer_dk.patch, .probe/new) against the code before (.probe/old:
# git archive HEAD cuflash kernels), the head-dim-64 backward; the loading-warpgroup backward
# tests on the new tree. Run with .probe carried. (At head dim 128 the patch makes ptxas
# serialize the products for want of registers: not timed there.)
export PYTHONUNBUFFERED=1
start=$SECONDS
PYTHONPATH=$PWD timeout 150 python3 bench/ab_trees.py .probe/old --new .probe/new --dtype float16 bfloat16 --head-dims 64 \
    --seqlens 2048 4096 8192 16384 --causal 0 1 --direction bwd --processes 2 --rounds 3 > $OUT/ab.txt 2>&1
echo "ab rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
start=$SECONDS
(cd .probe/new && timeout 90 python3 -m pytest -q -x ../../tests/test_backward.py -k "loading_warpgroup_passes" > $OUT/pytest.txt 2>&1)
echo "pytest rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
tail -3 $OUT/pytest.txt; cat $OUT/steps.txt; grep -A20 "^old:" $OUT/ab.txt
