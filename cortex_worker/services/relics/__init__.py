"""Relics: long-lived services with named operations (`kind: Relic`, `type="relic"` actions).

- `spec`: the manifest model, the built-in relics' declarations, naming an operation;
- `builtin`: `kv` (Redis) and `sql` (SQLite);
- `manager`: user-defined http relics, a service pool (`services.pool`: start, health,
  restart, idle stop);
- `action`: `run_relic_action`, the runner of `type="relic"` actions.

Importing this package has no side effects (the manifest loader imports `spec`). The pools'
services are stopped at worker shutdown by the `services` step (`cortex_worker.worker.steps`).
"""
