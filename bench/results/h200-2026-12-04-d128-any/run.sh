#!/usr/bin/env bash
# deterministic=False at head dim 128 (branch probe/d128-any-order): the dK/dV pass adds dq up
# 64 columns at a time (two products and two bulk adds a step). Its tests, agreement, speed
# against the default, cuDNN and FA2 (head dims 128 and 64), memcheck and racecheck.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
P=bench/results/h200-2026-12-04-d128-any/p60.py
start=$SECONDS
timeout 100 python3 -m pytest -q -x tests/test_backward.py -k "dq_added or not_deterministic" > $OUT/pytest.txt 2>&1
echo "pytest rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
start=$SECONDS
timeout 30 python3 $P check 128 > $OUT/check.txt 2>&1; echo "check rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
start=$SECONDS
timeout 80 python3 $P speed 128 > $OUT/speed.txt 2>&1; echo "speed rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
for tool in memcheck racecheck; do
    start=$SECONDS
    timeout 50 compute-sanitizer --tool $tool --print-limit 20 python3 $P san 128 > $OUT/san_$tool.txt 2>&1
    echo "$tool rc=$? $((SECONDS-start)) s: $(tail -1 $OUT/san_$tool.txt)" >> $OUT/steps.txt
done
tail -3 $OUT/pytest.txt; cat $OUT/steps.txt $OUT/check.txt $OUT/speed.txt
