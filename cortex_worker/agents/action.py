"""`type="agent"` actions: ask for the child agent job; it completes the action when it ends."""

from __future__ import annotations

from typing import Any

from cortex_worker.actions.call import Call, ChildJob, Deferred
from cortex_worker.store.state import dumps


def run_agent_action(call: Call) -> Any:
    params = call.params
    text = params["input"] if isinstance(params, dict) and isinstance(params.get("input"), str) \
        else dumps(params)
    raise Deferred(ChildJob("agent", call.spec["name"], text))
