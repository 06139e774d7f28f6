#!/usr/bin/env bash
# `make check`: the fast lane. ruff, then the in-process tests: tests/unit, and tests/engine
# (the engine on the StubBroker with a private redis-server). No test here starts a Cortex
# process or waits on a timer: those are in tests/process, tests/integration and the other
# lanes of `make test`. The tests are CPU-bound, so they run in two pytest processes at once,
# one per core: tests/unit's files dealt alternately to each, tests/engine with the second.
# The second's output follows the first's. Fails if any part failed. Arguments go to both.
set -uo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
.venv/bin/ruff check . || exit 1
first=()
second=()
dealt=0
for file in tests/unit/test_*.py; do
    if (( dealt++ % 2 == 0 )); then first+=("$file"); else second+=("$file"); fi
done
log=$(mktemp -t cortex-check.XXXXXX)
"$python" -m pytest "${second[@]}" tests/engine -p no:cacheprovider "$@" >"$log" 2>&1 &
pid=$!
trap 'kill -INT "$pid" 2>/dev/null; wait "$pid"; rm -f "$log"; exit 130' INT TERM
"$python" -m pytest "${first[@]}" -p no:cacheprovider "$@"
failed=$?
wait "$pid" || failed=1
echo
echo "==================== the other half of tests/unit, and tests/engine ===================="
cat "$log"
rm -f "$log"
[ "$failed" -eq 0 ]
