"""What the model reads: the system prompt, and the blocks the runtime adds to each turn.

* `build_system_prompt(agent, registry)`: the protocol rules, a short example, the agent's own
  instructions, then what it may use (tools with their parameter schemas, agents, relics,
  workflows, context feeds, internal actions). Deterministic: the same agent and registry
  always give the same text.
* `format_results` / `format_feeds` / `format_errors` / `PROTOCOL_REMINDER`: the feedback of a
  turn (`<result>` and `<context_feed>` blocks, protocol errors, the reminder).
* `tool_functions(agent, registry, client_tools)`: the agent's tools as OpenAI function
  definitions, for models with `native_tools`.

A job's client tools (`JobOptions.client_tools`, e.g. AG-UI frontend tools) are listed with
the agent's own tools, in the prompt and as functions: the model calls both the same way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cortex_worker.actions.table import ACTION_TYPES
from cortex_worker.actions.types.base import ClientTool
from cortex_worker.llm.config import function_name

if TYPE_CHECKING:
    from cortex_worker.agents.spec import AgentSpec
    from cortex_worker.manifests.loader import Registry
    from cortex_worker.tools.spec import ToolSpec

__all__ = [
    "EXAMPLE",
    "PROTOCOL_REMINDER",
    "PROTOCOL_RULES",
    "RESULT_STATUSES",
    "build_system_prompt",
    "format_errors",
    "format_feeds",
    "format_results",
    "tool_functions",
]

RESULT_STATUSES = ("ok", "error", "timeout", "skipped", "cancelled")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

PROTOCOL_RULES = """\
# How you work: the Streaming Execution Protocol

Your output is read while you write it. Write these blocks (not XML: write JSON, Markdown, \
`<` and `&` as they are):
- `<thought>...</thought>`: your reasoning, shown to the user. Start actions inside it.
- `<action type="..." mode="..." id="...">{"name": "<target>", "parameters": {...}}</action>`: \
do something. The body is one JSON object (double quotes, no comments). Optional keys: \
"depends_on" (ids), "timeout" (seconds), "retry" (count), "on_error" ("fail" or "continue"), \
"output_key".
- `<response final="false">...</response>`: a progress update (Markdown); you keep working.
- `<response final="true">...</response>`: your final answer (Markdown); the job ends after \
this turn.

Action attributes:
- `type`: `tool` (the default), `agent`, `relic`, `workflow`, `llm` or `internal`. Use only \
the names listed below.
- `id`: unique in the job (letters, digits, `_`). Always give one: `$id` is its result.
- `mode`: `async` starts at once while you keep writing: use it early, inside your thought, \
for independent work; its result comes next turn. `sync` (the default): your output stops at \
its `</action>`; you go on next turn with its result. `fire_and_forget`: never awaited, its \
result never shown.
- `depends_on="a,b"`: ids that must finish first (not needed when the parameters reference them).

References: `$id` (or `${id}`) in parameters and responses is that action's result, \
`$id.field.0` reaches inside it. A parameter that is exactly `"$id"` keeps the value's JSON \
type. An action that references another waits for it. Context feeds are variables too. `$$` \
is a literal `$`.

Results come next turn as `<result id="..." status="ok|error|timeout|skipped|cancelled">...\
</result>` blocks: on `error` or `timeout`, adapt; `skipped`: what it depended on failed. \
Context comes as `<context_feed id="...">value</context_feed>` blocks. Never write either \
yourself, and never invent a result: wait for it.

Every turn must start an action or end with `<response final="true">`. Protocol errors come \
back to you: fix them and go on."""

EXAMPLE = """\
## Example

(tool names here are only an illustration)

<thought>
Two independent lookups first; they run while I think.
<action type="tool" mode="async" id="paris">{"name": "search", "parameters": {"query": "population of Paris"}}</action>
<action type="tool" mode="async" id="rome">{"name": "search", "parameters": {"query": "population of Rome"}}</action>
</thought>
<action type="tool" mode="sync" id="total">{"name": "calculator", "parameters": {"expression": "$paris.count + $rome.count"}}</action>

Next turn, with `<result id="total" status="ok">5020000</result>` in your context:

<response final="true">Paris and Rome have $total inhabitants together.</response>"""

PROTOCOL_REMINDER = """\
Your last turn neither started an action nor gave a final response. Every turn must do one \
of them: call an action, e.g. `<action type="tool" mode="sync" id="step1">{"name": "...", \
"parameters": {...}}</action>`, or finish with `<response final="true">your answer</response>`."""

_FIXES: dict[str, str] = {
    "invalid_json": (
        'write the body as one valid JSON object, {"name": "...", "parameters": {...}}, with '
        'double-quoted keys and strings and no comments; write "</action>" inside a string as '
        '"<\\/action>"'
    ),
    "unclosed_block": "close every block: </thought>, </action>, </response>",
    "duplicate_id": "give the action an id you have not used in this job",
    "unknown_dependency": (
        "depends_on may only list ids of actions of this job; write that action first or "
        "remove the entry"
    ),
    "cycle": "remove the circular dependency: no action may wait, even indirectly, for itself",
    "unknown_type": f"type must be one of: {', '.join(ACTION_TYPES)}",
    "unknown_mode": "mode must be one of: sync, async, fire_and_forget (with underscores)",
}


# ---------------------------------------------------------------- the system prompt


def build_system_prompt(agent: AgentSpec, registry: Registry,
                        client_tools: Sequence[ClientTool] = ()) -> str:
    """The agent's whole system prompt. It starts with the protocol and the example, the same
    text for every agent, so that providers' prompt caching shares that prefix; then who the
    agent is, its instructions, and what it may use (`client_tools`: the job's, in the tools'
    section). Deterministic."""
    intro = f"# You\n\nYou are {agent.name}, an agent running in Cortex."
    if agent.description.strip():
        intro += f" {agent.description.strip()}"
    parts = [PROTOCOL_RULES, EXAMPLE, intro]
    if agent.system_prompt.strip():
        parts.append(f"# Your instructions\n\n{agent.system_prompt.strip()}")
    parts += [section for row in ACTION_TYPES.values()
              if (section := row.client_prompt(agent, registry, client_tools)
                  if client_tools and row.client_prompt is not None
                  else row.prompt(agent, registry)) is not None]
    return "\n\n".join(parts) + "\n"


# ---------------------------------------------------------------- turn feedback


def format_results(results: list[dict[str, Any]], limit_chars: int = 4000) -> str:
    """`<result id status>` blocks, one per finished action; bodies over `limit_chars` cut.

    Each result has `id`, `status` (ok, error, timeout, skipped, cancelled) and `value` or
    `error` (`reason` is accepted for error). Strings are written as they are, anything else as
    JSON.
    """
    blocks = []
    for result in results:
        ident, status = str(result["id"]), str(result.get("status", "ok"))
        body = result_body(result, limit_chars).replace("</result>", "<\\/result>")
        blocks.append(f"<result id={_attr(ident)} status={_attr(status)}>{body}</result>")
    return "\n".join(blocks)


def result_body(result: Mapping[str, Any], limit_chars: int = 4000) -> str:
    """What the model reads of one finished action (a `<result>` block's body, or a native
    call's `tool` message): its value, or its error; cut past `limit_chars` with a hint."""
    ident = str(result["id"])
    status = str(result.get("status", "ok"))
    if status not in RESULT_STATUSES:
        raise ValueError(
            f"result {ident!r}: unknown status {status!r} "
            f"(expected one of: {', '.join(RESULT_STATUSES)})"
        )
    if "value" in result:
        payload = result["value"]
    else:
        payload = result.get("error", result.get("reason", ""))
    body = _text(payload)
    if len(body) > limit_chars:
        more = len(body) - limit_chars
        if status == "ok" and _NAME.match(ident):
            hint = f"pass ${ident} to an action to use the whole value"
        else:
            hint = "the rest is not shown"
        body = f"{body[:limit_chars]}\n[truncated: {more} more characters; {hint}]"
    return body


def format_feeds(feeds: Mapping[str, Any], max_chars: int | None = None) -> str:
    """`<context_feed id>` blocks, sorted by id; values over `max_chars` cut with a note."""
    blocks = []
    for ident in sorted(feeds):
        body = _text(feeds[ident])
        if max_chars is not None and len(body) > max_chars:
            more = len(body) - max_chars
            body = f"{body[:max_chars]}\n[truncated: {more} more characters]"
        body = body.replace("</context_feed>", "<\\/context_feed>")
        blocks.append(f"<context_feed id={_attr(str(ident))}>{body}</context_feed>")
    return "\n".join(blocks)


def format_errors(errors: list[dict[str, Any]]) -> str:
    """Feedback on a turn's protocol errors: where, what, and how to fix each one."""
    if not errors:
        return ""
    count = len(errors)
    lines = [
        "<feedback>",
        f"Your last output had {count} protocol error{'s' if count != 1 else ''}. The blocks "
        "they name were not run:",
    ]
    for error in errors:
        kind = str(error.get("kind", "protocol_error"))
        where = []
        if error.get("line") is not None:
            where.append(f"line {error['line']}")
        if error.get("column") is not None:
            where.append(f"column {error['column']}")
        place = ", ".join(where)
        action = f" (action {error['action_id']!r})" if error.get("action_id") else ""
        message = str(error.get("message", "")).strip()
        fix = _FIXES.get(kind, "rewrite the block following the protocol rules")
        head = f"- {place}: {kind}" if place else f"- {kind}"
        lines.append(f"{head}{action}: {message}. Fix: {fix}.")
    lines.append("Write the corrected actions again (with new ids where needed) and go on.")
    lines.append("</feedback>")
    return "\n".join(lines)


# ---------------------------------------------------------------- native function calling


def tool_functions(agent: AgentSpec, registry: Registry,
                   client_tools: Sequence[ClientTool] = ()) -> list[dict[str, Any]]:
    """The agent's tools in OpenAI function-calling format, in the agent's order, then the
    job's client tools."""
    return [*(_function(registry.tool(name)) for name in agent.tools),
            *(_function(tool) for tool in client_tools)]


def tool_names(agent: AgentSpec, client_tools: Sequence[ClientTool] = ()) -> dict[str, str]:
    """Native function name -> tool name, for the calls a model makes."""
    return {function_name(name): name
            for name in [*agent.tools, *(tool.name for tool in client_tools)]}


def _function(spec: ToolSpec | ClientTool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": function_name(spec.name), "parameters": spec.parameters}
    if spec.description:
        function["description"] = spec.description
    return {"type": "function", "function": function}


# ---------------------------------------------------------------- helpers


def _text(value: Any) -> str:
    """Strings as they are, anything else as JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def _attr(value: str) -> str:
    """An attribute value in double quotes (single quotes if it holds a double quote)."""
    if '"' not in value:
        return f'"{value}"'
    if "'" not in value:
        return f"'{value}'"
    return '"' + value.replace('"', "'") + '"'
