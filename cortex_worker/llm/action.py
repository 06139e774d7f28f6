"""`type="llm"` actions: one completion whose prompt is the task and its parameters."""

from __future__ import annotations

import json
import time
from typing import Any

from cortex_worker.actions.call import Call
from cortex_worker.handles import get_store
from cortex_worker.jobs import lifecycle, usage
from cortex_worker.jobs.record import JobRecord
from cortex_worker.llm import limits
from cortex_worker.llm.config import ModelConfig
from cortex_worker.llm.gateway import complete
from cortex_worker.protocol.events import EventType
from cortex_worker.store.state import dumps
from cortex_worker.tools.errors import ToolError


def run_llm_action(call: Call) -> Any:
    """The model's answer, as JSON when it parses, else as text."""
    if not call.spec.get("model"):
        raise ToolError("llm actions run with an agent's model; this job has none")
    model = ModelConfig.from_wire(call.spec["model"])
    params = call.params
    prompt = params["prompt"] if isinstance(params, dict) and set(params) == {"prompt"} \
        else dumps(params)
    store = get_store()

    def waiting(endpoint: str, reason: str, wait_s: float | None) -> None:
        store.emit(call.job_id, [(EventType.model_waiting, {
            "endpoint": endpoint, "reason": reason, "action_id": call.action_id,
            "wait_s": None if wait_s is None else round(wait_s, 3)})], live=True)

    def spent(endpoint: str, prompt_tokens: int, completion_tokens: int) -> None:
        usage.record(store, call.job_id, tenant, endpoint, prompt_tokens, completion_tokens)

    tenant = (store.peek(call.job_id, "tenant") or JobRecord(id=call.job_id)).tenant
    caller = limits.Caller(store, call.job_id, tenant, on_wait=waiting,
                           deadline=time.time() + call.timeout,
                           before=lambda: usage.check_running(store, tenant), on_usage=spent)
    try:
        with limits.calling(caller):
            text, _ = complete(model, [
                {"role": "system", "content": f"You perform one task: {call.spec['name']}. "
                                              "Answer with its result only, without preamble."},
                {"role": "user", "content": prompt}], base_dir=call.settings.manifests)
    except usage.QuotaExceeded as exc:  # the job ends with it: its other actions are cancelled
        lifecycle.cancel_job(store, call.job_id, status="failed", reason=str(exc))
        raise
    try:
        return json.loads(text)
    except ValueError:
        return text
