export PYTHONPATH=$PWD:$PWD/.probe
CUFLASH_PROBE=7 timeout 120 python3 -m pytest -q -x -p probe_opts tests/test_backward.py -k "dq_added_up or not_deterministic" > $OUT/pytest_v7.txt 2>&1; echo "pytest rc $?" >> $OUT/pytest_v7.txt
tail -2 $OUT/pytest_v7.txt
for v in 7; do timeout 90 python3 .probe/p55.py $v 2>&1 | tail -6; done | tee $OUT/p57.txt
