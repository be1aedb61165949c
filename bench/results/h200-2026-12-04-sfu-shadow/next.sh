#!/usr/bin/env bash
# Not yet run on a GPU (bench/NOTES.md v33 Next 2): the loading-warpgroup forward waiting for the
# previous block's p v before the exponentials instead of after them, and rescaling the
# accumulator in every block, so that the rescale's FMULs and p's packing (F2FP) can be
# scheduled between the ex2s (cuDNN's order) - against the code before, in alternate processes.
# Before the call, on the machine without a GPU:
#   rm -rf .probe && mkdir -p .probe/old && git archive HEAD cuflash kernels | tar -x -C .probe/old
#   cp -r .probe/old .probe/new
#   patch -s -p1 -d .probe/new < bench/results/h200-2026-12-04-sfu-shadow/pv_before_exponentials.patch
# then run this with .probe carried (about 200 s).
export PYTHONUNBUFFERED=1
start=$SECONDS
PYTHONPATH=$PWD timeout 200 python3 bench/ab_trees.py .probe/old --new .probe/new --dtype float16 bfloat16 \
    --head-dims 64 128 256 --seqlens 2048 8192 --causal 0 1 --processes 2 --rounds 3 > $OUT/ab.txt 2>&1
echo "ab rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
start=$SECONDS
(cd .probe/new && timeout 120 python3 -m pytest -q -x ../../tests/test_edges.py ../../tests/test_tensor_map.py \
    -k "not million and not 2_20 and not 2_31 and not 65535" > $OUT/pytest.txt 2>&1)
echo "pytest rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
tail -3 $OUT/pytest.txt; cat $OUT/steps.txt; grep -A40 "^old:" $OUT/ab.txt
