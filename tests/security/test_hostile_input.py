"""Hostile input against a real API and workers: fuzzing, oversize and nested bodies, XML
entity tricks, and `$` references that try to reach another job's variables.

The invariant everywhere: the API answers 4xx for what it refuses (never 5xx, never a
crash), and whatever it accepts runs to an end.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests import harness
from tests.integration.test_documents import action, one, run
from tests.manifest_helpers import CORPUS

TERMINAL_STATUS = {"completed", "failed", "cancelled"}
#: Defaults of cortex_worker.settings: CORTEX_MAX_DOCUMENT_BYTES and CORTEX_MAX_OUTPUT_BYTES.
MAX_DOCUMENT = 1024 * 1024
MAX_OUTPUT = 256 * 1024
BODY_LIMIT = MAX_DOCUMENT + 64 * 1024
SCHEMATHESIS_BUDGET_S = 60.0
SCHEMATHESIS_EXAMPLES = 25
SSE_PATH = "/v1/jobs/{job_id}/events"


@pytest.fixture(scope="module")
def stack(workers: Any, cortex_env: dict[str, str], harness_dir: Path) -> Iterator[Any]:
    """An API of this module's own (no API keys configured: open on loopback) over the
    session's Redis and workers."""
    proc = harness.start_api(cortex_env, log_dir=harness_dir, cwd=harness_dir)
    try:
        yield proc
    finally:
        proc.stop()


def wait_ended(api: Any, job_ids: list[str], timeout: float = 90) -> dict[str, str]:
    """job id -> final status; fails if one has not ended within `timeout`."""
    deadline = time.monotonic() + timeout
    status: dict[str, str] = {}
    with httpx.Client(timeout=10) as client:
        for job_id in job_ids:
            while True:
                job = client.get(f"{api.url}/v1/jobs/{job_id}")
                assert job.status_code == 200, job.text
                status[job_id] = job.json()["status"]
                if status[job_id] in TERMINAL_STATUS:
                    break
                assert time.monotonic() < deadline, f"job {job_id} still {status[job_id]}"
                time.sleep(0.1)
    return status


# --------------------------------------------------------------------------- schemathesis


def test_schemathesis_finds_no_server_error(stack: Any) -> None:
    """Every operation of the OpenAPI spec, positive and negative cases: never a 5xx."""
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{stack.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8, [op.label for op in operations]
    started = time.monotonic()
    per_operation = SCHEMATHESIS_BUDGET_S / (2 * len(operations))
    errors: list[str] = []
    calls = 0
    with httpx.Client(timeout=5) as client:
        for operation in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                stop_at = min(time.monotonic() + per_operation, started + SCHEMATHESIS_BUDGET_S)
                calls += _fuzz_operation(client, stack.url, operation, mode, stop_at, errors)
    elapsed = time.monotonic() - started
    print(f"schemathesis: {calls} calls over {len(operations)} operations in {elapsed:.1f}s")
    assert calls >= len(operations)
    assert not errors, "\n".join(errors[:20])
    assert httpx.get(f"{stack.url}/healthz").status_code == 200


def _fuzz_operation(client: httpx.Client, base_url: str, operation: Any, mode: Any,
                    stop_at: float, errors: list[str]) -> int:
    """Send up to SCHEMATHESIS_EXAMPLES generated cases until `stop_at`; 5xx go to `errors`."""
    from hypothesis.errors import Unsatisfiable

    calls = 0

    @settings(max_examples=SCHEMATHESIS_EXAMPLES, deadline=None, database=None,
              phases=[Phase.generate], derandomize=True, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: Any) -> None:
        nonlocal calls
        if time.monotonic() > stop_at:
            return
        kwargs = case.as_transport_kwargs(base_url=base_url)
        try:
            request = client.build_request(
                kwargs["method"], kwargs["url"], params=kwargs.get("params"),
                headers=_str_headers(kwargs.get("headers")), content=_content(kwargs))
        except (httpx.InvalidURL, UnicodeEncodeError, TypeError, ValueError):
            return  # not sendable by this client: never reaches the server
        calls += 1
        try:
            if operation.path == SSE_PATH:
                # a stream: the status line is what matters, do not wait for its end
                response = client.send(request, stream=True)
                response.close()
            else:
                response = client.send(request)
        except httpx.LocalProtocolError:
            calls -= 1  # e.g. a header value h11 will not send ("Bearer "): never sent
            return
        except httpx.HTTPError as exc:
            errors.append(f"{operation.label}: {type(exc).__name__}: {exc}")
            return
        if response.status_code >= 500:
            errors.append(f"{operation.label} -> {response.status_code}: {request.method} "
                          f"{request.url} {request.content[:300]!r}: {response.text[:300]}")

    with contextlib.suppress(Unsatisfiable):  # e.g. no negative cases without parameters
        check()
    return calls


def _str_headers(headers: Any) -> dict[str, str]:
    out = {}
    for key, value in (headers or {}).items():
        try:
            str(key).encode("latin-1")
            str(value).encode("latin-1")
        except UnicodeEncodeError:
            continue  # httpx refuses these before sending: not the server's business
        if "\n" in str(value) or "\r" in str(value) or "\n" in str(key):
            continue
        out[str(key)] = str(value)
    return out


def _content(kwargs: dict[str, Any]) -> bytes | None:
    if "json" in kwargs:
        return json.dumps(kwargs["json"]).encode()
    data = kwargs.get("data")
    if data is None:
        data = kwargs.get("content")
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, bytes | bytearray):
        return bytes(data)
    return None if data is None else json.dumps(data).encode()


# --------------------------------------------------------------------------- protocol fuzzing

FRAGMENTS = [
    "<thought>", "</thought>", "<response>", "</response>", '<response final="false">',
    '<action type="tool" mode="async" id="fz">', '<action id="fz" depends_on="fz">',
    '<action type="tool" mode="sync">', "</action>", "<context_feed>", "</context_feed>",
    "<result>", "</result>", '{"name": "echo", "parameters": {"message": "$fz"}}',
    '{"name": "calculator", "parameters": {"expression": "2**10"}}', '{"name": ', "}}}}",
    "[[[[", "$", "${", "${fz.", "$$", "<", ">", "<<>>", "</", "<action", '="', "'", "\x00",
    "\ufeff", "\u202e", "\ud7ff", "&amp;", "<!--", "-->", "<![CDATA[", "]]>", "\n", "\r\n",
    '<action id="" type="">', "<thought><thought><thought>", 'timeout="0.5"', 'retry="2"',
    '{"name": "python", "parameters": {"code": "print(1)"}}', "// comment\n", "/* x */", ",]",
]


def _corpus() -> list[str]:
    docs = [p.read_text() for p in sorted(CORPUS.glob("*.xml"))]
    return docs or [action("a", "echo", {"message": "hi"}) + "<response>$a</response>"]


@st.composite
def mutated_documents(draw: st.DrawFn) -> str:
    """A corpus document (or a short synthetic one) with a few random mutations."""
    corpus = _corpus()
    base = draw(st.sampled_from([*corpus, action("fz", "echo", {"message": "x"}),
                                 "<thought>t</thought><response>r</response>"]))
    text = base
    for _ in range(draw(st.integers(1, 6))):
        how = draw(st.sampled_from(["insert", "delete", "duplicate", "replace", "truncate"]))
        i = draw(st.integers(0, len(text)))
        j = draw(st.integers(i, min(len(text), i + 200)))
        if how == "insert":
            piece = draw(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=20)))
            text = text[:i] + piece + text[i:]
        elif how == "delete":
            text = text[:i] + text[j:]
        elif how == "duplicate":
            text = text[:i] + text[i:j] * draw(st.integers(2, 4)) + text[i:]
        elif how == "replace":
            text = text[:i] + draw(st.sampled_from(FRAGMENTS)) + text[j:]
        else:
            text = text[:i]
    return text


def test_fuzzed_documents_never_5xx_and_accepted_jobs_end(stack: Any) -> None:
    accepted: list[str] = []
    seen: dict[int, int] = {}
    with httpx.Client(timeout=30) as client:

        @settings(max_examples=60, deadline=None, database=None, phases=[Phase.generate],
                  derandomize=True, suppress_health_check=list(HealthCheck))
        @given(doc=mutated_documents())
        def check(doc: str) -> None:
            body = {"protocol": doc}
            validated = client.post(f"{stack.url}/v1/validate", json=body)
            assert validated.status_code == 200, (validated.status_code, validated.text, doc)
            report = validated.json()
            assert {"actions", "errors", "warnings"} <= set(report)
            submitted = client.post(f"{stack.url}/v1/jobs", json=body)
            seen[submitted.status_code] = seen.get(submitted.status_code, 0) + 1
            assert submitted.status_code in (202, 422), (submitted.status_code,
                                                         submitted.text, doc)
            if submitted.status_code == 202:
                accepted.append(submitted.json()["id"])
            else:
                assert submitted.json()["detail"]["errors"], submitted.text

        check()
    print(f"fuzzed documents: {seen}")
    assert seen.get(202, 0) >= 1, seen  # some mutations still run
    status = wait_ended(stack, accepted)
    assert set(status.values()) <= TERMINAL_STATUS


@pytest.mark.parametrize("raw", [
    b"", b"{", b"null", b"[]", b'"protocol"', b'{"protocol": 5}', b'{"protocol": null}',
    b'{"protocol": "x", "protocol": "y"}', b'{"protocol": "\\ud800"}', b"\xff\xfe\x00",
    b'{"protocol": "ok", "options": {"max_parallel": 1e400}}', b'{"protocol": "' + b"\\" + b'"}',
    b'{"protocol": "x", "agent": "y"}', b'{"protocol": "' + b"a" * 10 + b'", "extra": 1}',
    b'{"agent": "\\ud800", "input": "x"}', b'{"agent": "tester", "input": "\\udfff"}',
    b'{"workflow": "\\ud800"}', b'{"workflow": "w", "inputs": {"\\ud800": "\\ud800"}}',
    b'{"protocol": "x", "options": {"model": "\\ud800"}}',
])
def test_malformed_bodies_are_4xx(stack: Any, raw: bytes) -> None:
    for path in ("/v1/jobs", "/v1/validate"):
        response = httpx.post(f"{stack.url}{path}", content=raw,
                              headers={"Content-Type": "application/json"}, timeout=30)
        assert response.status_code < 500, (path, response.status_code, response.text)
        if response.status_code == 202:  # a lone surrogate decoded to a document: fine, runs
            wait_ended(stack, [response.json()["id"]])


def test_lone_surrogates_in_session_messages_are_4xx(stack: Any) -> None:
    created = httpx.post(f"{stack.url}/v1/sessions", content=b'{"agent": "\\ud800"}',
                         headers={"Content-Type": "application/json"}, timeout=30)
    assert created.status_code < 500, created.text
    session = httpx.post(f"{stack.url}/v1/sessions", json={"agent": "tester"}, timeout=30)
    assert session.status_code == 201, session.text
    message = httpx.post(f"{stack.url}/v1/sessions/{session.json()['id']}/messages",
                         content=b'{"content": "hi \\ud800"}',
                         headers={"Content-Type": "application/json"}, timeout=30)
    assert message.status_code < 500, message.text


# --------------------------------------------------------------------------- sizes


def test_oversize_body_is_413_by_length_and_while_streaming(stack: Any) -> None:
    big = b'{"protocol": "' + b"x" * (BODY_LIMIT + 10) + b'"}'
    for path in ("/v1/jobs", "/v1/validate"):
        declared = httpx.post(f"{stack.url}{path}", content=big,
                              headers={"Content-Type": "application/json"}, timeout=30)
        assert declared.status_code == 413, (path, declared.status_code, declared.text[:300])

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted while it is read
            for i in range(0, len(big), 64 * 1024):
                yield big[i:i + 64 * 1024]

        streamed = httpx.post(f"{stack.url}{path}", content=chunks(),
                              headers={"Content-Type": "application/json"}, timeout=30)
        assert streamed.status_code == 413, (path, streamed.status_code, streamed.text[:300])
    # a document over CORTEX_MAX_DOCUMENT_BYTES inside a body that is not over the body limit
    doc = "<response>" + "y" * MAX_DOCUMENT + "</response>"
    response = httpx.post(f"{stack.url}/v1/jobs", json={"protocol": doc}, timeout=30)
    assert response.status_code == 413, response.text[:300]
    assert response.json()["detail"]["limit"] == MAX_DOCUMENT
    assert httpx.get(f"{stack.url}/healthz").status_code == 200


def test_lying_content_length_does_not_hang_or_crash(stack: Any) -> None:
    """Content-Length says 10 bytes, 5 arrive, then the client goes away."""
    parts = urlsplit(stack.url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/validate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: 10\r\n\r\n{\"pro")
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(10)
        try:
            data = sock.recv(4096)  # an answer, or the server just closes the connection
        except ConnectionResetError:
            data = b""
    assert not data.startswith(b"HTTP/1.1 5"), data[:200]
    assert httpx.get(f"{stack.url}/healthz").status_code == 200


def test_huge_parameters_in_a_document_under_the_limit_run_and_are_capped(stack: Any) -> None:
    message = "z" * (MAX_DOCUMENT - 4096)  # the document stays under the limit
    doc = action("huge", "echo", {"message": message}) + "<response>done</response>"
    assert len(doc.encode()) < MAX_DOCUMENT
    job_id, events = run(stack, doc)
    assert events[-1]["type"] == "job_completed", events[-1]
    done = one(events, "action_completed", "huge")["data"]
    assert done["truncated"] is True
    assert len(json.dumps(done["result"]).encode()) < MAX_OUTPUT + 4096
    stored = httpx.get(f"{stack.url}/v1/jobs/{job_id}", timeout=30).json()
    assert len(json.dumps(stored).encode()) < MAX_DOCUMENT + 2 * MAX_OUTPUT


# --------------------------------------------------------------------------- nesting


DEPTH = 100_000


def test_deeply_nested_request_body_is_4xx(stack: Any) -> None:
    nested = b"[" * DEPTH + b"]" * DEPTH
    bodies = [nested, b'{"protocol": "x", "options": ' + nested + b"}",
              b'{"protocol": ' + nested + b"}", b'{"a":' * DEPTH + b"1" + b"}" * DEPTH]
    for path in ("/v1/jobs", "/v1/validate"):
        for body in bodies:
            response = httpx.post(f"{stack.url}{path}", content=body,
                                  headers={"Content-Type": "application/json"}, timeout=60)
            assert 400 <= response.status_code < 500, (path, body[:40], response.status_code,
                                                      response.text[:300])
    assert httpx.get(f"{stack.url}/healthz").status_code == 200


def test_deeply_nested_action_body_is_invalid_json(stack: Any) -> None:
    params = "[" * DEPTH + "]" * DEPTH
    doc = (f'<action type="tool" mode="async" id="deep">'
           f'{{"name": "echo", "parameters": {{"message": {params}}}}}</action>')
    validated = httpx.post(f"{stack.url}/v1/validate", json={"protocol": doc}, timeout=60)
    assert validated.status_code == 200, validated.text[:300]
    assert "invalid_json" in {e["kind"] for e in validated.json()["errors"]}
    submitted = httpx.post(f"{stack.url}/v1/jobs", json={"protocol": doc}, timeout=60)
    assert submitted.status_code == 422, submitted.text[:300]
    assert "invalid_json" in {e["kind"] for e in submitted.json()["detail"]["errors"]}
    # the same depth in the document's text (not in an action): plain text, runs
    text_doc = "<response>" + "[" * DEPTH + "</response>"
    _, events = run(stack, text_doc)
    assert events[-1]["type"] == "job_completed"
    assert one(events, "response_end")["data"]["text"] == "[" * DEPTH


# --------------------------------------------------------------------------- XML entities


def test_xml_entities_are_never_expanded(stack: Any) -> None:
    laughs = "".join(f'<!ENTITY l{i} "&l{i - 1};&l{i - 1};&l{i - 1};&l{i - 1};">'
                     for i in range(1, 10))
    doctype = f'<!DOCTYPE x [<!ENTITY a "EXPANDED"><!ENTITY l0 "lol">{laughs}' \
              f'<!ENTITY file SYSTEM "file:///etc/passwd">]>\n'
    body = {"name": "echo", "parameters": {"message": "&a; &l9; &file; &lt;&#65;&amp;"}}
    doc = (doctype
           + "<thought>thinking &a; &l9; &file; &#x41;</thought>\n"
           + f'<action type="tool" mode="async" id="ent">{json.dumps(body)}</action>\n'
           + "<response>said &a; &l9; &file; &lt;b&gt; $ent</response>")
    _, events = run(stack, doc)
    assert events[-1]["type"] == "job_completed", events[-1]
    assert one(events, "action_completed", "ent")["data"]["result"] == \
        "&a; &l9; &file; &lt;&#65;&amp;"
    thought = one(events, "thought_end")["data"]["text"]
    assert thought == "thinking &a; &l9; &file; &#x41;"
    response = one(events, "response_end")["data"]["text"]
    assert response == "said &a; &l9; &file; &lt;b&gt; &a; &l9; &file; &lt;&#65;&amp;"
    dump = json.dumps(events)
    assert "EXPANDED" not in dump.replace('ENTITY a \\"EXPANDED\\"', "")
    assert "lollol" not in dump and "root:" not in dump


# --------------------------------------------------------------------------- $ across jobs


def test_dollar_references_never_reach_another_jobs_variables(stack: Any) -> None:
    token = f"S3CRET-{uuid.uuid4().hex}"
    first = (action("leaky", "echo", {"message": {"x": token}}, output_key="cross_secret")
             + f"<response>{token}</response>")
    first_id, first_events = run(stack, first)
    assert first_events[-1]["type"] == "job_completed"
    probe = (action("probe", "echo", {"message": "$leaky ${leaky.x} $cross_secret "
                                                 f"${{{first_id}.leaky}}"})
             + "<response>$leaky ${leaky.x} $cross_secret ${cross_secret.x}</response>")
    second_id, events = run(stack, probe)
    assert events[-1]["type"] == "job_completed", events[-1]
    assert token not in json.dumps(events)
    result = one(events, "action_completed", "probe")["data"]["result"]
    assert result == f"$leaky ${{leaky.x}} $cross_secret ${{{first_id}.leaky}}"
    assert one(events, "response_end")["data"]["text"] == \
        "$leaky ${leaky.x} $cross_secret ${cross_secret.x}"
    stored = httpx.get(f"{stack.url}/v1/jobs/{second_id}", timeout=30).text
    assert token not in stored


def test_job_ids_are_not_guessable_paths(stack: Any) -> None:
    for job_id in ("..", "../..", "%2e%2e", "*", "job:*", "%00", "%ud800", "a" * 5000,
                   "' OR 1=1 --", "\u202e"):
        for suffix in ("", "/events", "/cancel"):
            method = "POST" if suffix == "/cancel" else "GET"
            response = httpx.request(method, f"{stack.url}/v1/jobs/{job_id}{suffix}", timeout=10)
            assert response.status_code < 500, (job_id, suffix, response.status_code)

