#!/usr/bin/env bash
# Not yet run on a GPU (bench/NOTES.md v36): the next session's one probe call, about 500 s.
#  1. The racecheck reports of the D 64/128 pass that adds dq up (NOTES v35): both variants of
#     ../h200-2026-12-05-dq-sync (both_sync.patch, chunk_mbarriers.patch), racecheck over
#     p61.py's cases each, then their speed beside the shipped tree (one round, N 4096, 16K).
#  2. deterministic=False at head dim 256 (../h200-2026-12-05-d256-dq/d256_dq.patch, branch
#     d256-dq): its tests, agreement, memcheck and racecheck, speed of both forms against the
#     default, cuDNN and FA2 (p_d256.py, N 4096 and 16K), and cuDNN's D 256 backward kernel
#     with its SASS and stall samples.
# SECTIONS (default "race d256 ncu"): which of the three parts to run, e.g. SECTIONS="d256";
# D256_SAN=0 leaves out the D 256 part's memcheck and racecheck.
export PYTHONUNBUFFERED=1
SECTIONS=${SECTIONS:-race d256 ncu}
on() { [[ " $SECTIONS " == *" $1 "* ]]; }
R=$PWD/bench/results
P61=$R/h200-2026-12-04-dq-alternating/p61.py P256=$R/h200-2026-12-05-d256-dq/p_d256.py
SHIPPED=$PWD
step() { local name=$1 limit=$2; shift 2; local start=$SECONDS
    timeout $limit "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $((SECONDS-start)) s: $(tail -1 $OUT/$name.txt)" >> $OUT/steps.txt; }
tree() {   # tree NAME PATCH: a copy of the shipped tree with PATCH applied, in /tmp/NAME
    mkdir -p /tmp/$1 && cp -r cuflash kernels bench tools tests docs /tmp/$1/
    (cd /tmp/$1 && patch -p1 < $2) > $OUT/patch_$1.txt 2>&1
}
tree both_sync $R/h200-2026-12-05-dq-sync/both_sync.patch
tree chunk_mbarriers $R/h200-2026-12-05-dq-sync/chunk_mbarriers.patch
tree d256 $R/h200-2026-12-05-d256-dq/d256_dq.patch
if on race; then
for variant in both_sync chunk_mbarriers; do
    cd /tmp/$variant && export PYTHONPATH=/tmp/$variant
    step race_$variant 80 compute-sanitizer --tool racecheck --racecheck-report all --print-limit 20 python3 $P61 san 64,128
done
for t in $SHIPPED /tmp/both_sync /tmp/chunk_mbarriers; do
    cd $t && export PYTHONPATH=$t
    step speed_$(basename $t) 45 python3 $P61 speed 64,128 4096,16384
done
fi
if on d256; then
cd /tmp/d256 && export PYTHONPATH=/tmp/d256
step d256_pytest 120 python3 -m pytest -q --maxfail=5 tests/test_backward.py tests/test_layout.py \
    -k "dq_added or not_deterministic or specializations"
step d256_check 40 python3 $P256 check
if [ "${D256_SAN:-1}" = 1 ]; then   # (D256_SAN=0 leaves the sanitizer steps out)
    step d256_memcheck 50 compute-sanitizer --tool memcheck --print-limit 20 python3 $P256 san
    step d256_racecheck 70 compute-sanitizer --tool racecheck --racecheck-report all --print-limit 20 python3 $P256 san
fi
step d256_speed 90 python3 $P256 speed 4096,16384
fi
if on ncu; then
S="--section SourceCounters --section WarpStateStats --section SpeedOfLight"
step ncu_cudnn_d256 50 ncu --clock-control none $S -k "regex:bprop" --launch-skip 1 --launch-count 1 -o $OUT/cudnn_d256 \
    python3 bench/profile_case.py --seqlen 4096 --head-dim 256 --impl torch-cudnn --repeat 2
ncu -i $OUT/cudnn_d256.ncu-rep --page source --csv --print-source sass > $OUT/cudnn_d256_sass.csv 2>&1
ncu -i $OUT/cudnn_d256.ncu-rep --page details --print-details all > $OUT/cudnn_d256_details.txt 2>&1
(cd $OUT && tar czf ncu_cudnn_d256.tar.gz cudnn_d256* && rm -f cudnn_d256*)
fi
cat $OUT/steps.txt; grep -h "D1\|D6" $OUT/speed_*.txt | sort; grep -h "D256\|D 256" $OUT/d256_speed.txt $OUT/d256_check.txt
