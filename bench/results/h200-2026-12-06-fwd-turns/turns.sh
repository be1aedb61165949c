#!/usr/bin/env bash
# Not yet run on a GPU (bench/NOTES.md v37): the loading-warpgroup forward's schedules (branch
# fwd-turns, fwd_turns.patch here): the variants' tests (every schedule against the reference,
# tiles without keys between tiles with them), then p_turns.py, every variant against the
# default and cuDNN in one process (fp16 and bf16; D 128, 64, 256; N 2048, 8192, 16K), about 250 s.
export PYTHONUNBUFFERED=1
HERE=$PWD/bench/results/h200-2026-12-06-fwd-turns
step() { local name=$1 limit=$2; shift 2; local start=$SECONDS
    timeout $limit "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $((SECONDS-start)) s: $(tail -1 $OUT/$name.txt)" >> $OUT/steps.txt; }
mkdir -p /tmp/turns && cp -r cuflash kernels bench tools tests docs /tmp/turns/
(cd /tmp/turns && patch -p1 < $HERE/fwd_turns.patch) > $OUT/patch_turns.txt 2>&1
cd /tmp/turns && export PYTHONPATH=/tmp/turns
step turns_pytest 120 python3 -m pytest -q --maxfail=5 tests/test_tensor_map.py \
    -k "loading_warpgroup_variants or tiles_in_turn or defaults_at_head_dim_128"
step turns_speed 180 python3 $HERE/p_turns.py float16,bfloat16 128,64,256 2048,8192,16384
cat $OUT/steps.txt; cat $OUT/turns_speed.txt
