#!/usr/bin/env bash
# call 2: A/B of the carried last product (128-key blocks only) against HEAD's tree, memcheck of its test, targeted tests
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader > $OUT/gpu.txt
start=$SECONDS
timeout 200 python3 bench/ab_trees.py .probe/old --dtype float16 bfloat16 --head-dims 128 64 --seqlens 512 1024 2048 4096 16384 --causal 0 1 --processes 2 --rounds 3 > $OUT/ab.txt 2>&1
echo "ab rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
start=$SECONDS
timeout 60 compute-sanitizer --tool memcheck --error-exitcode 1 python3 -m pytest -q -x tests/test_tensor_map.py -k "carried" > $OUT/memcheck_carry.txt 2>&1
echo "memcheck rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
start=$SECONDS
timeout 200 python3 -m pytest -q -x tests/test_tensor_map.py tests/test_edges.py tests/test_forward.py > $OUT/pytest_targeted.txt 2>&1
echo "pytest rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
tail -3 $OUT/pytest_targeted.txt; tail -3 $OUT/memcheck_carry.txt; cat $OUT/steps.txt; grep -A50 "^old:" $OUT/ab.txt
