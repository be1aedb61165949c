#!/usr/bin/env bash
# Not yet run on a GPU (bench/NOTES.md v34 Next 1 and 2): per-instruction stall samples of
# the D 128 backward (our dK/dV pass beside cuDNN's backward kernel, fp16, N 4096, no mask)
# and of the D 64 dK/dV pass that adds dq up (deterministic=False), about 3 minutes.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
S="--section SourceCounters --section WarpStateStats --section InstructionStats --section SpeedOfLight"
start=$SECONDS
run() {   # name, kernel regex, then profile_case.py's arguments
    local name=$1 kernels=$2
    shift 2
    timeout 60 ncu --clock-control none $S -k "regex:$kernels" --launch-skip 2 --launch-count 1 -o $OUT/$name \
        python3 bench/profile_case.py --seqlen 4096 "$@" > $OUT/ncu_$name.log 2>&1
    ncu -i $OUT/$name.ncu-rep --page source --csv --print-source sass > $OUT/${name}_sass.csv 2>&1
    ncu -i $OUT/$name.ncu-rep --page details --print-details all > $OUT/${name}_details.txt 2>&1
}
run d128_dkdv attn_bwd_dkdv --head-dim 128
run d128_cudnn "bprop|dgrad" --head-dim 128 --impl torch-cudnn
run d64_any attn_bwd_dkdv --head-dim 64 --impl cuflash-any
(cd $OUT && tar czf ncu_bwd.tar.gz d128_* d64_* ncu_* && rm -f d128_* d64_* ncu_d*)
echo "ncu $((SECONDS-start)) s" >> $OUT/steps.txt
cat $OUT/steps.txt
