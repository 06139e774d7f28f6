"""Actions that wait for a person: which ones, and holding them until someone answers.

An action whose target requires approval (a tool's `require_approval`, or its agent's
`approval.require`) is not sent when it becomes ready. `hold` records a request instead: the
action's status becomes `awaiting_approval` (it holds no worker slot, and blocks only what its
mode and dependencies would block anyway) and `approval_requested` shows its parameters after
substitution. `jobs.decide_approval` records the answer once: approved, the action is queued
and sent; rejected (by a person, or by the reconciler when the request expires), it fails
with the reason, which the model reads as the action's error.

A call to one of the job's client tools (`JobOptions.client_tools`, e.g. an AG-UI frontend
tool) is held the same way, its request marked `client`: the client runs it, and
`jobs.answer_client_call` records its answer as the action's result. It is never sent to a
pool, and the request's expiry rejects it like any other when the client never answers.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from cortex_worker.actions.table import ACTION_TYPES
from cortex_worker.manifests.loader import Registry
from cortex_worker.protocol.variables import find_references, substitute
from cortex_worker.settings import Settings
from cortex_worker.store.state import Store

AWAITING = "awaiting_approval"


def required(spec: Mapping[str, Any], registry: Registry) -> bool:
    """Whether this action waits for a person before it runs."""
    if ACTION_TYPES[spec["type"]].approval(registry, spec["name"]):
        return True
    agent = registry.agents.get(spec.get("agent") or "")
    return agent is not None and agent.approval.requires(spec["name"])


def waits_for_person(spec: Mapping[str, Any], registry: Registry) -> bool:
    """Whether `hold` may keep this action back: it needs an approval, or its target may be
    one of the job's client tools (read from the job only when `hold` runs)."""
    return (ACTION_TYPES[spec["type"]].client_target(registry, spec["name"])
            or required(spec, registry))


def timeout_s(spec: Mapping[str, Any], registry: Registry, settings: Settings) -> float:
    """How long a request may go unanswered before it is rejected."""
    agent = registry.agents.get(spec.get("agent") or "")
    own = agent.approval.timeout_s if agent is not None else None
    return own if own is not None else settings.approval_timeout_s


def hold(store: Store, job_id: str, specs: Iterable[Mapping[str, Any]], registry: Registry,
         settings: Settings) -> list[Mapping[str, Any]]:
    """The actions to send now: those needing no approval, and approved ones. Each other one
    is held: a request is made for it (once), or it already waits, or it was rejected."""
    send: list[Mapping[str, Any]] = []
    client: set[str] | None = None  # the job's client tools, read at the first unknown tool
    for spec in specs:
        if ACTION_TYPES[spec["type"]].client_target(registry, spec["name"]):
            if client is None:
                client = set(client_tools(store, job_id))
            if spec["name"] in client:
                _request(store, job_id, spec, registry, settings, client=True)
                continue  # never sent: the client answers it
        if not required(spec, registry) \
                or _request(store, job_id, spec, registry, settings, client=False) == "approved":
            send.append(spec)
    return send


def client_tools(store: Store, job_id: str) -> list[str]:
    """The names of the job's client tools (`JobOptions.client_tools`)."""
    job = store.peek(job_id, "options")
    return job.options.client_tool_names() if job is not None else []


def _request(store: Store, job_id: str, spec: Mapping[str, Any], registry: Registry,
             settings: Settings, *, client: bool) -> str:
    """Request an answer for the action (once); returns its state (`Store.request_approval`)."""
    parameters = _shown(store, job_id, spec.get("parameters", {}))
    wait = timeout_s(spec, registry, settings)
    now = time.time()
    record: dict[str, Any] = {"state": "requested", "requested_at": now, "timeout_s": wait,
                              "expires_at": now + wait}
    event: dict[str, Any] = {"action_id": spec["id"], "type": spec["type"],
                             "name": spec["name"], "parameters": parameters, "timeout_s": wait,
                             "expires_at": now + wait}
    if client:
        record["client"] = event["client"] = True
    return store.request_approval(job_id, spec["id"], record, event)


def _shown(store: Store, job_id: str, parameters: Any) -> Any:
    """The parameters as the action will get them (its dependencies have ended)."""
    names = find_references(parameters)
    if not names:
        return parameters
    return substitute(parameters, store.variables(job_id, names))[0]
