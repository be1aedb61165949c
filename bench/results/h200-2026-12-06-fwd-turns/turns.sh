#!/usr/bin/env bash
# Not yet run on a GPU (bench/NOTES.md v37), about 380 s. Two trees: /tmp/turns (fwd_turns.patch:
# the loading-warpgroup forward's schedules, branch fwd-turns) and /tmp/bnd (that, then
# tile_boundary.patch: Q released after a tile's last score product, and with one Q buffer the
# tile's first K/V block copied before its Q; branch fwd-boundary).
#  1. the tests of both changes on /tmp/bnd (every schedule against the reference, tiles without
#     keys between tiles with them, the head-dim-128 defaults);
#  2. p_turns.py on /tmp/bnd: every schedule against the default and cuDNN in one process;
#  3. ab_trees.py: the default tiles of /tmp/bnd against /tmp/turns (the boundary change alone;
#     its defaults are main's), head dims 128 and 256, where tiles keep one Q buffer.
export PYTHONUNBUFFERED=1
HERE=$PWD/bench/results/h200-2026-12-06-fwd-turns
step() { local name=$1 limit=$2; shift 2; local start=$SECONDS
    timeout $limit "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $((SECONDS-start)) s: $(tail -1 $OUT/$name.txt)" >> $OUT/steps.txt; }
for t in turns bnd; do
    mkdir -p /tmp/$t && cp -r cuflash kernels bench tools tests docs /tmp/$t/
    (cd /tmp/$t && patch -p1 < $HERE/fwd_turns.patch) > $OUT/patch_$t.txt 2>&1
done
(cd /tmp/bnd && patch -p1 < $HERE/tile_boundary.patch) >> $OUT/patch_bnd.txt 2>&1
cd /tmp/bnd && export PYTHONPATH=/tmp/bnd
step bnd_pytest 120 python3 -m pytest -q --maxfail=5 tests/test_tensor_map.py \
    -k "loading_warpgroup_variants or tiles_in_turn or defaults_at_head_dim_128"
step turns_speed 170 python3 $HERE/p_turns.py float16,bfloat16 128,64,256 2048,8192,16384
unset PYTHONPATH
step bnd_ab 150 python3 bench/ab_trees.py /tmp/turns --new /tmp/bnd --head-dims 128 256 \
    --seqlens 2048 4096 16384 --processes 1 --rounds 3
cat $OUT/steps.txt; cat $OUT/turns_speed.txt; tail -30 $OUT/bnd_ab.txt
