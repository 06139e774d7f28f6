#!/usr/bin/env bash
# `make test`: the whole suite, in three pytest processes at once, whose tests mostly wait:
# on their own subprocesses, on recovery timers, on a model. tests/model (a real model on
# llama.cpp's server: about four minutes of one core) and tests/chaos with tests/load (kills,
# restarts and a two-minute soak: minutes of waiting for timers) run beside the rest; their
# output follows the rest's. Fails if any part failed. Arguments go to every pytest run.
set -uo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
beside=(tests/model "tests/chaos tests/load")
logs=()
pids=()
for part in "${beside[@]}"; do
    log=$(mktemp -t cortex-tests.XXXXXX)
    # shellcheck disable=SC2086  # a part is one or more directories
    CORTEX_TEST_LLAMA_THREADS=1 "$python" -m pytest $part -p no:cacheprovider "$@" >"$log" 2>&1 &
    pids+=($!)
    logs+=("$log")
done
trap 'kill -INT "${pids[@]}" 2>/dev/null; wait "${pids[@]}"; rm -f "${logs[@]}"; exit 130' INT TERM
ignored=()
for part in "${beside[@]}"; do
    for dir in $part; do ignored+=("--ignore=$dir"); done
done
"$python" -m pytest "${ignored[@]}" "$@"
failed=$?
for i in "${!beside[@]}"; do
    wait "${pids[$i]}" || failed=1
    echo
    echo "==================== ${beside[$i]} (run beside the rest) ===================="
    cat "${logs[$i]}"
    rm -f "${logs[$i]}"
done
[ "$failed" -eq 0 ]
