# (run with .probe/ holding ../h200-2026-12-04-1219fab/probes/pncu.py as pncu.py)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
start=$SECONDS
timeout 150 python3 bench/ab_trees.py .probe/old --dtype float16 bfloat16 --head-dims 128 256 64 \
    --seqlens 2048 4096 16384 --causal 0 1 --processes 2 --rounds 3 > $OUT/ab.txt 2>&1
echo "ab rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
start=$SECONDS
S="--section SourceCounters --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis --section SpeedOfLight"
timeout 60 ncu --clock-control none $S -k regex:attn_fwd_sm90_ws --launch-skip 2 --launch-count 1 -o $OUT/cuflash python3 .probe/pncu.py cuflash 2048 128 > $OUT/ncu_cuflash.log 2>&1
ncu -i $OUT/cuflash.ncu-rep --page source --csv --print-source sass > $OUT/cuflash_sass.csv 2>&1
ncu -i $OUT/cuflash.ncu-rep --page details --print-details all > $OUT/cuflash_details.txt 2>&1
echo "ncu rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
start=$SECONDS
timeout 230 python3 -m pytest -q -x tests/test_tensor_map.py tests/test_edges.py tests/test_forward.py tests/test_kvcache.py > $OUT/pytest.txt 2>&1
echo "pytest rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
tail -3 $OUT/pytest.txt; cat $OUT/steps.txt; grep -A50 "^old:" $OUT/ab.txt
cd $OUT && tar czf ncu.tar.gz cuflash* ncu_* && rm -f cuflash* ncu_*
