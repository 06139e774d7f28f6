"""`type="relic"` actions: resolve the operation, then run a built-in or call an http relic."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cortex_worker.handles import get_registry, get_store
from cortex_worker.services.pool import service_pools
from cortex_worker.services.relics import builtin
from cortex_worker.services.relics.manager import RelicManager
from cortex_worker.services.relics.spec import resolve

if TYPE_CHECKING:
    from cortex_worker.actions.call import Call

DOCUMENTS_NAMESPACE = "documents"


def namespace_of(spec: Any) -> str:
    """Whose data a built-in relic works on: the job's agent, or "documents"."""
    return str(spec.get("agent") or DOCUMENTS_NAMESPACE)


def run_relic_action(call: Call) -> Any:
    """Run one relic operation; ToolError (naming what exists) for unknown names, bad
    parameters, a relic that cannot start or an operation that fails."""
    resolved = resolve(get_registry().relics, call.spec["name"], call.params)
    relic = resolved.relic
    root = call.settings.workspace_root / "relics"
    if relic.runtime == "builtin":
        namespace = namespace_of(call.spec)
        if relic.name == "kv":
            return builtin.run_kv(get_store().redis, namespace, resolved.operation,
                                  resolved.params)
        return builtin.run_sql(builtin.sql_path(root / "sql", namespace), resolved.operation,
                               resolved.params, call.timeout)
    manager = service_pools().get(RelicManager, root)
    return manager.call(relic, resolved.operation, resolved.params, call.timeout)
