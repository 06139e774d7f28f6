"""`type="llm"` actions: one completion whose prompt is the task and its parameters."""

from __future__ import annotations

import json
from typing import Any

from cortex_worker.actions.call import Call
from cortex_worker.llm.config import ModelConfig
from cortex_worker.llm.gateway import complete
from cortex_worker.store.state import dumps
from cortex_worker.tools.errors import ToolError


def run_llm_action(call: Call) -> Any:
    """The model's answer, as JSON when it parses, else as text."""
    if not call.spec.get("model"):
        raise ToolError("llm actions run with an agent's model; this job has none")
    model = ModelConfig.model_validate(call.spec["model"])
    params = call.params
    prompt = params["prompt"] if isinstance(params, dict) and set(params) == {"prompt"} \
        else dumps(params)
    text, _ = complete(model, [
        {"role": "system", "content": f"You perform one task: {call.spec['name']}. "
                                      "Answer with its result only, without preamble."},
        {"role": "user", "content": prompt}], base_dir=call.settings.manifests)
    try:
        return json.loads(text)
    except ValueError:
        return text
