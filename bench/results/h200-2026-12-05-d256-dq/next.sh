#!/usr/bin/env bash
# Not yet run on a GPU (bench/NOTES.md v36): deterministic=False at head dim 256, the wide
# dK/dV pass forming dq^T = k^T ds^T and adding it up (d256_dq.patch, branch d256-dq).
# On the patched tree: its tests, agreement with the deterministic backward, memcheck and
# racecheck, its speed against the default, cuDNN and FA2 (p_d256.py), the three
# backwards' kernel durations at N 8192 (ncu, SpeedOfLight), and cuDNN's D 256 backward
# kernel with its SASS and stall samples (the design to read next). About 450 s.
export PYTHONUNBUFFERED=1
D=bench/results/h200-2026-12-05-d256-dq
SHIPPED=$PWD NEW=/tmp/d256
mkdir -p $NEW && cp -r cuflash kernels bench tools tests docs $NEW/ && (cd $NEW && patch -p1 < $SHIPPED/$D/d256_dq.patch) > $OUT/patch.txt 2>&1
step() { local name=$1 limit=$2; shift 2; local start=$SECONDS
    timeout $limit "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $((SECONDS-start)) s: $(tail -1 $OUT/$name.txt)" >> $OUT/steps.txt; }
cd $NEW && export PYTHONPATH=$NEW
step pytest 150 python3 -m pytest -q --maxfail=5 tests/test_backward.py tests/test_layout.py -k "dq_added or not_deterministic or specializations or loading_warpgroup"
step check 60 python3 $D/p_d256.py check
step memcheck 60 compute-sanitizer --tool memcheck --print-limit 20 python3 $D/p_d256.py san
step racecheck 90 compute-sanitizer --tool racecheck --racecheck-report all --print-limit 20 python3 $D/p_d256.py san
step speed 200 python3 $D/p_d256.py speed
for impl in cuflash cuflash-any torch-cudnn; do
    step ncu_$impl 40 ncu --clock-control none --section SpeedOfLight -k "regex:attn_bwd|scale_dq|delta|bprop|dot_do" \
        --launch-skip 6 --launch-count 6 python3 bench/profile_case.py --seqlen 8192 --head-dim 256 --impl $impl --repeat 2
done
S="--section SourceCounters --section WarpStateStats --section SpeedOfLight"
step ncu_cudnn_sass 60 ncu --clock-control none $S -k "regex:bprop" --launch-skip 1 --launch-count 1 -o $OUT/cudnn_d256 \
    python3 bench/profile_case.py --seqlen 4096 --head-dim 256 --impl torch-cudnn --repeat 2
ncu -i $OUT/cudnn_d256.ncu-rep --page source --csv --print-source sass > $OUT/cudnn_d256_sass.csv 2>&1
ncu -i $OUT/cudnn_d256.ncu-rep --page details --print-details all > $OUT/cudnn_d256_details.txt 2>&1
(cd $OUT && tar czf ncu_cudnn_d256.tar.gz cudnn_d256* && rm -f cudnn_d256*)
cat $OUT/steps.txt; grep -h "D256" $OUT/speed.txt $OUT/check.txt; grep -h "Duration\|^  [a-z_]*attn\|^  .*bprop\|^  .*scale_dq" $OUT/ncu_cu*.txt $OUT/ncu_torch*.txt | head -60
