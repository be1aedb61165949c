# The first measurement of dq_in_dkdv_sender_warps.patch (not yet run on a GPU), on a clean
# checkout of the commit it was made on with the patch applied (git apply):
#   the dq tests and the loading-warpgroup tests, then p54.py (agreement, repeatability,
#   speed against the deterministic default, cuDNN and FA2), then memcheck and racecheck.
set -x
export PYTHONPATH=$PWD
timeout 240 python3 -m pytest -q -x tests/test_backward.py -k "dq_added_up or not_deterministic or loading_warpgroup" > $OUT/pytest.txt 2>&1; echo "pytest rc $?" >> $OUT/pytest.txt
tail -3 $OUT/pytest.txt
timeout 60 python3 bench/results/h200-2026-12-04-dq-probes/p54.py check > $OUT/check.txt 2>&1; tail -4 $OUT/check.txt
timeout 200 python3 bench/results/h200-2026-12-04-dq-probes/p54.py speed > $OUT/speed.txt 2>&1; echo "speed rc $?" >> $OUT/speed.txt
for tool in memcheck racecheck; do timeout 90 compute-sanitizer --tool $tool --print-limit 20 python3 bench/results/h200-2026-12-04-dq-probes/san54.py > $OUT/san_$tool.txt 2>&1; tail -2 $OUT/san_$tool.txt; done
cat $OUT/speed.txt
