#!/usr/bin/env bash
# Not yet run on a GPU (bench/NOTES.md v35 Next 1): the dK/dV pass that adds dq up with the
# order of the two warpgroups' stores into the shared dq chunks made plain to racecheck, one
# variant a call: `bash next.sh both_sync` (both_sync.patch: the warpgroup that does not form
# dq waits at each step's named barrier too, instead of only arriving) or `bash next.sh
# chunk_mbarriers` (chunk_mbarriers.patch: a "free" mbarrier per chunk, its 32 lanes arriving
# once their bulk add has read it, the next writer's lanes waiting on it before they write).
# Racecheck over every sanitizer case on the patched tree (240 s), its deterministic=False
# tests, and its speed against the shipped tree in alternate processes (p61.py: default,
# deterministic=False, cuDNN, FA2; D 64 and 128).
export PYTHONUNBUFFERED=1
D=bench/results/h200-2026-12-05-dq-sync
P=$PWD/bench/results/h200-2026-12-04-dq-alternating/p61.py
VARIANT=${1:?both_sync or chunk_mbarriers}
SHIPPED=$PWD NEW=/tmp/$VARIANT
mkdir -p $NEW && cp -r cuflash kernels bench tools tests $NEW/ && (cd $NEW && patch -p1 < $SHIPPED/$D/$VARIANT.patch) > $OUT/patch.txt 2>&1
step() { local name=$1 limit=$2; shift 2; local start=$SECONDS
    timeout $limit "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $((SECONDS-start)) s: $(tail -1 $OUT/$name.txt)" >> $OUT/steps.txt; }
cd $NEW && export PYTHONPATH=$NEW
step pytest 120 python3 -m pytest -q -x tests/test_backward.py -k "dq_added or not_deterministic"
export SANITIZE_TOOLS=racecheck SANITIZE_TIMEOUT=240
step racecheck 260 bash tools/sanitize.sh $OUT/san
for round in 1 2; do
    for tree in $SHIPPED $NEW; do
        cd $tree && export PYTHONPATH=$tree
        step speed_$(basename $tree)_$round 70 python3 $P speed 64,128
    done
done
cat $OUT/steps.txt; grep -h "D1\|D6" $OUT/speed_*.txt | sort | head -80
