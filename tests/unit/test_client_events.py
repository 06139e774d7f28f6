"""The client's pure parts: decoding the server's SSE text, the resume state, and error bodies.

The wire text comes from the server's own encoder (`cortex_api.sse`), so a change of format on
one side shows here; the client against a real API is in tests/integration/test_client.py.
"""

from __future__ import annotations

import httpx
import pytest

from cortex_api.client import (
    APIError,
    ConnectionFailed,
    Event,
    InvalidRequest,
    JobTimeout,
    NotFound,
    ServerError,
    Unauthorized,
    Unavailable,
)
from cortex_api.client.errors import error_for
from cortex_api.client.events import EventStream
from cortex_api.sse import format_event, sse_comment, sse_message

pytestmark = pytest.mark.unit


def raw(seq: int, kind: str = "text", /, **data: object) -> dict[str, object]:
    return {"job_id": "j", "seq": seq, "ts": 1.5, "type": kind, "data": data}


def lines(*messages: str) -> list[str]:
    """Wire text as httpx's `iter_lines` gives it."""
    return "".join(messages).splitlines()


def feed(stream: EventStream, text: list[str]) -> list[Event]:
    decoder = stream.connected()
    return [e for line in text if (e := stream.receive(decoder, line)) is not None]


def test_the_server_wire_format_decodes_to_typed_events_and_comments_are_skipped() -> None:
    stream = EventStream("j")
    text = lines(format_event(raw(1, "job_queued", kind="document")), sse_comment("keep-alive"),
                 sse_message('{"job_id": "j", "seq": 2,\n"ts": 2, "type": "text", "data": {}}'),
                 format_event(raw(3, "job_completed", status="completed")))

    events = feed(stream, text)

    assert events == [Event(job_id="j", seq=1, ts=1.5, type="job_queued",
                            data={"kind": "document"}),
                      Event(job_id="j", seq=2, ts=2.0, type="text"),
                      Event(job_id="j", seq=3, ts=1.5, type="job_completed",
                            data={"status": "completed"})]
    assert stream.done and events[-1].terminal and not events[0].terminal


def test_a_resumed_stream_asks_after_the_last_event_and_drops_what_it_has_seen() -> None:
    stream = EventStream("j", after=0)
    assert stream.headers() == {}
    cut = lines(format_event(raw(1)), format_event(raw(2)))[:-1]  # event 2 without its blank line
    assert [e.seq for e in feed(stream, cut)] == [1]
    assert stream.dropped(httpx.RemoteProtocolError("incomplete chunked read")) == 0.1

    assert stream.headers() == {"Last-Event-ID": "1"}
    again = lines(format_event(raw(1)), format_event(raw(2)), format_event(raw(3, "job_failed")))
    assert [e.seq for e in feed(stream, again)] == [2, 3] and stream.done


def test_a_stream_closed_early_reconnects_unless_that_connection_brought_nothing() -> None:
    stream = EventStream("j", after=4)
    assert stream.path == "/v1/jobs/j/events" and stream.headers() == {"Last-Event-ID": "4"}
    feed(stream, lines(format_event(raw(5))))
    stream.closed()  # the server dropped a slow client: more may come
    assert not stream.done
    feed(stream, [])
    stream.closed()  # nothing after seq 5: the log has no more
    assert stream.done


def test_drops_back_off_then_fail_and_an_event_resets_the_count() -> None:
    stream = EventStream("j", retries=3, backoff=0.5, max_backoff=1.5)
    error = httpx.ConnectError("refused")
    assert [stream.dropped(error) for _ in range(3)] == [0.5, 1.0, 1.5]
    feed(stream, lines(format_event(raw(1))))
    assert [stream.dropped(error) for _ in range(3)] == [0.5, 1.0, 1.5]
    with pytest.raises(ConnectionFailed, match=r"failed 4 times in a row \(after seq 1\): refused"):
        stream.dropped(error)


def test_past_its_timeout_the_stream_raises_job_timeout() -> None:
    stream = EventStream("j", timeout=0)
    with pytest.raises(JobTimeout, match="did not end within 0 s"):
        stream.read_timeout(40)
    assert EventStream("j", timeout=5).read_timeout(40) <= 5
    assert EventStream("j").read_timeout(40) == 40


@pytest.mark.parametrize(("status", "body", "cls", "message"), [
    (404, {"detail": {"message": "job 'x' not found"}}, NotFound, "job 'x' not found"),
    (401, {"detail": {"message": "invalid API key"}}, Unauthorized, "invalid API key"),
    (404, {"detail": "Not Found"}, NotFound, "HTTP 404: Not Found"),  # a route that is not there
    (503, {"detail": {"message": "Redis is unavailable: refused"}}, Unavailable,
     "Redis is unavailable: refused"),
    (502, "<html>Bad Gateway</html>", Unavailable, "HTTP 502: <html>Bad Gateway</html>"),
    (500, "", ServerError, "HTTP 500: Internal Server Error"),
    (418, {"detail": {"message": "short and stout"}}, APIError, "short and stout"),
])
def test_an_error_response_becomes_its_class_with_the_api_message(
        status: int, body: object, cls: type[APIError], message: str) -> None:
    response = (httpx.Response(status, json=body) if isinstance(body, dict)
                else httpx.Response(status, text=body))
    error = error_for(response)
    assert type(error) is cls and error.status == status and error.message == message
    assert str(error) == message and error.errors == []


def test_a_rejection_keeps_every_problem_and_its_other_fields() -> None:
    problems = [{"kind": "unknown_tool", "message": "no tool named 'x'", "line": 1, "column": 1}]
    error = error_for(httpx.Response(422, json={"detail": {
        "message": "the document was rejected: ...", "errors": problems}}))
    assert isinstance(error, InvalidRequest) and isinstance(error, ValueError)
    assert error.errors == problems and error.detail["message"].startswith("the document")
