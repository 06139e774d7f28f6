#!/usr/bin/env bash
# `make test`: the whole suite, in two pytest processes at once. tests/model (a real model on
# llama.cpp's server: about four minutes of one core) runs beside the rest, whose processes
# mostly wait on each other; its output follows the rest's. Fails if either part failed.
# Arguments go to both pytest runs.
set -uo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
log=$(mktemp -t cortex-model-tests.XXXXXX)
CORTEX_TEST_LLAMA_THREADS=1 "$python" -m pytest tests/model -p no:cacheprovider "$@" >"$log" 2>&1 &
model=$!
trap 'kill -INT "$model" 2>/dev/null; wait "$model"; rm -f "$log"; exit 130' INT TERM
"$python" -m pytest --ignore=tests/model "$@"
rest=$?
wait "$model"
models=$?
echo
echo "==================== tests/model (run beside the rest) ===================="
cat "$log"
rm -f "$log"
[ "$rest" -eq 0 ] && [ "$models" -eq 0 ]
