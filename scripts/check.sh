#!/usr/bin/env bash
# `make check`: the fast lane. ruff, then the in-process tests in two pytest processes at once
# (one per core): tests/unit, and tests/engine (the engine on the StubBroker with a private
# redis-server). No test here starts a Cortex process or waits on a timer: those are in
# tests/process, tests/integration and the other lanes of `make test`. tests/engine's output
# follows tests/unit's. Fails if any part failed. Arguments go to both pytest runs.
set -uo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
.venv/bin/ruff check . || exit 1
log=$(mktemp -t cortex-check.XXXXXX)
"$python" -m pytest tests/engine -p no:cacheprovider "$@" >"$log" 2>&1 &
engine=$!
trap 'kill -INT "$engine" 2>/dev/null; wait "$engine"; rm -f "$log"; exit 130' INT TERM
"$python" -m pytest tests/unit -p no:cacheprovider "$@"
failed=$?
wait "$engine" || failed=1
echo
echo "==================== tests/engine (run beside tests/unit) ===================="
cat "$log"
rm -f "$log"
[ "$failed" -eq 0 ]
