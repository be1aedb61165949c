#!/usr/bin/env bash
# Second call: both computing warpgroups stage dq through the same four chunks (so three
# stages fit at head dim 128, 231 KB); the D 128 pass with 2 and 3 stages, deterministic and
# not (p62.py); D 64 again (p61.py); tests; memcheck and racecheck of every variant; stall
# samples of the D 128 pass that adds dq up.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
D=bench/results/h200-2026-12-04-dq-alternating
step() { local name=$1 limit=$2; shift 2; local start=$SECONDS
    timeout $limit "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $((SECONDS-start)) s: $(tail -1 $OUT/$name.txt)" >> $OUT/steps.txt; }
step pytest2 150 python3 -m pytest -q -x tests/test_backward.py tests/test_layout.py -k "dq_added or not_deterministic or specializations or loading_warpgroup"
step speed128_stages 150 python3 $D/p62.py speed 128
step speed64_2 60 python3 $D/p61.py speed 64
for tool in memcheck racecheck; do step san2_$tool 60 compute-sanitizer --tool $tool --print-limit 20 python3 $D/p62.py san 128; done
S="--section SourceCounters --section WarpStateStats --section SpeedOfLight"
step ncu 70 ncu --clock-control none $S -k "regex:attn_bwd_dkdv" --launch-skip 2 --launch-count 1 -o $OUT/d128_any_alt \
    python3 bench/profile_case.py --seqlen 4096 --head-dim 128 --impl cuflash-any
ncu -i $OUT/d128_any_alt.ncu-rep --page source --csv --print-source sass > $OUT/d128_any_alt_sass.csv 2>&1
ncu -i $OUT/d128_any_alt.ncu-rep --page details --print-details all > $OUT/d128_any_alt_details.txt 2>&1
(cd $OUT && tar czf ncu_d128_any_alt.tar.gz d128_any_alt* && rm -f d128_any_alt*)
cat $OUT/steps.txt; cat $OUT/speed128_stages.txt $OUT/speed64_2.txt | grep -v "^p6"
