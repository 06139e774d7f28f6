"""The built-in relics: `kv` (Redis) and `sql` (SQLite), both namespaced per agent.

The namespace is the agent whose job runs the action, or "documents" for submitted
documents: agents never see each other's keys or tables.

- kv: key `cx:relic:kv:<namespace>:<key>` (`keys.relic_kv_key`), the value stored as JSON
  text; `list` walks the namespace with SCAN (never KEYS).
- sql: one SQLite file per namespace, `<workspace_root>/relics/sql/<namespace>.sqlite3`.
  `query` is read-only twice over: the database is opened with `mode=ro` and an authorizer
  refuses anything but reading. Values are always bound (`?` / `:name`), never formatted
  into the SQL. A statement that runs past the action's timeout is interrupted.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from cortex_worker.store.keys import relic_kv_key
from cortex_worker.tools.errors import ToolError, ToolTimeout

MAX_VALUE_BYTES = 1024 * 1024
SCAN_COUNT = 500
SQL_BUSY_TIMEOUT_S = 5.0

_GLOB = re.compile(r"([*?\[\]\\])")


# ---------------------------------------------------------------- kv


def _glob_escape(text: str) -> str:
    return _GLOB.sub(r"\\\1", text)


def run_kv(client: redis.Redis, namespace: str, operation: str, params: dict[str, Any]) -> Any:
    """One `kv` operation on `client` (a Redis client with decode_responses=True)."""
    try:
        return _KV[operation](client, namespace, params)
    except redis.RedisError as exc:
        raise ToolError(f"kv {operation}: Redis error: {exc}") from exc


def _kv_get(client: redis.Redis, namespace: str, params: dict[str, Any]) -> Any:
    raw = client.get(relic_kv_key(namespace, params["key"]))
    if raw is None:
        return {"key": params["key"], "found": False, "value": None}
    return {"key": params["key"], "found": True, "value": json.loads(raw)}


def _kv_set(client: redis.Redis, namespace: str, params: dict[str, Any]) -> Any:
    text = json.dumps(params["value"], ensure_ascii=False, separators=(",", ":"))
    if len(text.encode()) > MAX_VALUE_BYTES:
        raise ToolError(f"kv set: parameter 'value' is {len(text.encode())} bytes as JSON; "
                        f"at most {MAX_VALUE_BYTES} are allowed")
    ttl = params.get("ttl")
    px = max(1, round(float(ttl) * 1000)) if ttl is not None else None
    client.set(relic_kv_key(namespace, params["key"]), text, px=px)
    return {"key": params["key"], "stored": True, "ttl": ttl}


def _kv_delete(client: redis.Redis, namespace: str, params: dict[str, Any]) -> Any:
    deleted = client.delete(relic_kv_key(namespace, params["key"]))
    return {"key": params["key"], "deleted": bool(deleted)}


def _kv_list(client: redis.Redis, namespace: str, params: dict[str, Any]) -> Any:
    prefix = params.get("prefix") or ""
    limit = int(params.get("limit") or 100)
    base = relic_kv_key(namespace, "")
    pattern = _glob_escape(base + prefix) + "*"
    keys: set[str] = set()
    truncated = False
    for name in client.scan_iter(match=pattern, count=SCAN_COUNT):
        keys.add(name[len(base):])
        if len(keys) > limit:
            truncated = True
            break
    found = sorted(keys)
    return {"keys": found[:limit], "truncated": truncated}


_KV: dict[str, Callable[[redis.Redis, str, dict[str, Any]], Any]] = {
    "get": _kv_get, "set": _kv_set, "delete": _kv_delete, "list": _kv_list}


# ---------------------------------------------------------------- sql

_READ_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
                 getattr(sqlite3, "SQLITE_RECURSIVE", 33)}
_NEVER = {sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH}
_SCHEMA_TABLES = {"sqlite_master", "sqlite_temp_master", "sqlite_schema", "sqlite_temp_schema"}
_ACTIONS = ("CREATE_INDEX", "CREATE_TABLE", "CREATE_TEMP_INDEX", "CREATE_TEMP_TABLE",
            "CREATE_TEMP_TRIGGER", "CREATE_TEMP_VIEW", "CREATE_TRIGGER", "CREATE_VIEW", "DELETE",
            "DROP_INDEX", "DROP_TABLE", "DROP_TEMP_INDEX", "DROP_TEMP_TABLE", "DROP_TEMP_TRIGGER",
            "DROP_TEMP_VIEW", "DROP_TRIGGER", "DROP_VIEW", "INSERT", "PRAGMA", "READ", "SELECT",
            "TRANSACTION", "UPDATE", "ATTACH", "DETACH", "ALTER_TABLE", "REINDEX", "ANALYZE",
            "CREATE_VTABLE", "DROP_VTABLE", "FUNCTION", "SAVEPOINT", "RECURSIVE")
_NAMES = {getattr(sqlite3, f"SQLITE_{name}"): name.replace("_", " ")
          for name in _ACTIONS if hasattr(sqlite3, f"SQLITE_{name}")}


def sql_path(root: Path, namespace: str) -> Path:
    """The database of a namespace under `root` (`<workspace_root>/relics/sql`)."""
    return root / f"{namespace}.sqlite3"


def run_sql(path: Path, operation: str, params: dict[str, Any], timeout: float) -> Any:
    """One `sql` operation on the database file `path` (created on first use)."""
    bound = _bind(params.get("params"))
    if operation == "query":
        return _query(path, params["sql"], bound, int(params.get("max_rows") or 1000), timeout)
    return _execute(path, params["sql"], bound, timeout)


def _bind(values: Any) -> Any:
    """Bound parameters: scalars as they are, lists and objects as JSON text."""
    if values is None:
        return ()

    def one(value: Any) -> Any:
        return json.dumps(value) if isinstance(value, list | dict) else value

    if isinstance(values, dict):
        return {k: one(v) for k, v in values.items()}
    return [one(v) for v in values]


def _create(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        conn = sqlite3.connect(path, timeout=SQL_BUSY_TIMEOUT_S)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
        finally:
            conn.close()


class _Guard:
    """Authorizer (what a statement may do) and progress handler (its deadline)."""

    def __init__(self, read_only: bool, timeout: float) -> None:
        self.read_only = read_only
        self.deadline = time.monotonic() + timeout
        self.refused: str | None = None
        self.expired = False

    def authorize(self, action: int, arg1: Any, arg2: Any, db: Any, trigger: Any) -> int:
        if action in _NEVER or (self.read_only and action not in _READ_ACTIONS):
            if arg1 not in _SCHEMA_TABLES:  # CREATE/DROP: "to change the schema" below
                self.refused = self.refused or _NAMES.get(action, str(action))
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK

    def progress(self) -> int:
        if time.monotonic() > self.deadline:
            self.expired = True
            return 1
        return 0

    def install(self, conn: sqlite3.Connection) -> None:
        conn.set_authorizer(self.authorize)
        conn.set_progress_handler(self.progress, 1000)

    def error(self, operation: str, exc: sqlite3.Error, timeout: float) -> ToolError:
        if self.expired:
            return ToolTimeout(f"sql {operation}: the statement ran longer than {timeout:g}s "
                               "and was interrupted")
        if self.read_only and (self.refused or "not authorized" in str(exc)):
            self.refused = self.refused or "to change the schema"
            return ToolError(f"sql query is read-only: the statement tries {self.refused}; "
                             "use SELECT or WITH here and the 'execute' operation to change data")
        if self.refused:
            return ToolError(f"sql {operation}: {self.refused} is not allowed")
        return ToolError(f"sql {operation}: {type(exc).__name__}: {exc}")


def _query(path: Path, sql: str, bound: Any, max_rows: int, timeout: float) -> list[dict[str, Any]]:
    _create(path)
    guard = _Guard(read_only=True, timeout=timeout)
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True,
                           timeout=min(SQL_BUSY_TIMEOUT_S, timeout))
    try:
        guard.install(conn)
        cursor = conn.execute(sql, bound)
        if cursor.description is None:
            raise ToolError("sql query: the statement returns no rows; use SELECT or WITH")
        columns = [c[0] for c in cursor.description]
        rows = cursor.fetchmany(max_rows + 1)
    except sqlite3.Error as exc:
        raise guard.error("query", exc, timeout) from exc
    finally:
        conn.close()
    if len(rows) > max_rows:
        raise ToolError(f"sql query: more than {max_rows} rows (max_rows); add LIMIT, narrow the "
                        "WHERE clause or raise max_rows")
    return [dict(zip(columns, row, strict=True)) for row in rows]


def _execute(path: Path, sql: str, bound: Any, timeout: float) -> dict[str, Any]:
    _create(path)
    guard = _Guard(read_only=False, timeout=timeout)
    conn = sqlite3.connect(path, timeout=min(SQL_BUSY_TIMEOUT_S, timeout), isolation_level=None)
    try:
        guard.install(conn)
        cursor = conn.execute(sql, bound)
        return {"rowcount": cursor.rowcount, "lastrowid": cursor.lastrowid}
    except sqlite3.Error as exc:
        raise guard.error("execute", exc, timeout) from exc
    finally:
        conn.close()
