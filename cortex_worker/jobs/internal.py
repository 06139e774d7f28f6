"""Internal actions (protocol.md §6): the model changes its own job's feeds and variables.

They run in the coordinator when ready as it parses them (else on the agent pool when their
dependencies finish), through the same claim/record path as every action. Whether a model
may call one is the agent manifest's `internal_actions` policy, checked before it runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from cortex_worker.actions import dispatch
from cortex_worker.actions.call import Call
from cortex_worker.actions.types.internal import INTERNAL_ACTIONS
from cortex_worker.handles import get_store
from cortex_worker.jobs import feeds
from cortex_worker.store.state import Store
from cortex_worker.tools.errors import ToolError

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _name(params: dict[str, Any], key: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not _NAME.match(value):
        raise ToolError(f"parameter {key!r} must be a variable name like my_value, got {value!r}")
    return value


def set_variable(store: Store, call: Call, params: dict[str, Any]) -> Any:
    name = _name(params, "name")
    if "value" not in params:
        raise ToolError("set_variable needs 'value'")
    store.set_variables(call.job_id, {name: params["value"]})
    return {"name": name, "value": params["value"]}


def delete_variable(store: Store, call: Call, params: dict[str, Any]) -> Any:
    name = _name(params, "name")
    return {"name": name, "deleted": store.delete_variable(call.job_id, name)}


def add_context_feed(store: Store, call: Call, params: dict[str, Any]) -> Any:
    agent = call.spec.get("agent")
    feed = _allowed(agent, _feed(params))
    if feed.id in feeds.job_feeds(store, call.job_id, agent):
        raise ToolError(f"context feed {feed.id!r} exists already; use update_context_feed")
    generation = feeds.save_feed(store, call.job_id, feed, feed.id)
    value = feeds.compute(store, call.job_id, agent, feed) if feed.enabled else None
    store.set_variables(call.job_id, {feed.id: value})
    dispatch.refresh_feeds(call.job_id, {feed.id: feed}, {feed.id: generation})
    return {"feed": feed.model_dump(mode="json", exclude_none=True), "value": value}


def update_context_feed(store: Store, call: Call, params: dict[str, Any]) -> Any:
    agent = call.spec.get("agent")
    feed_id = params.get("id")
    current = feeds.job_feeds(store, call.job_id, agent).get(str(feed_id))
    if current is None:
        raise ToolError(f"no context feed {feed_id!r}; add it with add_context_feed")
    feed = _feed({**current.model_dump(mode="json"), **params})
    if feed.source != current.source:
        _allowed(agent, feed)
    generation = feeds.save_feed(store, call.job_id, feed, feed.id)
    dispatch.refresh_feeds(call.job_id, {feed.id: feed}, {feed.id: generation})
    return {"feed": feed.model_dump(mode="json", exclude_none=True)}


def remove_context_feed(store: Store, call: Call, params: dict[str, Any]) -> Any:
    feed_id = str(params.get("id"))
    if feed_id not in feeds.job_feeds(store, call.job_id, call.spec.get("agent")):
        raise ToolError(f"no context feed {feed_id!r} to remove")
    feeds.save_feed(store, call.job_id, None, feed_id)
    return {"removed": feed_id}


def list_context_feeds(store: Store, call: Call, params: dict[str, Any]) -> Any:
    listed = feeds.job_feeds(store, call.job_id, call.spec.get("agent"))
    return [f.model_dump(mode="json", exclude_none=True) for f in listed.values()]


def clear_context(store: Store, call: Call, params: dict[str, Any]) -> Any:
    """Forget the conversation so far; the next turn starts from the system prompt."""
    return {"cleared_messages": store.clear_conversation(call.job_id)}


def _allowed(agent: str | None, feed: feeds.FeedSpec) -> feeds.FeedSpec:
    refused = feeds.refusal(agent, feed)
    if refused:
        raise ToolError(f"context feed {feed.id!r}: {refused}")
    return feed


def _feed(params: dict[str, Any]) -> feeds.FeedSpec:
    try:
        return feeds.parse_feed(params)
    except feeds.FeedError as exc:
        raise ToolError(str(exc)) from None


HANDLERS: dict[str, Callable[[Store, Call, dict[str, Any]], Any]] = {
    "set_variable": set_variable,
    "delete_variable": delete_variable,
    "add_context_feed": add_context_feed,
    "update_context_feed": update_context_feed,
    "remove_context_feed": remove_context_feed,
    "list_context_feeds": list_context_feeds,
    "clear_context": clear_context,
}
assert set(HANDLERS) == set(INTERNAL_ACTIONS)


def run_internal_action(call: Call) -> Any:
    """Run one internal action against the job's own state."""
    handler = HANDLERS.get(call.spec["name"])
    if handler is None:
        raise ToolError(f"unknown internal action {call.spec['name']!r} "
                        f"(one of: {', '.join(INTERNAL_ACTIONS)})")
    params = call.params if isinstance(call.params, dict) else {}
    return handler(get_store(), call, params)
