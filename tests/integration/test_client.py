"""`cortex_api.client` against the real stack: the session's API, workers, Redis and fake model.

A stream is dropped for real: `CuttingProxy` relays the client's TCP connections to the API
and cuts them all mid-stream, as a failed network would; the client must reconnect with
`Last-Event-ID` and deliver every event once.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import socket
import threading
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest

from cortex_api.client import (
    AsyncClient,
    Client,
    Conflict,
    Event,
    InvalidRequest,
    JobOptions,
    JobTimeout,
    NotFound,
    Unauthorized,
)
from tests import harness
from tests.fake_llm import FakeLLM
from tests.integration.test_agents import final, turn, unique
from tests.integration.test_documents import action
from tests.integration.test_workflows import DIAMOND_X3

ECHO = action("a", "echo", {"message": "hi"}) + "<response>said $a</response>"
# the drop comes at `s`'s action_started: the job still runs for a second after it
SLOW = action("s", "sleep", {"seconds": 1.0}) + "<response>slept $s</response>"


class CuttingProxy:
    """A TCP relay on loopback in front of `port`. `cut()` shuts down every connection it
    carries, both ends; `heads` keeps what each client connection sent (its requests)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._server = socket.create_server((harness.LOOPBACK, 0))
        self.url = f"http://{harness.LOOPBACK}:{self._server.getsockname()[1]}"
        self.heads: list[bytes] = []
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def resumed_after(self) -> list[int | None]:
        """Each connection's `Last-Event-ID` (None: it asked from the start)."""
        found = [re.search(rb"(?im)^last-event-id:\s*(\d+)\r$", head) for head in self.heads]
        return [int(m.group(1)) if m else None for m in found]

    def cut(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._server.close()
        self.cut()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self._server.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection((harness.LOOPBACK, self.port))
            with self._lock:
                self._sockets += [downstream, upstream]
                self.heads.append(b"")
                index = len(self.heads) - 1
            threading.Thread(target=self._pump, args=(downstream, upstream, index),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, downstream, None),
                             daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, index: int | None) -> None:
        with suppress(OSError):
            while data := source.recv(65536):
                if index is not None:
                    self.heads[index] += data
                sink.sendall(data)
        for sock in (source, sink):
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def client(workers: Any, api: harness.Process) -> Iterator[Client]:
    with Client(api.url) as cortex:
        yield cortex


@pytest.fixture
def proxy(api: harness.Process) -> Iterator[CuttingProxy]:
    relay = CuttingProxy(api.port)
    try:
        yield relay
    finally:
        relay.close()


def assert_whole(events: list[Event]) -> None:
    """Every event of the log, once, in order, ending with the job's last."""
    assert all(isinstance(event, Event) for event in events)
    assert [event.seq for event in events] == list(range(1, len(events) + 1))
    assert events[-1].terminal and sum(event.terminal for event in events) == 1


# ------------------------------------------------------------------------------ submit, wait


def test_a_document_job_is_submitted_and_waited_for(client: Client) -> None:
    job = client.submit_document(ECHO)
    # the status as the API read it back: a worker may have taken the job that far already
    assert job.status in ("queued", "running", "finishing", "completed")
    assert job.links.events == f"/v1/jobs/{job.id}/events"

    view = client.wait(job.id, timeout=30)

    assert (view.id, view.status, view.kind, view.result) == (job.id, "completed", "document",
                                                               "said hi")
    assert [(a.id, a.status, a.result) for a in view.actions] == [("a", "ok", "hi")]


def test_an_agent_job_is_submitted_and_waited_for(client: Client, fake_llm: FakeLLM) -> None:
    model = unique("client-agent")
    fake_llm.script(model, [turn(final("Hello from the agent."))])

    job = client.submit_agent("tester", "Say hello.", options=JobOptions(model=model))
    view = client.wait(job.id, timeout=30)

    assert (view.status, view.kind, view.agent, view.turns) == ("completed", "agent", "tester", 1)
    assert view.result == "Hello from the agent."


def test_a_workflow_job_is_submitted_and_waited_for(client: Client) -> None:
    view = client.wait(client.submit_workflow("diamond", {"x": 3}).id, timeout=30)

    assert (view.status, view.kind) == ("completed", "workflow")
    assert json.loads(view.result or "") == DIAMOND_X3


def test_wait_gives_up_at_its_timeout_and_a_cancelled_job_cannot_be_cancelled_again(
        client: Client) -> None:
    job = client.submit_document(action("s", "sleep", {"seconds": 20}))
    with pytest.raises(JobTimeout):
        client.wait(job.id, timeout=0.5)

    assert client.cancel(job.id).status == "cancelled"
    view = client.wait(job.id, timeout=30)
    assert view.status == "cancelled" and view.actions[0].status == "cancelled"
    with pytest.raises(Conflict) as ended:
        client.cancel(job.id)
    assert ended.value.status == 409 and ended.value.detail["status"] == "cancelled"
    assert "has already ended" in ended.value.message


# ------------------------------------------------------------------------------ events


def test_events_are_typed_in_order_and_resume_after_a_given_seq(client: Client) -> None:
    job = client.submit_document(ECHO)

    events = list(client.events(job.id, timeout=30))

    assert_whole(events)
    assert [e.type for e in events if e.type.startswith(("job_", "action_"))] == [
        "job_queued", "job_started", "action_parsed", "action_queued", "action_started",
        "action_completed", "job_completed"]
    done = next(e for e in events if e.type == "action_completed")
    assert done.job_id == job.id and done.data["action_id"] == "a" and done.data["result"] == "hi"
    assert events[-1].data["result"] == "said hi"
    later = list(client.events(job.id, after=done.seq))
    assert later == events[done.seq:]


def test_a_dropped_stream_resumes_with_last_event_id_and_loses_nothing(
        client: Client, proxy: CuttingProxy) -> None:
    job = client.submit_document(SLOW)
    events: list[Event] = []
    with Client(proxy.url) as through_proxy:
        for event in through_proxy.events(job.id, timeout=30):
            events.append(event)
            if event.type == "action_started":
                proxy.cut()

    assert_whole(events)
    started = next(e for e in events if e.type == "action_started")
    completed = next(e for e in events if e.type == "action_completed")
    first, resumed = proxy.resumed_after()
    assert first is None and started.seq <= resumed < completed.seq  # the rest came live


# ------------------------------------------------------------------------------ errors, lists


def test_errors_are_typed_and_carry_the_api_message(client: Client) -> None:
    with pytest.raises(NotFound) as unknown:
        client.get_job("no-such-job")
    assert unknown.value.status == 404 and "'no-such-job' not found" in unknown.value.message
    with pytest.raises(NotFound):
        list(client.events("no-such-job"))
    with pytest.raises(NotFound):
        client.cancel("no-such-job")

    with pytest.raises(InvalidRequest) as document:
        client.submit_document(action("a", "web_scraper_nope", {}))
    assert document.value.status == 422 and "no tool named 'web_scraper_nope'" in str(document.value)
    assert [e["kind"] for e in document.value.errors] == ["unknown_tool"]
    with pytest.raises(InvalidRequest, match="no-such-agent"):
        client.submit_agent("no-such-agent", "Do it.")
    with pytest.raises(InvalidRequest, match="the workflow was rejected"):
        client.submit_workflow("diamond", {"x": "not a number"})


def test_jobs_agents_and_tools_are_listed(client: Client) -> None:
    ids = [client.submit_document(ECHO).id for _ in range(3)]  # a third: there is a next page
    for job_id in ids:
        client.wait(job_id, timeout=30)

    page = client.list_jobs(limit=2)
    assert [item.id for item in page.items] == ids[:0:-1] and page.next_offset == 2
    completed = client.list_jobs(status="completed", limit=200).items
    assert set(ids) <= {item.id for item in completed}
    assert {item.status for item in completed} == {"completed"}

    agents = {agent.name: agent for agent in client.list_agents()}
    assert "echo" in agents["tester"].tools
    tools = {tool.name: tool for tool in client.list_tools()}
    assert tools["echo"].runtime == "builtin" and "message" in tools["echo"].parameters["properties"]


# ------------------------------------------------------------------------------ API keys

KEY = "client-" + secrets.token_urlsafe(24)


@pytest.fixture(scope="module")
def keyed_api(cortex_env: dict[str, str], harness_dir: Path) -> Iterator[harness.Process]:
    """An API of its own that has keys (the session's `api` has none)."""
    env = {**cortex_env, "CORTEX_API_KEYS": f"alpha:{KEY}"}
    with harness.api_running(env, log_dir=harness_dir, cwd=harness_dir) as proc:
        yield proc


def test_the_key_is_sent_and_a_wrong_or_missing_one_is_unauthorized(
        workers: Any, keyed_api: harness.Process) -> None:
    with Client(keyed_api.url, api_key=KEY) as client:
        assert client.wait(client.submit_document(ECHO).id, timeout=30).status == "completed"
    with Client(keyed_api.url, api_key="wrong") as client, pytest.raises(Unauthorized) as wrong:
        client.list_jobs()
    assert wrong.value.status == 401 and wrong.value.message == "invalid API key"
    with Client(keyed_api.url) as client, pytest.raises(Unauthorized, match="key is required"):
        list(client.events("any"))


# ------------------------------------------------------------------------------ the CLI


def test_cortex_run_follows_an_agent_job_through_the_client(
        workers: Any, keyed_api: harness.Process, cortex_env: dict[str, str],
        fake_llm: FakeLLM) -> None:
    fake_llm.script("tester", [turn(final("Answered in the terminal."))])  # `run` has no --model
    env = {**cortex_env, "CORTEX_API_KEY": KEY, "CORTEX_API_URL": keyed_api.url}

    out = harness.run_cortex(env, "run", "Answer.", "--agent", "tester")

    assert out.returncode == 0 and fake_llm.remaining("tester") == 0, out.stdout + out.stderr
    assert "Answered in the terminal." in out.stdout and "job_completed" in out.stdout


def test_cortex_exec_prints_the_api_rejection(workers: Any, api: harness.Process,
                                              cortex_env: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "doc.xml"
    path.write_text(action("a", "web_scraper_nope", {}))

    out = harness.run_cortex(cortex_env, "exec", str(path), "--url", api.url)

    assert out.returncode == 1, out.stdout + out.stderr
    assert "rejected (422)" in out.stdout and "no tool named 'web_scraper_nope'" in out.stdout
    assert "1:1 unknown_tool:" in out.stdout


# ------------------------------------------------------------------------------ AsyncClient


def test_async_client_submits_waits_and_maps_errors(workers: Any, api: harness.Process) -> None:
    async def main() -> None:
        async with AsyncClient(api.url) as client:
            job = await client.submit_document(ECHO)
            view = await client.wait(job.id, timeout=30)
            assert (view.status, view.result) == ("completed", "said hi")
            assert job.id in {item.id for item in (await client.list_jobs()).items}
            with pytest.raises(NotFound):
                await client.get_job("no-such-job")

    asyncio.run(main())


def test_async_client_resumes_a_dropped_stream(client: Client, proxy: CuttingProxy) -> None:
    job = client.submit_document(SLOW)

    async def follow() -> list[Event]:
        events: list[Event] = []
        async with AsyncClient(proxy.url) as through_proxy:
            async for event in through_proxy.events(job.id, timeout=30):
                events.append(event)
                if event.type == "action_started":
                    proxy.cut()
        return events

    events = asyncio.run(follow())

    assert_whole(events)
    started = next(e for e in events if e.type == "action_started")
    completed = next(e for e in events if e.type == "action_completed")
    first, resumed = proxy.resumed_after()
    assert first is None and started.seq <= resumed < completed.seq
