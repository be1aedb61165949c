#!/usr/bin/env bash
# The scale as two floats from the host (params.cuh: scale_log2, scale_log2_lo) against the
# code before (.probe/old: git archive HEAD cuflash kernels), forward and backward; the targeted
# tests on the new code; lse at large logits (lse_large.py). Run with .probe carried.
export PYTHONUNBUFFERED=1
start=$SECONDS
PYTHONPATH=$PWD timeout 260 python3 bench/ab_trees.py .probe/old --dtype float16 bfloat16 --head-dims 64 128 256 \
    --seqlens 2048 8192 --causal 0 1 --direction fwd bwd --processes 2 --rounds 3 > $OUT/ab.txt 2>&1
echo "ab rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
start=$SECONDS
PYTHONPATH=$PWD timeout 150 python3 -m pytest -q tests/test_layout.py tests/test_edges.py tests/test_kvcache.py \
    -k "not million and not 2_20 and not 2_31 and not 65535" > $OUT/pytest.txt 2>&1
echo "pytest rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
start=$SECONDS
PYTHONPATH=$PWD timeout 60 python3 bench/results/h200-2026-12-04-host-scale/lse_large.py > $OUT/lse_large.txt 2>&1
echo "lse rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
tail -3 $OUT/pytest.txt; cat $OUT/steps.txt $OUT/lse_large.txt; grep -A60 "^old:" $OUT/ab.txt
