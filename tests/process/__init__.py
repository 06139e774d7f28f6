"""The process lane: tests of one module that start real processes or wait on real timers.

Sandboxes, warm runners and their zygotes, namespaces, MCP servers, relics and the tools that
run in them are processes, and how they start, time out and stop is what these tests check.
They need no Redis, worker or API, but they cost seconds of forks and waits, so they stay out
of `make check` (tests/unit and tests/engine, in-process) and run in `make test`. Each module
is marked `process`.
"""
