#!/usr/bin/env bash
# The GPU checks and reports: the CUDA tests, then the GPU benchmarks, each under its own time
# limit and with its own log (LOGS, default gpu-logs/); a step that fails does not stop the
# rest, and the exit status says whether any failed. `make gpu-check` runs every step; a
# machine with a GPU and no network runs it with its own Python:
#
#     PY=python3 bash bench/gpu_check.sh [tests] [decode] [profile] [sarathi] [engine] [runahead]
#
# STEP_LIMIT=SECONDS sets every step's time limit.
set -u
PY=${PY:-.venv/bin/python}
LOGS=${LOGS:-gpu-logs}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONPATH="services:bench:tests${PYTHONPATH:+:$PYTHONPATH}"
failed=0

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=${STEP_LIMIT:-$2} started rc
    shift 2
    started=$(date +%s)
    timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    echo "== $name: exit $rc after $(( $(date +%s) - started )) s (limit $limit s): $*"
    tail -n 30 "$LOGS/$name.log"
    [ "$rc" = 0 ] || failed=1
}

for name in ${*:-tests decode profile sarathi engine runahead}; do
    case $name in
        tests) step tests 300 "$PY" -m pytest -q -s -p no:cacheprovider --noconftest -rs tests/gpu ;;
        decode) step decode 300 "$PY" bench/gpu_decode.py ;;
        sarathi) step sarathi 300 "$PY" bench/sarathi.py --device cuda --model random-1b --quick ;;
        engine) step engine 300 "$PY" bench/engine.py --device cuda ;;
        runahead) step runahead 300 "$PY" bench/runahead_gpu.py ;;
        profile) step profile 300 "$PY" bench/gpu_profile.py ;;
        *) echo "no step $name"; failed=1 ;;
    esac
done
exit $failed
