# (run with .probe/ holding ../h200-2026-12-04-1219fab/probes/pncu.py as pncu.py)
export PYTHONPATH=$PWD
S="--section SourceCounters --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis --section SpeedOfLight --import-source yes"
timeout 200 ncu --clock-control none $S -k regex:attn_fwd_sm90_ws --launch-skip 2 --launch-count 1 -o $OUT/cuflash python3 .probe/pncu.py cuflash 2048 128 > $OUT/ncu_cuflash.log 2>&1; echo ncu1 $?
timeout 200 ncu --clock-control none $S -k regex:fprop --launch-skip 2 --launch-count 1 -o $OUT/cudnn python3 .probe/pncu.py cudnn 2048 128 > $OUT/ncu_cudnn.log 2>&1; echo ncu2 $?
for w in cuflash cudnn; do
  ncu -i $OUT/$w.ncu-rep --page source --csv --print-source sass > $OUT/${w}_sass.csv 2>$OUT/${w}_sass.err; echo src $w $?
  ncu -i $OUT/$w.ncu-rep --page details --print-details all > $OUT/${w}_details.txt 2>&1
done
cd $OUT && tar czf ncu.tar.gz *.csv *.txt *.log *.ncu-rep && rm -f *.csv *.txt *.log *.ncu-rep; ls -la $OUT
