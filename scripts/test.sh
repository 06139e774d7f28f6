#!/usr/bin/env bash
# `make test`: the whole suite, in six pytest processes at once, whose tests mostly wait: on
# their own subprocesses, on recovery timers, on a model. Beside the integration and process
# tests run tests/model (a real model on llama.cpp's server: about five minutes of one core),
# tests/chaos with tests/load (kills, restarts and a two-minute soak: minutes of waiting for
# timers), the in-process tests with the security tests and the two integration files that
# start whole stacks (cortex up, cortex demo), the Redis failover files (sentinels, a lagging
# replica) with the remote A2A agent's, and the protocol adapters' (AG-UI with npm's client,
# MCP, A2A), which evens the parts out. Their output follows that of the integration and process
# tests; then the last line of each (pytest's counts and time). Fails if any part failed.
# Arguments go to every pytest run.
set -uo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
beside=(tests/model "tests/chaos tests/load"
        "tests/unit tests/engine tests/security tests/integration/test_up.py tests/integration/test_demo.py"
        "tests/integration/test_sentinel.py tests/integration/test_failover.py tests/integration/test_replication.py tests/integration/test_a2a_client.py"
        "tests/integration/test_agui_run.py tests/integration/test_mcp_server.py tests/integration/test_a2a.py")
main=$(mktemp -t cortex-tests.XXXXXX)
logs=()
pids=()
for part in "${beside[@]}"; do
    log=$(mktemp -t cortex-tests.XXXXXX)
    # shellcheck disable=SC2086  # a part is one or more directories or files (and options)
    CORTEX_TEST_LLAMA_THREADS=1 "$python" -m pytest $part -p no:cacheprovider "$@" >"$log" 2>&1 &
    pids+=($!)
    logs+=("$log")
done
trap 'kill -INT "${pids[@]}" 2>/dev/null; wait "${pids[@]}"; rm -f "$main" "${logs[@]}"; exit 130' INT TERM
ignored=()
for part in "${beside[@]}"; do
    for dir in $part; do
        case $dir in -*|*::*) ;; *) ignored+=("--ignore=$dir") ;; esac
    done
done
"$python" -m pytest "${ignored[@]}" "$@" | tee "$main"
failed=$?
ends=("$(tail -n 1 "$main")")
rm -f "$main"
for i in "${!beside[@]}"; do
    wait "${pids[$i]}" || failed=1
    echo
    echo "==================== ${beside[$i]} (run beside the rest) ===================="
    cat "${logs[$i]}"
    ends+=("$(tail -n 1 "${logs[$i]}")")
    rm -f "${logs[$i]}"
done
echo
echo "==================== each part's outcome and wall time ===================="
echo "the rest: ${ends[0]}"
for i in "${!beside[@]}"; do echo "${beside[$i]}: ${ends[$((i + 1))]}"; done
[ "$failed" -eq 0 ]
