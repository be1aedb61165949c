#!/usr/bin/env bash
# deterministic=False as landed (probe 10 cleaned up: bench/NOTES.md v34): its tests and the
# tests around it, agreement and speed against the deterministic default, cuDNN and FA2 (v29's
# p54.py, fp16 and bf16), memcheck and racecheck on two small calls.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
P=bench/results/h200-2026-12-04-dq-probes/p54.py
start=$SECONDS
timeout 200 python3 -m pytest -q tests/test_backward.py tests/test_layout.py tests/test_api_errors.py \
    -k "dq_added or not_deterministic or loading_warpgroup or vjp or deterministic or layout or specializations" \
    > $OUT/pytest.txt 2>&1
echo "pytest rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
start=$SECONDS
timeout 60 python3 $P check > $OUT/check.txt 2>&1; echo "check rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
start=$SECONDS
timeout 150 python3 $P speed float16,bfloat16 > $OUT/speed.txt 2>&1; echo "speed rc=$? $((SECONDS-start)) s" >> $OUT/steps.txt
cat > /tmp/san.py <<'PY'
import sys, os
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import bench_attention as ba
import cuflash
for shape, causal in (((1, 2, 2064, 64), True), ((2, 4, 2048, 64), False)):
    q, k, v, do = ba.make_inputs(*shape, "float16", sets=1)[0]
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    cuflash.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=False)
print("san done")
PY
for tool in memcheck racecheck; do
    start=$SECONDS
    timeout 100 compute-sanitizer --tool $tool --print-limit 20 python3 /tmp/san.py > $OUT/san_$tool.txt 2>&1
    echo "$tool rc=$? $((SECONDS-start)) s: $(tail -1 $OUT/san_$tool.txt)" >> $OUT/steps.txt
done
tail -3 $OUT/pytest.txt; cat $OUT/steps.txt $OUT/check.txt $OUT/speed.txt
