#!/usr/bin/env bash
# Runs tools/sanitize_cases.py under compute-sanitizer's memcheck, racecheck, initcheck
# and synccheck, one process per tool, each tool's log in OUTDIR.
#
#   bash tools/sanitize.sh [OUTDIR]
#
# OUTDIR defaults to a new temporary directory. First the cases run once without the
# sanitizer, so that every kernel (cuflash's and CuPy's own) is compiled and in CuPy's
# disk cache: compiling under the sanitizer is slow. Prints one line per tool (tool, exit
# status, its ERROR SUMMARY line, or racecheck's RACECHECK SUMMARY) and exits 1 if any tool failed.
#
# Environment: PYTHON (default python3); SANITIZE_TOOLS (default all four); SANITIZE_CASES,
# the groups of tools/sanitize_cases.py to run (default all: plain kvcache modifiers);
# SANITIZE_TIMEOUT, seconds per tool (default 1200; a timeout shows as exit 124).

set -u -o pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
outdir="${1:-$(mktemp -d "${TMPDIR:-/tmp}/cuflash-sanitize.XXXXXX")}"
mkdir -p "$outdir"
python="${PYTHON:-python3}"
tools="${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}"
limit="${SANITIZE_TIMEOUT:-1200}"
cases="$root/tools/sanitize_cases.py"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

if ! command -v compute-sanitizer >/dev/null 2>&1; then
    echo "compute-sanitizer is not on PATH (it ships with the CUDA toolkit)" >&2
    exit 2
fi

echo "logs in $outdir"
# shellcheck disable=SC2086  # SANITIZE_CASES: words on purpose
if ! "$python" "$cases" ${SANITIZE_CASES:-} >"$outdir/warmup.log" 2>&1; then
    echo "the cases fail without the sanitizer (see $outdir/warmup.log):" >&2
    tail -n 20 "$outdir/warmup.log" >&2
    exit 1
fi

failed=0
for tool in $tools; do
    flags=(--tool "$tool" --error-exitcode 1)
    case "$tool" in
        memcheck) flags+=(--leak-check no) ;;          # CuPy frees lazily at exit; not our leak
        racecheck) flags+=(--racecheck-report all) ;;  # each hazard and the analysis summary
    esac
    log="$outdir/$tool.log"
    start=$SECONDS
    timeout -k 30 "$limit" compute-sanitizer "${flags[@]}" "$python" "$cases" ${SANITIZE_CASES:-} >"$log" 2>&1
    status=$?
    summary="$(grep -oE '(ERROR|RACECHECK) SUMMARY.*' "$log" | tail -n 1)"
    printf '%-10s exit %-3s %-58s %4ss  %s\n' "$tool" "$status" "${summary:-(no ERROR SUMMARY line)}" \
        "$((SECONDS - start))" "$log"
    if [ "$status" -ne 0 ]; then
        failed=1
    fi
done

if [ "$failed" -ne 0 ]; then
    echo "FAILED: see the logs in $outdir"
    exit 1
fi
echo "all tools passed"
