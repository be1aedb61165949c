set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv > $OUT/smi.txt
timeout 200 python3 -m pytest -q -x tests/test_backward.py -k "dq_added_up or not_deterministic or loading_warpgroup" > $OUT/pytest.txt 2>&1; echo "pytest rc $?" >> $OUT/pytest.txt
tail -5 $OUT/pytest.txt
timeout 60 python3 .probe/p54.py check > $OUT/check.txt 2>&1; cat $OUT/check.txt | tail -6
timeout 200 python3 .probe/p54.py speed > $OUT/speed.txt 2>&1; echo "speed rc $?" >> $OUT/speed.txt
for tool in memcheck racecheck; do timeout 60 compute-sanitizer --tool $tool --print-limit 20 python3 .probe/san54.py > $OUT/san_$tool.txt 2>&1; tail -2 $OUT/san_$tool.txt; done
cat $OUT/speed.txt
