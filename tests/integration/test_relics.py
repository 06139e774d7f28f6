"""Relics end to end: documents → API → the relic pool (threads) → Redis / SQLite / a user relic.

The user-defined relic is tests/manifests/echo_relic.py (`echo` in tests/manifests/relics.yaml);
every answer carries its pid, so reuse and restarts are visible in the action results.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest
import redis

TERMINAL = {"job_completed", "job_failed", "job_cancelled"}


@pytest.fixture
def api(workers: Any, api: Any) -> Any:  # every test here needs the pools running
    return api


def submit(api: Any, protocol: str) -> httpx.Response:
    return httpx.post(f"{api.url}/v1/jobs", json={"protocol": protocol}, timeout=30)


def follow(api: Any, job_id: str, timeout: float = 90) -> list[dict[str, Any]]:
    """The job's events, read from its SSE stream until it closes."""
    events: list[dict[str, Any]] = []
    with httpx.stream("GET", f"{api.url}/v1/jobs/{job_id}/events", timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        data: list[str] = []
        for line in response.iter_lines():
            if line.startswith("data:"):
                data.append(line[5:].strip())
            elif line == "" and data:
                events.append(json.loads("\n".join(data)))
                data = []
    return events


def run(api: Any, protocol: str) -> list[dict[str, Any]]:
    response = submit(api, protocol)
    assert response.status_code == 202, response.text
    events = follow(api, response.json()["id"])
    assert events[-1]["type"] in TERMINAL
    return events


def one(events: list[dict[str, Any]], kind: str, action: str | None = None) -> dict[str, Any]:
    found = [e for e in events if e["type"] == kind
             and (action is None or e["data"].get("action_id") == action)]
    assert len(found) == 1, (kind, action, [(e["type"], e["data"]) for e in events])
    return found[0]["data"]


def relic(ident: str, name: str, params: dict[str, Any], mode: str = "async",
          **extra: Any) -> str:
    body = {"name": name, "parameters": params, **extra}
    return f'<action type="relic" mode="{mode}" id="{ident}">{json.dumps(body)}</action>\n'


def tool(ident: str, name: str, params: dict[str, Any]) -> str:
    body = {"name": name, "parameters": params}
    return f'<action type="tool" id="{ident}">{json.dumps(body)}</action>\n'


def echo_pid(api: Any, message: str) -> int:
    events = run(api, relic("e", "echo.echo", {"message": message}))
    result = one(events, "action_completed", "e")["result"]
    assert result["echo"] == {"message": message}
    return int(result["pid"])


# ---------------------------------------------------------------- built-ins


def test_kv_set_get_list_delete_with_references(api: Any, redis_client: redis.Redis) -> None:
    prefix = f"greeting-{uuid.uuid4().hex[:8]}:"
    key = prefix + "en"
    doc = (relic("put", "kv.set", {"key": key, "value": {"text": "hello", "n": 2}}, mode="sync")
           + relic("put2", "kv", {"operation": "set", "key": prefix + "fr", "value": "bonjour"},
                   mode="sync")
           + relic("get", "kv", {"operation": "get", "key": "$put.key"})
           + relic("ls", "kv.list", {"prefix": prefix}, depends_on=["get", "put2"])
           + relic("del", "kv.delete", {"key": "${get.key}"}, depends_on=["ls"])
           + relic("again", "kv.get", {"key": "$put.key"}, depends_on=["del"])
           + '<response>The greeting is "${get.value.text}" (${get.value.n}).</response>')
    events = run(api, doc)
    assert events[-1]["type"] == "job_completed", events[-1]
    assert one(events, "action_completed", "put")["result"] == {"key": key, "stored": True,
                                                                "ttl": None}
    assert one(events, "action_completed", "get")["result"] == {
        "key": key, "found": True, "value": {"text": "hello", "n": 2}}
    assert one(events, "action_completed", "ls")["result"] == {
        "keys": [prefix + "en", prefix + "fr"], "truncated": False}
    assert one(events, "action_completed", "del")["result"] == {"key": key, "deleted": True}
    assert one(events, "action_completed", "again")["result"]["found"] is False
    assert one(events, "response_end")["text"] == 'The greeting is "hello" (2).'
    # documents share the "documents" namespace; the value is stored as JSON
    assert redis_client.get(f"cx:relic:kv:documents:{prefix}fr") == '"bonjour"'
    assert redis_client.get(f"cx:relic:kv:documents:{key}") is None


def test_sql_execute_then_query(api: Any) -> None:
    table = f"notes_{uuid.uuid4().hex[:8]}"
    doc = (relic("create", "sql.execute",
                 {"sql": f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, body TEXT, tags TEXT)"},
                 mode="sync")
           + tool("said", "echo", {"message": "it's; DROP TABLE x; --"})
           + relic("add", "sql", {"operation": "execute",
                                  "sql": f"INSERT INTO {table} (body, tags) VALUES (?, ?)",
                                  "params": ["$said", ["a", "b"]]}, mode="sync")
           + relic("add2", "sql.execute", {"sql": f"INSERT INTO {table} (body) VALUES (:body)",
                                           "params": {"body": "second"}}, mode="sync")
           + relic("rows", "sql.query", {"sql": f"SELECT id, body, tags FROM {table} "
                                                "WHERE id <= ? ORDER BY id", "params": [10]})
           + relic("write", "sql.query", {"sql": f"DELETE FROM {table}"}, depends_on=["rows"]))
    events = run(api, doc)
    assert one(events, "action_completed", "add")["result"] == {"rowcount": 1, "lastrowid": 1}
    assert one(events, "action_completed", "rows")["result"] == [
        {"id": 1, "body": "it's; DROP TABLE x; --", "tags": '["a", "b"]'},
        {"id": 2, "body": "second", "tags": None}]
    error = one(events, "action_failed", "write")["error"]
    assert error.startswith("sql query is read-only: the statement tries DELETE")
    assert events[-1]["type"] == "job_failed"


# ---------------------------------------------------------------- a user-defined relic


def test_user_relic_is_reused_across_jobs_and_restarted_after_a_crash(
        api: Any, workers: Any) -> None:
    first = echo_pid(api, "one")
    second = echo_pid(api, "two")
    assert first == second  # the same process served both jobs

    events = run(api, relic("boom", "echo", {"operation": "crash"}))
    assert one(events, "action_completed", "boom")["result"] == {"pid": first, "crashing": True}

    third = echo_pid(api, "three")
    assert third != first  # restarted on next use
    assert echo_pid(api, "four") == third
    assert workers["relic"].alive


def test_user_relic_operations_map_to_http(api: Any) -> None:
    doc = (relic("item", "echo.item", {"id": "a b/c", "verbose": True})
           + relic("fail", "echo.fail", {"message": "boom"}))
    events = run(api, doc)
    item = one(events, "action_completed", "item")["result"]
    assert item["id"] == "a b/c" and item["query"] == {"verbose": "true"}
    assert one(events, "action_failed", "fail")["error"] == (
        "relic 'echo' operation 'fail' failed: HTTP 400: asked to fail: boom")


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(("doc", "kind", "message"), [
    (relic("x", "kv.sett", {"key": "a"}), "unknown_operation",
     "action 'x': relic 'kv' has no operation 'sett'; its operations: delete, get, list, set"),
    (relic("x", "echo", {"operation": "nope"}), "unknown_operation",
     "action 'x': relic 'echo' has no operation 'nope'; its operations: crash, echo, fail, item, "
     "remove, sick, slow"),
    (relic("x", "echo", {"message": "no operation"}), "unknown_operation",
     "action 'x': relic 'echo': say which operation to run"),
    (relic("x", "cache.get", {"key": "a"}), "unknown_relic",
     "action 'x': unknown relic 'cache'; known relics: broken, echo, kv, log_service, missing, postgres_monitor, results_cache, sql"),
    (relic("x", "kv.set", {"key": "a"}), "invalid_parameters",
     "action 'x': relic 'kv' operation 'set': parameters: 'value' is a required property"),
    (relic("x", "echo.item", {"id": 5}), "invalid_parameters",
     "action 'x': relic 'echo' operation 'item': parameter 'id': 5 is not of type 'string'"),
])
def test_bad_relic_actions_get_422(api: Any, doc: str, kind: str, message: str) -> None:
    response = submit(api, doc)
    assert response.status_code == 422, response.text
    errors = response.json()["detail"]["errors"]
    assert [e["kind"] for e in errors] == [kind]
    assert errors[0]["message"].startswith(message), errors[0]["message"]


def test_bad_input_at_run_time_fails_the_action_not_the_worker(api: Any, workers: Any) -> None:
    doc = (tool("op", "echo", {"message": "nope"})
           + relic("unknown_op", "kv", {"operation": "$op", "key": "a"})
           + relic("bad_param", "kv.set", {"key": "a", "value": 1, "ttl": "$op"})
           + relic("broken", "broken.ping", {})
           + relic("missing", "missing.ping", {})
           + relic("fine", "echo.echo", {"message": "still here"},
                   depends_on=["unknown_op", "bad_param", "broken", "missing"],
                   on_error="continue"))
    events = run(api, doc)
    assert one(events, "action_failed", "unknown_op")["error"] == (
        "relic 'kv' has no operation 'nope'; its operations: delete, get, list, set")
    assert one(events, "action_failed", "bad_param")["error"] == (
        "relic 'kv' operation 'set': parameter 'ttl': 'nope' is not of type 'number'")
    broken = one(events, "action_failed", "broken")["error"]
    assert broken.startswith("relic 'broken' exited with code 3 while starting")
    assert "broken relic: no configuration found" in broken
    assert one(events, "action_failed", "missing")["error"].startswith(
        "relic 'missing' cannot start: command not found: '/nonexistent/relic-server'")
    assert one(events, "action_completed", "fine")["result"]["echo"] == {"message": "still here"}
    assert events[-1]["type"] == "job_failed"
    assert workers["relic"].alive
    echo_pid(api, "after the failures")  # the pool still serves relics


def test_registry_lists_relics(api: Any) -> None:
    items = httpx.get(f"{api.url}/v1/relics", timeout=10).json()["items"]
    assert {"kv", "sql", "echo"} <= {item["name"] for item in items}
    echo = httpx.get(f"{api.url}/v1/relics/echo", timeout=10).json()
    assert echo["runtime"] == "http" and echo["operations"]["item"]["path"] == "/items/{id}"
