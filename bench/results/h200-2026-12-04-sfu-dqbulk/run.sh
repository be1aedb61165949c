#!/usr/bin/env bash
# One device call for three things written last time (bench/NOTES.md v33 Next 1 and 2), shortened
# to fit: probe 10 (dq added up in the D 64 dK/dV pass by per-warp bulk adds; its tests, agreement,
# speed; sanitizers only if it is kept), the forward with p v waited for before the exponentials
# (A/B in alternate processes, two rounds), and the dq pass's own stall samples (D 64 and 128).
# Before the call, on the machine without a GPU, build .probe/p10, .probe/old and .probe/new as
# the two next.sh headers say; carry .probe.
export PYTHONUNBUFFERED=1
ROOT=$PWD
R=$ROOT/bench/results/h200-2026-12-04-dq-bulk
# probe 10
(
  export CUFLASH_PROBE=10 PYTHONPATH=$ROOT/.probe/p10:$R
  cd .probe/p10
  start=$SECONDS
  timeout 110 python3 -m pytest -q -x -p probe_opts tests/test_backward.py -k "not_deterministic or loading_warpgroup" > $OUT/p10_pytest.txt 2>&1
  echo "p10 pytest rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
  start=$SECONDS
  timeout 60 python3 $R/p59.py check > $OUT/p10_check.txt 2>&1; echo "p10 check rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
  start=$SECONDS
  timeout 170 python3 $R/p59.py speed float16 > $OUT/p10_speed.txt 2>&1; echo "p10 speed rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
)
# p v before the exponentials
start=$SECONDS
PYTHONPATH=$ROOT timeout 170 python3 bench/ab_trees.py .probe/old --new .probe/new --dtype float16 bfloat16 \
    --head-dims 64 128 256 --seqlens 2048 8192 --causal 0 1 --processes 2 --rounds 2 > $OUT/sfu_ab.txt 2>&1
echo "sfu ab rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
# the dq pass's stall samples
start=$SECONDS
S="--section SourceCounters --section WarpStateStats --section InstructionStats --section SpeedOfLight"
for d in 64 128; do
  PYTHONPATH=$ROOT timeout 40 ncu --clock-control none $S -k regex:attn_bwd_dq --launch-skip 2 --launch-count 1 \
      -o $OUT/dq_d$d python3 bench/profile_case.py --seqlen 4096 --head-dim $d > $OUT/ncu_dq_d$d.log 2>&1
  ncu -i $OUT/dq_d$d.ncu-rep --page source --csv --print-source sass > $OUT/dq_d${d}_sass.csv 2>&1
  ncu -i $OUT/dq_d$d.ncu-rep --page details --print-details all > $OUT/dq_d${d}_details.txt 2>&1
done
(cd $OUT && tar czf ncu_dq.tar.gz dq_d* ncu_dq_* && rm -f dq_d* ncu_dq_*)
echo "ncu dq $((SECONDS-start)) s" >> $OUT/steps.txt
tail -2 $OUT/p10_pytest.txt; cat $OUT/steps.txt $OUT/p10_check.txt; tail -25 $OUT/p10_speed.txt; grep -A30 "^old:" $OUT/sfu_ab.txt
