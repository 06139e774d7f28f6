"""Every tool call knows its attempt and the action's idempotency key (`<job_id>:<action_id>`,
the same on every attempt): built-ins and `@tool` functions through `ctx` and
`tools.attempt.current()`, python and shell tools through `CORTEX_*` environment variables,
the http built-in as an `Idempotency-Key` header; and the example tool that charges once per
key (examples/idempotency/payments.py). In-process engine, real Redis, real
sandboxed tool processes; the tools are declared in a manifests directory of the test's own."""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from textwrap import dedent
from typing import Any, ClassVar

import pytest

from cortex_worker import handles
from cortex_worker.jobs import lifecycle as jobs
from cortex_worker.sandbox import warm
from cortex_worker.settings import get_settings
from cortex_worker.store.state import Store
from cortex_worker.testing import StubBroker
from cortex_worker.tools.attempt import Attempt, running
from tests.engine.helpers import action, events, of, one, status

TOOLS = '''
from __future__ import annotations

import os

from cortex_worker.tools.attempt import current
from cortex_worker.tools.function import tool


@tool
def seen(fail_first: bool = False) -> dict[str, object]:
    """The attempt this call is, as `current()` says; fails attempt 1 if `fail_first`."""
    attempt = current()
    if fail_first and attempt.attempt == 1:
        raise RuntimeError(f"attempt {attempt.attempt} of {attempt.idempotency_key}")
    return {"key": attempt.idempotency_key, "attempt": attempt.attempt}


def environment() -> dict[str, str]:
    """The CORTEX_* variables of this process (a `kind: Tool` python tool)."""
    return {k: v for k, v in os.environ.items() if k.startswith("CORTEX_")}
'''

MANIFEST = '''
kind: ToolModule
name: idem_tools
---
kind: Tool
name: py_env
runtime: python
entrypoint: idem_tools:environment
---
kind: Tool
name: sh_env
runtime: shell
command: ["sh", "-c", "printf '%s %s %s %s' \\"$CORTEX_IDEMPOTENCY_KEY\\" \\"$CORTEX_ATTEMPT\\" \\"$CORTEX_JOB_ID\\" \\"$CORTEX_ACTION_ID\\""]
'''


@pytest.fixture
def own_tools(store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process reads its manifests from a directory with the tools above."""
    (tmp_path / "idem_tools.py").write_text(TOOLS)
    (tmp_path / "tools.yaml").write_text(dedent(MANIFEST))
    monkeypatch.setenv("CORTEX_MANIFESTS", str(tmp_path))
    handles.reset()
    try:
        yield
    finally:
        handles.reset()  # before the environment is restored: the next test reads its own


class _Recorder(BaseHTTPRequestHandler):
    """Answers every GET with 200 and keeps its `Idempotency-Key` headers."""

    keys: ClassVar[list[list[str]]]  # each server's own (`recorder`)

    def do_GET(self) -> None:
        self.keys.append(self.headers.get_all("Idempotency-Key") or [])
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[tuple[str, list[list[str]]]]:
    """A loopback HTTP server in a thread: its URL and the keys it was sent, per request."""
    handler = type("Recorder", (_Recorder,), {"keys": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", handler.keys
    finally:
        server.shutdown()
        server.server_close()


def results(store: Store, job_id: str) -> dict[str, Any]:
    return {e["data"]["action_id"]: e["data"]["result"]
            for e in of(events(store, job_id), "action_completed")}


@pytest.mark.usefixtures("own_tools")
def test_every_kind_of_tool_sees_the_key_and_the_attempt(
        store: Store, broker: StubBroker, recorder: tuple[str, list[list[str]]]) -> None:
    url, keys = recorder
    doc = (action("fn", "seen", {})
           + action("py", "py_env", {})
           + action("sh", "sh_env", {})
           + action("snippet", "python", {"code": "import os\nos.environ['CORTEX_ATTEMPT'], "
                                                  "os.environ['CORTEX_IDEMPOTENCY_KEY']"})
           + action("get", "http_get", {"url": url})
           + action("own", "http_get", {"url": url, "headers": {"idempotency-KEY": "mine"}}))
    job_id = jobs.submit_document(store, doc)
    broker.join()
    assert status(store, job_id) == "completed"
    out = results(store, job_id)
    assert out["fn"] == {"key": f"{job_id}:fn", "attempt": 1}
    assert out["py"] == {"CORTEX_JOB_ID": job_id, "CORTEX_ACTION_ID": "py",
                         "CORTEX_ATTEMPT": "1", "CORTEX_IDEMPOTENCY_KEY": f"{job_id}:py"}
    assert out["sh"]["stdout"] == f"{job_id}:sh 1 {job_id} sh"
    assert out["snippet"]["result"] == ["1", f"{job_id}:snippet"]
    # the http tool's own key, and the user's header instead of it (sent once, as given)
    assert sorted(keys) == sorted([[f"{job_id}:get"], ["mine"]])
    # a warm runner is shared by the calls of a tool: no attempt in its environment
    assert not [key for key in warm._zygotes if any(k == "CORTEX_ATTEMPT" for k, _ in key[1])]


@pytest.mark.usefixtures("own_tools")
def test_two_attempts_of_an_action_share_its_key(store: Store, broker: StubBroker) -> None:
    job_id = jobs.submit_document(store, action("pay", "seen", {"fail_first": True}, retry=1))
    broker.join()
    assert status(store, job_id) == "completed"
    log = events(store, job_id)
    assert [e["data"]["attempt"] for e in of(log, "action_started", "pay")] == [1, 2]
    assert f"attempt 1 of {job_id}:pay" in one(log, "action_retrying", "pay")["error"]
    assert one(log, "action_completed", "pay")["result"] == {"key": f"{job_id}:pay",
                                                             "attempt": 2}
    assert store.actions(job_id)["pay"]["attempts"] == 2


def test_the_example_charges_once_per_action(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    path = Path(__file__).resolve().parents[2] / "examples" / "idempotency" / "payments.py"
    loader = importlib.util.spec_from_file_location("payments_example", path)
    assert loader is not None and loader.loader is not None
    payments = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(payments)
    monkeypatch.setattr(payments, "REDIS_URL", get_settings().redis_url)

    def pay(action_id: str, attempt: int) -> dict[str, Any]:
        with running(Attempt("job-1", action_id, attempt)):
            return payments.charge(card="4242", cents=500)  # type: ignore[no-any-return]

    first, again, other = pay("pay", 1), pay("pay", 2), pay("tip", 1)
    assert first["charged"] and other["charged"]
    assert not again["charged"] and again["attempt"] == 1  # the first attempt's charge
    assert store.redis.hlen(payments.CHARGES) == 2
