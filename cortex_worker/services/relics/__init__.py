"""Relics: long-lived services with named operations (`kind: Relic`, `type="relic"` actions).

- `spec`: the manifest model, the built-in relics' declarations, naming an operation;
- `builtin`: `kv` (Redis) and `sql` (SQLite);
- `manager`: the lifecycle of user-defined http relics (start, health, restart, idle stop);
- `runner`: `run_relic_action`, the runner of `type="relic"` actions.

Importing this package has no side effects (the manifest loader imports `spec`); importing
`runner` (as `cortex_worker.actions.targets` does, so every worker) installs the shutdown hooks that
stop running relics with the worker.
"""
