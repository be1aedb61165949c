#!/usr/bin/env bash
# The checks that need a GPU, in one go, from a source checkout:
#
#   bash tools/device_check.sh OUTDIR [STEP ...]
#
# Without STEPs, everything but the benchmarks: python -m cuflash (twice: with CuPy's kernel
# cache cold, then warm), the whole test suite (after tools/warm_cache.py has compiled every
# kernel in parallel), the long-sequence memory test's numbers, compute-sanitizer's four tools,
# the float32 accuracy table, the training example and the host time per call. STEPs pick and
# order them by name (cli warm_cache pytest long_sequence sanitize float32_accuracy
# train_example host_overhead) and add the benchmarks: grid (bench/bench_attention.py),
# model_shapes, decode, block_mask, modifiers, end_to_end (each into OUTDIR/NAME/; MODIFIERS_ARGS,
# END_TO_END_ARGS and HOST_OVERHEAD_ARGS, such as "--quick" or "--adapter", passed on to
# bench/modifiers.py, bench/end_to_end.py and bench/host_overhead.py).
# A run of record on a device call's time:
#
#   PACK=1 SANITIZE_TOOLS="memcheck synccheck" bash tools/device_check.sh OUT warm_cache pytest grid model_shapes sanitize
#
# PYTEST_WORKERS=N runs the suite in N processes on the one GPU (pytest-xdist, which the
# device's image has). One log per step in OUTDIR (NAME.txt), a line per step in
# OUTDIR/steps.txt as each ends; a summary of each step is printed last. With PACK=1 the whole of OUTDIR then goes into one
# archive beside it, OUTDIR.tar.gz, and only steps.txt stays in OUTDIR: two files to bring back
# from a machine that returns only a few.
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

# The steps, one function each (run_NAME); a step's name is its function's.
run_cli() { bash -c "time $python -m cuflash && time $python -m cuflash --dtype bfloat16 --head-dim 59 --causal"; }
run_warm_cache() { "$python" tools/warm_cache.py; }
run_pytest() {   # PYTEST_WORKERS=N: N processes (pytest-xdist), the BLAS threads shared among them
    if [ -n "${PYTEST_WORKERS:-}" ]; then
        local threads=$(( $(nproc) / PYTEST_WORKERS ))
        OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads MKL_NUM_THREADS=$threads \
            "$python" -m pytest -q -rs --durations=25 -n "$PYTEST_WORKERS" tests
    else
        "$python" -m pytest -q -rs --durations=25 tests
    fi
}
run_long_sequence() { "$python" -m pytest -q -s tests/test_backward.py -k long_sequence; }
run_sanitize() { bash tools/sanitize.sh "$out/sanitize_logs"; }
run_float32_accuracy() { "$python" bench/float32_accuracy.py; }
run_train_example() { "$python" examples/train_attention.py; }
# shellcheck disable=SC2086  # HOST_OVERHEAD_ARGS: words on purpose
run_host_overhead() { "$python" bench/host_overhead.py ${HOST_OVERHEAD_ARGS:-}; }
run_grid() { "$python" bench/bench_attention.py --out "$out/grid"; }
run_model_shapes() { "$python" bench/model_shapes.py --out "$out/model_shapes"; }
run_decode() { "$python" bench/decode.py --out "$out/decode"; }
run_block_mask() { "$python" bench/block_mask.py --out "$out/block_mask"; }
# shellcheck disable=SC2086  # MODIFIERS_ARGS: words on purpose
run_modifiers() { "$python" bench/modifiers.py --out "$out/modifiers" ${MODIFIERS_ARGS:-}; }
# shellcheck disable=SC2086  # USER_FUNCTIONS_ARGS: words on purpose
run_user_functions() { "$python" bench/user_functions.py --out "$out/user_functions" ${USER_FUNCTIONS_ARGS:-}; }
# shellcheck disable=SC2086  # END_TO_END_ARGS: words on purpose
run_end_to_end() { "$python" bench/end_to_end.py --out "$out/end_to_end" ${END_TO_END_ARGS:-}; }

steps=("${@:2}")
if [ ${#steps[@]} -eq 0 ]; then
    steps=(cli warm_cache pytest long_sequence sanitize float32_accuracy train_example host_overhead)
fi
for name in "${steps[@]}"; do   # every name checked before any step runs
    if ! declare -F "run_$name" >/dev/null; then
        echo "device_check.sh: no step named $name (steps: $(declare -F | sed -n 's/^declare -f run_//p' | tr '\n' ' '))" >&2
        exit 2
    fi
done

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader >"$out/steps.txt" 2>&1
for name in "${steps[@]}"; do
    step "$name" "run_$name"
done

cat "$out/steps.txt"
summary() {   # summary NAME COMMAND...: the step's summary lines, where it ran
    local name=$1
    shift
    if [ -f "$out/$name.txt" ]; then
        echo "== ${name//_/ }"
        "$@" "$out/$name.txt"
    fi
}
summary cli grep -E "first call|max \||cuflash |naive|faster|real"
summary warm_cache tail -n 1
summary pytest tail -n 1
summary long_sequence grep -E "pool peak|passed|failed"
summary sanitize grep -E "^(memcheck|racecheck|initcheck|synccheck)|passed|FAILED"
summary float32_accuracy tail -n 1
summary train_example tail -n 1
summary host_overhead tail -n 8
summary grid tail -n 3
summary model_shapes tail -n 4
summary decode tail -n 3
summary modifiers grep -E "^- |picked"
summary user_functions grep -E "^\| "
summary end_to_end grep -E -A 6 "^training tokens/s|^loss curves"

if [ "${PACK:-0}" = 1 ]; then
    tar -czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")" &&
        find "$out" -mindepth 1 ! -name steps.txt -delete
    echo "packed: $out.tar.gz"
fi
