#!/usr/bin/env bash
# Not yet run on a GPU (bench/NOTES.md v35 Next 1): the dK/dV pass that adds dq up with both
# computing warpgroups waiting at each step's named barrier (both_sync.patch: bar.sync where
# the warpgroup that does not form dq now only arrives), so that racecheck sees the order of
# the two warpgroups' stores into the shared dq chunks. Racecheck over every sanitizer case on
# the patched tree (240 s), its deterministic=False tests, and its speed against the shipped
# tree in alternate processes (p61.py: default, deterministic=False, cuDNN, FA2; D 64 and 128).
export PYTHONUNBUFFERED=1
D=bench/results/h200-2026-12-05-dq-sync
P=$PWD/bench/results/h200-2026-12-04-dq-alternating/p61.py
SHIPPED=$PWD NEW=/tmp/patched
mkdir -p $NEW && cp -r cuflash kernels bench tools tests $NEW/ && (cd $NEW && patch -p1 < $SHIPPED/$D/both_sync.patch) > $OUT/patch.txt 2>&1
step() { local name=$1 limit=$2; shift 2; local start=$SECONDS
    timeout $limit "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $((SECONDS-start)) s: $(tail -1 $OUT/$name.txt)" >> $OUT/steps.txt; }
cd $NEW && export PYTHONPATH=$NEW
step pytest 120 python3 -m pytest -q -x tests/test_backward.py -k "dq_added or not_deterministic"
SANITIZE_TOOLS=racecheck SANITIZE_TIMEOUT=240 step racecheck 260 bash tools/sanitize.sh $OUT/san
for round in 1 2; do
    for tree in $SHIPPED $NEW; do
        cd $tree && export PYTHONPATH=$tree
        step speed_$(basename $tree)_$round 70 python3 $P speed 64,128
    done
done
cat $OUT/steps.txt; grep -h "D1\|D6" $OUT/speed_*.txt | sort | head -80
