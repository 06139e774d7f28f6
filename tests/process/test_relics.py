"""Relics (cortex_worker.services.relics): manifests, naming operations, the built-ins, the lifecycle.

The lifecycle tests run the real user-defined relic of the test manifests
(tests/manifests/echo_relic.py, an http.server) and the kv tests a real redis-server
(tests.harness.RedisServer): both are started and stopped here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from cortex_api.app import create_app
from cortex_api.routes.registry import registry_dep
from cortex_worker.manifests.loader import BUILTIN_SOURCE, Registry, load_registry
from cortex_worker.protocol.document import load_document
from cortex_worker.services.relics import builtin
from cortex_worker.services.relics.action import namespace_of
from cortex_worker.services.relics.manager import RelicManager
from cortex_worker.services.relics.spec import (
    BUILTIN_RELICS,
    RelicCallError,
    RelicSpec,
    check_relic_action,
    resolve,
)
from cortex_worker.settings import Settings
from cortex_worker.tools.errors import ToolError, ToolTimeout
from tests import harness
from tests.manifest_helpers import (
    EXAMPLE_MANIFESTS,
    TEST_MANIFESTS,
    TEST_RELICS,
    load_error,
    write,
)

pytestmark = pytest.mark.process



@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # error messages show paths relative to the cwd


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_registry(TEST_MANIFESTS)


# ---------------------------------------------------------------- manifests

HTTP_RELIC = """\
kind: Relic
name: r
runtime: http
command: ["{python}", "server.py", "--port", "{port}"]
operations:
  get:
    method: get
    path: "/items/{id}"
    parameters:
      type: object
      properties: {id: {type: string}}
      required: [id]
"""


def test_http_relic_loads_with_defaults_and_its_directory(tmp_path: Path) -> None:
    write(tmp_path, "m/sub/r.yaml", HTTP_RELIC)
    registry = load_registry(tmp_path / "m")
    spec = registry.relic("r")
    assert spec.runtime == "http" and spec.base_dir == (tmp_path / "m" / "sub").resolve()
    assert spec.operations["get"].method == "GET"  # case-insensitive
    assert spec.operations["get"].path_parameters == ["id"]
    assert spec.health.path == "/health" and spec.idle_timeout_s == 300
    assert registry.source("Relic", "r") == "m/sub/r.yaml"


def test_builtins_are_always_registered(tmp_path: Path) -> None:
    registry = load_registry(None)
    assert set(registry.relics) == {"kv", "sql"}
    assert registry.source("Relic", "kv") == BUILTIN_SOURCE
    assert set(registry.relic("kv").operations) == {"get", "set", "delete", "list"}
    assert set(registry.relic("sql").operations) == {"query", "execute"}
    with pytest.raises(ToolError, match=r"unknown relic 'nope'; known relics: kv, sql"):
        registry.relic("nope")


def test_test_and_example_manifests_declare_relics() -> None:
    assert {"echo", "broken", "missing", "kv", "sql"} <= set(load_registry(TEST_MANIFESTS).relics)
    examples = load_registry(EXAMPLE_MANIFESTS).relics
    assert examples["files"].runtime == "http" and "kv" in examples


def test_relics_section_form(tmp_path: Path) -> None:
    write(tmp_path, "m/x.yaml", """\
        relics:
          - name: a
            runtime: http
            command: [srv]
            operations: {ping: {method: GET, path: /ping}}
        """)
    assert load_registry(tmp_path / "m").relic("a").operations["ping"].method == "GET"


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        (HTTP_RELIC.replace("runtime: http", "runtime: builtin").replace(
            'command: ["{python}", "server.py", "--port", "{port}"]\n', ""),
         "x.yaml: Relic 'r': runtime: 'builtin' is reserved for the relics built into the "
         "worker (kv, sql); use http"),
        (HTTP_RELIC.replace('command: ["{python}", "server.py", "--port", "{port}"]\n', ""),
         "x.yaml: Relic 'r': command: runtime 'http' needs a command"),
        (HTTP_RELIC.replace('"{port}"]', '"{host}"]'),
         "x.yaml: Relic 'r': command[3]: unknown placeholder {host} in '{host}' (known: {port}, "
         "{python}, {manifest_dir})"),
        (HTTP_RELIC.replace("properties: {id: {type: string}}", "properties: {}"),
         "x.yaml: Relic 'r': operations.get.path: uses {id} but operations.get.parameters "
         "declares no property 'id'"),
        (HTTP_RELIC.replace("required: [id]", "required: []"),
         "x.yaml: Relic 'r': operations.get.path: uses {id}: list 'id' in "
         "operations.get.parameters.required or give it a default"),
        (HTTP_RELIC.replace('path: "/items/{id}"', 'path: "/items/{1d}"'),
         "x.yaml: Relic 'r': operations.get.path: bad placeholder '{1d}'"),
        (HTTP_RELIC.replace('    path: "/items/{id}"\n', ""),
         "x.yaml: Relic 'r': operations.get.path: required for runtime 'http' (e.g. '/get')"),
        (HTTP_RELIC.replace('path: "/items/{id}"', "path: items"),
         "x.yaml: Relic 'r': operations.get.path: must start with '/'"),
        (HTTP_RELIC.replace("method: get", "method: PATCH"),
         "x.yaml: Relic 'r': operations.get.method: Input should be 'GET', 'POST', 'PUT' or "
         "'DELETE'"),
        (HTTP_RELIC.replace("type: object", "type: array"),
         "x.yaml: Relic 'r': operations.get.parameters: the root must be of type "
         "'object'"),
        (HTTP_RELIC.replace("{id: {type: string}}", "{id: {type: strin}}"),
         "x.yaml: Relic 'r': operations.get.parameters: not a valid JSON Schema"),
        (HTTP_RELIC + "colour: red\n", "x.yaml: Relic 'r': colour: Extra inputs are not permitted"),
        (HTTP_RELIC + "idle_timeout_s: 0\n",
         "x.yaml: Relic 'r': idle_timeout_s: Input should be greater than 0"),
        (HTTP_RELIC + "health: {path: health}\n",
         "x.yaml: Relic 'r': health.path: must start with '/'"),
        (HTTP_RELIC + "env: {'BAD-NAME': v}\n",
         "x.yaml: Relic 'r': env: invalid environment variable name(s): 'BAD-NAME'"),
        (HTTP_RELIC.replace("name: r", "name: r.s"),
         "x.yaml: Relic 'r.s': name: 'r.s' is not a valid relic name"),
        (HTTP_RELIC.replace("  get:", "  a.b:").replace("(e.g. '/get')", ""),
         "x.yaml: Relic 'r': operations: 'a.b' is not a valid operation name"),
        ("kind: Relic\nname: r\nruntime: http\ncommand: [x]\noperations: {}\n",
         "x.yaml: Relic 'r': operations: Dictionary should have at least 1 item"),
        ("kind: Relic\nname: kv\nruntime: http\ncommand: [x]\noperations: {a: {path: /a}}\n",
         "x.yaml: Relic 'kv': relic 'kv' in x.yaml conflicts with the built-in relic"),
    ],
)
def test_manifest_errors_name_file_and_field(tmp_path: Path, manifest: str, message: str) -> None:
    write(tmp_path, "m/x.yaml", manifest)
    error = load_error(tmp_path / "m").replace("m/x.yaml", "x.yaml")
    assert error.startswith(message), error


def test_duplicate_relic_names_the_first_file(tmp_path: Path) -> None:
    write(tmp_path, "m/a.yaml", HTTP_RELIC)
    write(tmp_path, "m/b.yaml", HTTP_RELIC)
    assert load_error(tmp_path / "m") == "m/b.yaml: Relic 'r': relic 'r' is already defined in m/a.yaml"


# ---------------------------------------------------------------- naming an operation


def test_dotted_name_and_parameters_operation_are_the_same_call() -> None:
    dotted = resolve(BUILTIN_RELICS, "kv.set", {"key": "a", "value": [1]})
    given = resolve(BUILTIN_RELICS, "kv", {"operation": "set", "key": "a", "value": [1]})
    assert (dotted.relic.name, dotted.operation, dotted.params) == ("kv", "set",
                                                                    {"key": "a", "value": [1]})
    assert (given.relic.name, given.operation, given.params) == ("kv", "set",
                                                                 {"key": "a", "value": [1]})


def test_dotted_name_passes_parameters_as_they_are() -> None:
    # In the dotted form `operation` is an ordinary parameter (kv.set has none: refused).
    with pytest.raises(RelicCallError, match=r"parameters: Additional properties are not "
                                             r"allowed \('operation' was unexpected\)"):
        resolve(BUILTIN_RELICS, "kv.set", {"operation": "set", "key": "a", "value": 1})


@pytest.mark.parametrize(
    ("name", "params", "kind", "message"),
    [
        ("cache", {}, "unknown_relic", "unknown relic 'cache'; known relics: kv, sql"),
        ("cache.get", {}, "unknown_relic", "unknown relic 'cache'; known relics: kv, sql"),
        ("kv.sett", {}, "unknown_operation",
         "relic 'kv' has no operation 'sett'; its operations: delete, get, list, set"),
        ("kv", {"operation": "sett"}, "unknown_operation", "relic 'kv' has no operation 'sett'"),
        ("kv", {"operation": 3}, "unknown_operation", "relic 'kv' has no operation 3"),
        ("kv", {"key": "a"}, "unknown_operation",
         "relic 'kv': say which operation to run, as name 'kv.<operation>' or "
         "parameters.operation (it has several: delete, get, list, set)"),
        ("kv.", {}, "unknown_operation", "relic 'kv': say which operation to run"),
        ("kv.get", [1], "invalid_parameters", "relic 'kv': parameters must be an object, got list"),
        ("kv.get", {}, "invalid_parameters",
         "relic 'kv' operation 'get': parameters: 'key' is a required property"),
        ("kv.set", {"key": "a", "value": 1, "ttl": -5}, "invalid_parameters",
         "relic 'kv' operation 'set': parameter 'ttl': -5 is less than or equal to the minimum"),
        ("sql", {"operation": "query", "sql": 5}, "invalid_parameters",
         "relic 'sql' operation 'query': parameter 'sql': 5 is not of type 'string'"),
    ],
)
def test_bad_calls_name_what_exists(name: str, params: Any, kind: str, message: str) -> None:
    with pytest.raises(RelicCallError) as info:
        resolve(BUILTIN_RELICS, name, params)
    assert info.value.kind == kind
    assert str(info.value).startswith(message), str(info.value)
    assert isinstance(info.value, ToolError)  # a clean action failure at run time


def test_a_relic_of_one_operation_answers_to_its_name() -> None:
    single = {"cache": BUILTIN_RELICS["kv"].model_copy(
        update={"name": "cache", "operations": {"set": BUILTIN_RELICS["kv"].operations["set"]}})}
    resolved = resolve(single, "cache", {"key": "a", "value": 1})
    assert (resolved.relic.name, resolved.operation, resolved.params) == (
        "cache", "set", {"key": "a", "value": 1})
    assert check_relic_action(single, "cache", {"key": "a", "value": 1}) == []
    assert check_relic_action(single, "cache", {"value": 1})[0][0] == "invalid_parameters"


def test_document_check_defers_what_references_decide() -> None:
    assert check_relic_action(BUILTIN_RELICS, "kv", {"operation": "$op", "key": 1}) == []
    assert check_relic_action(BUILTIN_RELICS, "kv.set", {"key": "$k", "value": 1}) == []
    assert check_relic_action(BUILTIN_RELICS, "kv.get", {"key": "a"}) == []
    # a literal operation is still checked, even when the parameters hold references
    assert check_relic_action(BUILTIN_RELICS, "kv.sett", {"key": "$k"}) == [
        ("unknown_operation", "relic 'kv' has no operation 'sett'; its operations: delete, get, "
                              "list, set")]
    assert check_relic_action(BUILTIN_RELICS, "kv.get", {"key": 5})[0][0] == "invalid_parameters"
    assert check_relic_action(BUILTIN_RELICS, "nope", {})[0][0] == "unknown_relic"


def test_documents_with_relic_actions_are_checked() -> None:
    from cortex_worker.jobs.lifecycle import check_document

    text = ('<action type="relic" id="a">{"name": "kv.set", "parameters": {"key": "k", '
            '"value": 1}}</action>\n'
            '<action type="relic" id="b">{"name": "kv", "parameters": {"operation": "get", '
            '"key": "$a.key"}}</action>\n'
            '<action type="relic" id="c">{"name": "kv.nope", "parameters": {}}</action>\n'
            '<action type="relic" id="d">{"name": "cache", "parameters": {}}</action>\n'
            '<action type="relic" id="e">{"name": "sql.query", "parameters": {}}</action>\n')
    errors = check_document(load_document(text))
    assert [(e["kind"], e["message"].split(":")[0]) for e in errors] == [
        ("unknown_operation", "action 'c'"), ("unknown_relic", "action 'd'"),
        ("invalid_parameters", "action 'e'")]
    assert errors[0]["line"] == 3
    assert "its operations: delete, get, list, set" in errors[0]["message"]


def test_namespace_is_the_agent_or_documents() -> None:
    assert namespace_of({"name": "kv.get", "agent": "tester"}) == "tester"
    assert namespace_of({"name": "kv.get"}) == "documents"


# ---------------------------------------------------------------- sql


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = builtin.sql_path(tmp_path / "relics" / "sql", "tester")
    builtin.run_sql(path, "execute", {"sql": "CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT, "
                                             "tags TEXT)"}, 5)
    return path


def test_sql_execute_then_query_with_bound_parameters(db: Path) -> None:
    hostile = "x'); DROP TABLE t; --"
    first = builtin.run_sql(db, "execute", {"sql": "INSERT INTO t (name, tags) VALUES (?, ?)",
                                            "params": [hostile, ["a", "b"]]}, 5)
    assert first == {"rowcount": 1, "lastrowid": 1}
    builtin.run_sql(db, "execute", {"sql": "INSERT INTO t (name) VALUES (:name)",
                                    "params": {"name": "bob"}}, 5)
    rows = builtin.run_sql(db, "query", {"sql": "SELECT id, name, tags FROM t ORDER BY id"}, 5)
    assert rows == [{"id": 1, "name": hostile, "tags": '["a", "b"]'},
                    {"id": 2, "name": "bob", "tags": None}]
    assert builtin.run_sql(db, "query", {"sql": "WITH n AS (SELECT name FROM t WHERE id = ?) "
                                                "SELECT name FROM n", "params": [2]}, 5) == [
        {"name": "bob"}]
    assert db.name == "tester.sqlite3" and db.parent.name == "sql"


@pytest.mark.parametrize(
    ("sql", "refused"),
    [
        ("INSERT INTO t (name) VALUES ('x')", "INSERT"),
        ("UPDATE t SET name = 'y'", "UPDATE"),
        ("DELETE FROM t", "DELETE"),
        ("WITH n AS (SELECT 1) INSERT INTO t (name) SELECT 'z' FROM n", "INSERT"),
        ("CREATE TABLE u (a)", "to change the schema"),
        ("DROP TABLE t", "to change the schema"),
        ("PRAGMA journal_mode = DELETE", "PRAGMA"),
        ("ATTACH DATABASE 'other.db' AS o", "ATTACH"),
    ],
)
def test_sql_query_is_read_only(db: Path, sql: str, refused: str) -> None:
    with pytest.raises(ToolError, match=rf"sql query is read-only: the statement tries {refused}"):
        builtin.run_sql(db, "query", {"sql": sql}, 5)
    assert builtin.run_sql(db, "query", {"sql": "SELECT count(*) AS n FROM t"}, 5) == [{"n": 0}]


def test_sql_errors_are_clear(db: Path) -> None:
    with pytest.raises(ToolError, match="one statement at a time"):
        builtin.run_sql(db, "execute", {"sql": "DELETE FROM t; DROP TABLE t"}, 5)
    with pytest.raises(ToolError, match="no such table: nope"):
        builtin.run_sql(db, "query", {"sql": "SELECT * FROM nope"}, 5)
    with pytest.raises(ToolError, match="ATTACH is not allowed"):
        builtin.run_sql(db, "execute", {"sql": "ATTACH DATABASE 'o.db' AS o"}, 5)
    with pytest.raises(ToolError, match="Incorrect number of bindings"):
        builtin.run_sql(db, "query", {"sql": "SELECT ? AS a", "params": []}, 5)


def test_sql_limits_rows_and_time(db: Path) -> None:
    many = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c LIMIT 20) SELECT x FROM c"
    assert len(builtin.run_sql(db, "query", {"sql": many, "max_rows": 20}, 5)) == 20
    with pytest.raises(ToolError, match=r"more than 19 rows \(max_rows\)"):
        builtin.run_sql(db, "query", {"sql": many, "max_rows": 19}, 5)
    endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
    with pytest.raises(ToolTimeout, match=r"ran longer than 0.2s and was interrupted") as info:
        builtin.run_sql(db, "query", {"sql": endless}, 0.2)
    # the statement never ends by itself: SQLite stopped it, at the progress handler's word
    cause = info.value.__cause__
    assert isinstance(cause, sqlite3.OperationalError) and str(cause) == "interrupted"
    assert builtin.run_sql(db, "query", {"sql": "SELECT count(*) AS n FROM t"}, 5) == [{"n": 0}]


def test_sql_namespaces_are_separate_files(tmp_path: Path) -> None:
    root = tmp_path / "sql"
    for name in ("a", "b"):
        builtin.run_sql(builtin.sql_path(root, name), "execute",
                        {"sql": "CREATE TABLE only_here (v)"}, 5)
    builtin.run_sql(builtin.sql_path(root, "a"), "execute",
                    {"sql": "INSERT INTO only_here VALUES (1)"}, 5)
    assert builtin.run_sql(builtin.sql_path(root, "b"), "query",
                           {"sql": "SELECT count(*) AS n FROM only_here"}, 5) == [{"n": 0}]


# ---------------------------------------------------------------- kv (a real Redis)


@pytest.fixture(scope="module")
def kv_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis.Redis]:
    server = harness.RedisServer(data_dir=tmp_path_factory.mktemp("redis"))
    server.start()
    client = server.client(decode_responses=True)
    try:
        yield client
    finally:
        client.close()
        server.close()


def test_kv_set_get_delete(kv_redis: redis.Redis) -> None:
    run = builtin.run_kv
    assert run(kv_redis, "tester", "set", {"key": "k", "value": {"a": [1, "x"]}}) == {
        "key": "k", "stored": True, "ttl": None}
    assert kv_redis.get("cx:relic:kv:tester:k") == '{"a":[1,"x"]}'
    assert run(kv_redis, "tester", "get", {"key": "k"}) == {
        "key": "k", "found": True, "value": {"a": [1, "x"]}}
    assert run(kv_redis, "helper", "get", {"key": "k"}) == {
        "key": "k", "found": False, "value": None}  # another agent's namespace
    assert run(kv_redis, "tester", "set", {"key": "n", "value": None})["stored"]
    assert run(kv_redis, "tester", "get", {"key": "n"})["found"] is True
    assert run(kv_redis, "tester", "delete", {"key": "k"}) == {"key": "k", "deleted": True}
    assert run(kv_redis, "tester", "delete", {"key": "k"}) == {"key": "k", "deleted": False}


def test_kv_ttl_expires(kv_redis: redis.Redis) -> None:
    builtin.run_kv(kv_redis, "ttl", "set", {"key": "soon", "value": 1, "ttl": 0.2})
    assert 0 < kv_redis.pttl("cx:relic:kv:ttl:soon") <= 200
    harness.wait_until(lambda: not builtin.run_kv(kv_redis, "ttl", "get", {"key": "soon"})["found"],
                       timeout=3)


def test_kv_list_scans_one_namespace_by_prefix(kv_redis: redis.Redis) -> None:
    for key in ("user:1", "user:2", "user:*", "order:1"):
        builtin.run_kv(kv_redis, "lister", "set", {"key": key, "value": key})
    builtin.run_kv(kv_redis, "other", "set", {"key": "user:9", "value": 0})
    assert builtin.run_kv(kv_redis, "lister", "list", {}) == {
        "keys": ["order:1", "user:*", "user:1", "user:2"], "truncated": False}
    assert builtin.run_kv(kv_redis, "lister", "list", {"prefix": "user:"})["keys"] == [
        "user:*", "user:1", "user:2"]
    assert builtin.run_kv(kv_redis, "lister", "list", {"prefix": "user:*"})["keys"] == ["user:*"]
    assert builtin.run_kv(kv_redis, "lister", "list", {"limit": 2})["truncated"] is True


def test_kv_refuses_huge_values(kv_redis: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(builtin, "MAX_VALUE_BYTES", 10)
    with pytest.raises(ToolError, match=r"parameter 'value' is 24 bytes as JSON; at most 10"):
        builtin.run_kv(kv_redis, "tester", "set", {"key": "big", "value": "x" * 22})


# ---------------------------------------------------------------- the lifecycle (echo relic)


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[RelicManager]:
    mgr = RelicManager(tmp_path / "relics")
    try:
        yield mgr
    finally:
        mgr.stop_all()


@pytest.fixture
def echo(registry: Registry) -> RelicSpec:
    return registry.relic("echo")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] \
        if Path(f"/proc/{pid}/stat").exists() else "?"
    return state != "Z"


def test_started_on_first_use_then_reused(manager: RelicManager, echo: RelicSpec) -> None:
    assert manager.running() == {}
    first = manager.call(echo, "echo", {"message": "one"}, 10)
    second = manager.call(echo, "echo", {"message": "two"}, 10)
    assert first["echo"] == {"message": "one"} and second["echo"] == {"message": "two"}
    assert first["pid"] == second["pid"] and second["calls"] == 2
    assert manager.running() == {"echo": first["pid"]}
    inst = manager.instance("echo")
    assert inst is not None and inst.pid == first["pid"]
    assert os.getpgid(inst.pid) == inst.pid  # its own process group
    environ = Path(f"/proc/{inst.pid}/environ").read_bytes().split(b"\0")
    assert f"PORT={inst.port}".encode() in environ
    assert not any(e.startswith(b"PYTEST_") for e in environ)  # a minimal environment


def test_restarted_after_a_crash(manager: RelicManager, echo: RelicSpec) -> None:
    before = manager.call(echo, "echo", {"message": "x"}, 10)["pid"]
    assert manager.call(echo, "crash", {}, 10) == {"pid": before, "crashing": True}
    # it answers, then exits: a call racing with the exit fails (and says the relic restarts
    # on next use), so the next use here comes once the process is gone
    deadline = time.monotonic() + 10
    while alive(before) and time.monotonic() < deadline:
        time.sleep(0.02)
    after = manager.call(echo, "echo", {"message": "y"}, 10)
    assert after["pid"] != before and after["calls"] == 1
    assert not alive(before)


def test_connection_refused_restarts_without_waiting_for_the_health_interval(
        manager: RelicManager, echo: RelicSpec) -> None:
    slow_checks = echo.model_copy(update={"health": echo.health.model_copy(
        update={"interval_s": 3600})})
    before = manager.call(slow_checks, "echo", {"message": "x"}, 10)["pid"]
    os.killpg(before, signal.SIGKILL)
    time.sleep(0.1)
    assert manager.call(slow_checks, "echo", {"message": "y"}, 10)["pid"] != before


def test_restarted_when_its_health_check_fails(manager: RelicManager, echo: RelicSpec) -> None:
    before = manager.call(echo, "sick", {}, 10)["pid"]
    time.sleep(echo.health.interval_s + 0.05)
    after = manager.call(echo, "echo", {"message": "x"}, 10)["pid"]
    assert after != before and not alive(before)


def test_stopped_when_idle(manager: RelicManager, echo: RelicSpec) -> None:
    short = echo.model_copy(update={"idle_timeout_s": 0.3})
    pid = manager.call(short, "echo", {"message": "x"}, 10)["pid"]
    harness.wait_until(lambda: "echo" not in manager.running(), timeout=5)
    harness.wait_until(lambda: not alive(pid), timeout=5)
    assert manager.call(short, "echo", {"message": "y"}, 10)["pid"] != pid  # on next use


def test_not_stopped_while_a_call_runs(manager: RelicManager, echo: RelicSpec) -> None:
    short = echo.model_copy(update={"idle_timeout_s": 0.2})
    assert manager.call(short, "slow", {"seconds": 0.8}, 10)["slept"] == 0.8


def test_stop_all_kills_every_instance(manager: RelicManager, echo: RelicSpec,
                                       tmp_path: Path) -> None:
    pid = manager.call(echo, "echo", {"message": "x"}, 10)["pid"]
    assert list((tmp_path / "relics" / "pids").glob("echo.*.json"))
    manager.stop_all()
    assert manager.running() == {} and not alive(pid)
    assert not list((tmp_path / "relics" / "pids").glob("*.json"))


def test_concurrent_first_calls_start_one_instance(manager: RelicManager,
                                                   echo: RelicSpec) -> None:
    pids: list[int] = []

    def call() -> None:
        pids.append(manager.call(echo, "echo", {"message": "x"}, 10)["pid"])

    threads = [threading.Thread(target=call) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(pids) == 6 and len(set(pids)) == 1


def test_http_mapping_of_parameters(manager: RelicManager, echo: RelicSpec) -> None:
    got = manager.call(echo, "item", {"id": "a b/c", "verbose": True}, 10)
    assert got["id"] == "a b/c" and got["query"] == {"verbose": "true"}
    assert manager.call(echo, "remove", {"id": "7"}, 10)["deleted"] == "7"


def test_http_errors_and_timeouts(manager: RelicManager, echo: RelicSpec) -> None:
    with pytest.raises(ToolError, match=r"relic 'echo' operation 'fail' failed: HTTP 400: "
                                        r"asked to fail: boom"):
        manager.call(echo, "fail", {"message": "boom"}, 10)
    with pytest.raises(ToolTimeout, match=r"relic 'echo' operation 'slow' did not answer within"):
        manager.call(echo, "slow", {"seconds": 2}, 0.3)
    assert manager.call(echo, "echo", {"message": "still here"}, 10)["echo"]["message"] == \
        "still here"


def test_a_command_that_exits_at_start(manager: RelicManager, registry: Registry) -> None:
    with pytest.raises(ToolError) as info:
        manager.call(registry.relic("broken"), "ping", {}, 10)
    message = str(info.value)
    assert message.startswith("relic 'broken' exited with code 3 while starting")
    assert "broken relic: no configuration found" in message  # the tail of its output
    assert manager.running() == {}


def test_a_command_that_does_not_exist(manager: RelicManager, registry: Registry) -> None:
    with pytest.raises(ToolError, match=r"relic 'missing' cannot start: command not found: "
                                        r"'/nonexistent/relic-server'"):
        manager.call(registry.relic("missing"), "ping", {}, 10)


def test_a_relic_that_never_becomes_healthy(manager: RelicManager, tmp_path: Path) -> None:
    spec = RelicSpec(name="mute", runtime="http", startup_timeout_s=0.5,
                     command=["{python}", "-c", "import os, time; "
                                                "print('waiting', os.getpid(), flush=True); "
                                                "time.sleep(60)"],
                     operations={"ping": {"path": "/ping"}})
    with pytest.raises(ToolError) as info:
        manager.call(spec, "ping", {}, 60)
    # startup_timeout_s ended it, not the call's 60 s: the message names it, and the relic,
    # still in its minute's sleep (it would have exited 0 after), was stopped
    assert "relic 'mute' did not become healthy within 0.5s (startup_timeout_s)" in str(info.value)
    waiting = re.search(r"waiting (\d+)", str(info.value))
    assert waiting is not None, str(info.value)
    assert not alive(int(waiting.group(1)))
    assert manager.running() == {}


def test_port_comes_from_the_environment_too(manager: RelicManager, echo: RelicSpec) -> None:
    spec = echo.model_copy(update={"command": ["{python}", "{manifest_dir}/echo_relic.py"]})
    assert manager.call(spec, "echo", {"message": "env"}, 10)["echo"] == {"message": "env"}


def test_orphans_of_a_dead_worker_are_killed(tmp_path: Path) -> None:
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              start_new_session=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        pids = tmp_path / "relics" / "pids"
        pids.mkdir(parents=True)
        start = Path(f"/proc/{orphan.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        (pids / f"x.{dead.pid}.json").write_text(json.dumps(
            {"name": "x", "pid": orphan.pid, "start": start, "owner": dead.pid,
             "owner_start": "1"}))
        assert RelicManager(tmp_path / "relics").reap_orphans() == 0  # done at creation
        assert orphan.wait(timeout=5) == -signal.SIGKILL
        assert not list(pids.iterdir())
    finally:
        orphan.kill()
        orphan.wait()


# ---------------------------------------------------------------- the registry routes


def test_relic_routes() -> None:
    app = create_app(Settings(manifests=TEST_MANIFESTS))
    app.dependency_overrides[registry_dep] = lambda: load_registry(TEST_MANIFESTS)
    client = TestClient(app)
    items = client.get("/v1/relics").json()["items"]
    assert [i["name"] for i in items] == sorted([*TEST_RELICS, "kv", "sql"])
    kv = next(i for i in items if i["name"] == "kv")
    assert kv["builtin"] is True and kv["runtime"] == "builtin"
    assert kv["operations"]["set"]["method"] is None
    assert kv["operations"]["set"]["parameters"]["required"] == ["key", "value"]
    echo = client.get("/v1/relics/echo").json()
    assert echo["operations"]["item"] == {
        "description": "Read one item; other parameters become the query string.",
        "method": "GET", "path": "/items/{id}",
        "parameters": echo["operations"]["item"]["parameters"]}
    missing = client.get("/v1/relics/nope")
    assert missing.status_code == 404 and "kv" in missing.text


def test_example_files_relic_serves_a_manifest(manager: RelicManager) -> None:
    spec = load_registry(EXAMPLE_MANIFESTS).relic("files")
    text = manager.call(spec, "read", {"file": "relics.yaml"}, 10)
    assert isinstance(text, str) and "name: files" in text
    with pytest.raises(ToolError, match=r"relic 'files' operation 'read' failed: HTTP 404"):
        manager.call(spec, "read", {"file": "nope.yaml"}, 10)
