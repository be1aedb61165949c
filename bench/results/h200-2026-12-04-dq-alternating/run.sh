#!/usr/bin/env bash
# deterministic=False with dq formed by one computing warpgroup a step in turn, over the
# block's 128 keys (head dims 64 and 128): tests, agreement, speed against the default,
# cuDNN and FA2, the D 64 path of the tree before (old/) beside it, memcheck and racecheck.
export PYTHONUNBUFFERED=1
D=bench/results/h200-2026-12-04-dq-alternating
P=$PWD/$D/p61.py
step() { local name=$1 limit=$2; shift 2; local start=$SECONDS
    timeout $limit "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $((SECONDS-start)) s: $(tail -1 $OUT/$name.txt)" >> $OUT/steps.txt; }
export PYTHONPATH=$PWD
step pytest 150 python3 -m pytest -q -x tests/test_backward.py tests/test_layout.py -k "dq_added or not_deterministic or specializations"
step check 40 python3 $P check 64,128
step speed128 150 python3 $P speed 128 1024,2048,4096,8192,16384
step speed64 80 python3 $P speed 64
(cd old && export PYTHONPATH=$PWD && step speed64_old 80 python3 $P speed 64)
for tool in memcheck racecheck; do step san_$tool 60 compute-sanitizer --tool $tool --print-limit 20 python3 $P san 64,128; done
cat $OUT/steps.txt; cat $OUT/check.txt $OUT/speed128.txt $OUT/speed64.txt $OUT/speed64_old.txt | grep -v "^p61"
