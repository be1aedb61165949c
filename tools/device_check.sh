#!/usr/bin/env bash
# Everything that needs a GPU except the benchmark grid, in one go, from a source checkout:
#
#   bash tools/device_check.sh OUTDIR
#
# python -m cuflash (twice: with CuPy's kernel cache cold, then warm), the whole test suite
# (after tools/warm_cache.py has compiled every kernel in parallel),
# the long-sequence memory test's numbers, compute-sanitizer's four tools, the float32
# accuracy table, the training example and the host time per call. One log per step in
# OUTDIR; a summary of each is printed last.
set -u -o pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:?usage: bash tools/device_check.sh OUTDIR}"
mkdir -p "$out"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python="${PYTHON:-python3}"

step() {   # step NAME COMMAND...: runs it, its output in OUTDIR/NAME.txt, and records the status
    local name=$1
    shift
    local start=$SECONDS
    "$@" >"$out/$name.txt" 2>&1
    local status=$?
    echo "$name: exit $status, $((SECONDS - start)) s" >>"$out/steps.txt"
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader >"$out/steps.txt" 2>&1
step cli bash -c "time $python -m cuflash && time $python -m cuflash --dtype bfloat16 --head-dim 59 --causal"
step warm_cache "$python" tools/warm_cache.py
step pytest "$python" -m pytest -q -rs tests
step long_sequence "$python" -m pytest -q -s tests/test_backward.py -k long_sequence
step sanitize bash tools/sanitize.sh "${TMPDIR:-/tmp}/cuflash-sanitize"
step float32_accuracy "$python" bench/float32_accuracy.py
step train_example "$python" examples/train_attention.py
step host_overhead "$python" bench/host_overhead.py

cat "$out/steps.txt"
echo "== cli";              grep -E "first call|max \||cuflash |naive|faster|real" "$out/cli.txt"
echo "== warm cache";       tail -n 1 "$out/warm_cache.txt"
echo "== pytest";           tail -n 1 "$out/pytest.txt"
echo "== long sequence";    grep -E "pool peak|passed|failed" "$out/long_sequence.txt"
echo "== sanitize";         grep -E "^(memcheck|racecheck|initcheck|synccheck)|passed|FAILED" "$out/sanitize.txt"
echo "== float32 accuracy"; tail -n 1 "$out/float32_accuracy.txt"
echo "== train example";    tail -n 1 "$out/train_example.txt"
echo "== host overhead";    tail -n 8 "$out/host_overhead.txt"
