"""`type="internal"`: the model changes its own job's context feeds and variables
(protocol.md §6). A ready one runs in the turn that parsed it; handlers: `jobs.internal`."""

from __future__ import annotations

from cortex_worker.actions.types.base import ActionType, Agent, Problem, Tables, Target, on

PARAMETERS: dict[str, str] = {
    "add_context_feed": '{"id", "type": "on_demand"|"periodic", "interval", '
    '"source": {"type", "name", "params"}}',
    "remove_context_feed": '{"id"}',
    "update_context_feed": '{"id", fields to change}',
    "list_context_feeds": "{}",
    "set_variable": '{"name", "value"}: then $name',
    "delete_variable": '{"name"}',
    "clear_context": "{}: forget the conversation",
}
"""Every internal action, with its parameters as the prompt shows them."""
INTERNAL_ACTIONS = tuple(PARAMETERS)


def check(target: Target) -> list[Problem]:
    if target.name in INTERNAL_ACTIONS:
        return []
    return [("unknown_internal_action", target.word(target.wording.unknown_internal,
                                                    known=", ".join(INTERNAL_ACTIONS)))]


def grant(agent: Agent, name: str) -> str | None:
    if agent.internal_actions.permits(name):
        return None
    return f"internal action {name!r} is not allowed for agent {agent.name!r} (see its " \
           "manifest's internal_actions)"


def prompt(agent: Agent, registry: Tables) -> str:
    """The agent's feeds, then the internal actions that manage them (and variables)."""
    parts = []
    feeds = [feed for feed in agent.context_feeds if feed.enabled]
    if feeds:
        lines = ["# Context feeds", "", "Given as <context_feed> blocks; readable as $id:"]
        lines += [f"- {feed.id} ({feed.type})" for feed in feeds]
        parts.append("\n".join(lines))
    allowed = [name for name in INTERNAL_ACTIONS if agent.internal_actions.permits(name)]
    if not allowed:
        parts.append('# Internal actions (type="internal")\n\n'
                     'None: do not write type="internal" actions.')
    else:
        lines = ['# Internal actions (type="internal")', ""]
        lines += [f"- {name} {PARAMETERS[name]}" for name in allowed]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


TYPE = ActionType("internal", check, "cortex_worker.jobs.internal:run_internal_action",
                  on("agent"), grant=grant, prompt=prompt, feed_source=True, in_turn=True)
