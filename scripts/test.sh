#!/usr/bin/env bash
# `make test`: the whole suite, in seven pytest processes at once, whose tests mostly wait: on
# their own subprocesses, on recovery timers, on a model. Beside the integration and process
# tests run tests/model in two parts, each with its own llama.cpp server of one thread (the
# streamed completions and agent jobs 1 to 18 with the grammar; jobs 19 to 22, the grammars and
# the tool_choice jobs: each about two and a half minutes of one core once the model runtime is
# built), so that the model's work, which nothing else can speed up, uses both cores once the
# other parts are done; tests/chaos with tests/load
# (kills, restarts and a two-minute soak: minutes of waiting for timers), the in-process tests
# with the security tests and the two integration files that start whole stacks (cortex up,
# cortex demo), the Redis failover files (sentinels, a lagging replica) with the remote A2A
# agent's, and the protocol adapters' (AG-UI with npm's client, MCP, A2A), which evens the
# parts out. Their output follows that of the integration and process tests; then the last line
# of each (pytest's counts and time). Fails if any part failed. Arguments go to every pytest run.
set -uo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
# every request of tests/model carries a seed (model.seed), so a test samples the same on either
# server, after whatever ran there before
streams=tests/model/test_smollm2.py::test_real_token_streams_feed_the_parser
agent_jobs=tests/model/test_smollm2.py::test_agent_jobs_with_the_grammar_make_no_protocol_errors[1-18]
beside=("$streams $agent_jobs" "tests/model --deselect $streams --deselect $agent_jobs"
        "tests/chaos tests/load"
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
