#!/usr/bin/env bash
# The next probe call (bench/NOTES.md v32, Next 1), not yet run: one exponential in 8 or in 4 of
# a thread's share of a row computed on the FMA pipe (exp2_fma: 2^round(x) from exponent bits
# times a cubic in the rest, relative error 7.5e-5) in the loading-warpgroup forwards, the others
# on the SFU (next_exp2_fma.patch; every such forward compiles with it at 8 and at 4 for sm_90a
# under --werror, no spills).
# Before the call, on the machine without a GPU (three trees: the code before, and the patch at
# 8 and at 4):
#   rm -rf .probe && mkdir -p .probe/old && git archive HEAD cuflash kernels | tar -x -C .probe/old
#   for n in 8 4; do cp -r .probe/old .probe/e$n
#     patch -s -p1 -d .probe/e$n < bench/results/h200-2026-12-04-softmax-chains/next_exp2_fma.patch
#     sed -i "s/^#define CUFLASH_PROBE_EXP2_FMA_EVERY 0/#define CUFLASH_PROBE_EXP2_FMA_EVERY $n/" \
#       .probe/e$n/kernels/attention/tile_config.cuh; done
# then run this with .probe carried.
export PYTHONUNBUFFERED=1
for n in 8 4; do
    start=$SECONDS
    PYTHONPATH=$PWD timeout 110 python3 bench/ab_trees.py .probe/old --new .probe/e$n --dtype float16 bfloat16 \
        --head-dims 128 64 --seqlens 2048 4096 16384 --causal 0 1 --processes 2 --rounds 3 > $OUT/ab_e$n.txt 2>&1
    echo "ab e$n rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
done
start=$SECONDS
# (from inside the tree, so that its cuflash is the one imported: python -m puts the working
# directory first on the path)
(cd .probe/e4 && timeout 200 python3 -m pytest -q -x ../../tests/test_edges.py ../../tests/test_tensor_map.py \
    -k "not million and not 2_20 and not 2_31 and not 65535" > $OUT/pytest_e4.txt 2>&1)
echo "pytest e4 rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
# the backward's head-dim-64 dK/dV pass and cuDNN's backward, per-instruction stall samples
# (bench/NOTES.md v32 Next 3)
start=$SECONDS
S="--section SourceCounters --section WarpStateStats --section InstructionStats --section SpeedOfLight"
PYTHONPATH=$PWD timeout 60 ncu --clock-control none $S -k regex:attn_bwd_dkdv --launch-skip 2 --launch-count 1 \
    -o $OUT/bwd_cuflash python3 bench/profile_case.py --seqlen 4096 --head-dim 64 > $OUT/ncu_bwd_cuflash.log 2>&1
PYTHONPATH=$PWD timeout 90 ncu --clock-control none $S -k "regex:bprop|dgrad" --launch-skip 2 --launch-count 1 \
    -o $OUT/bwd_cudnn python3 bench/profile_case.py --seqlen 4096 --head-dim 64 --impl torch-cudnn > $OUT/ncu_bwd_cudnn.log 2>&1
for w in cuflash cudnn; do
    ncu -i $OUT/bwd_$w.ncu-rep --page source --csv --print-source sass > $OUT/bwd_${w}_sass.csv 2>&1
    ncu -i $OUT/bwd_$w.ncu-rep --page details --print-details all > $OUT/bwd_${w}_details.txt 2>&1
done
(cd $OUT && tar czf ncu_bwd.tar.gz bwd_* ncu_bwd_* && rm -f bwd_* ncu_bwd_*)
echo "ncu bwd $((SECONDS-start)) s" >> $OUT/steps.txt
tail -3 $OUT/pytest_e4.txt; cat $OUT/steps.txt; for n in 8 4; do grep -A30 "^old:" $OUT/ab_e$n.txt; done
