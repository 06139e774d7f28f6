"""Server-sent events, and how a provider reads them into pieces.

* `SSEParser` / `sse_events(lines)`: `(event name, data)` of each server-sent event.
* `Decoder`: a provider's reading of one streamed answer, an event at a time (the gateway's
  `ChatDecoder`, Anthropic's `MessagesDecoder`); `decode_lines` runs one over lines read in
  the caller's thread, `reader.follow` on the process's reader thread.
* `json_event`: an event's JSON object (by `pydantic_core.from_json`, three times faster than
  `json.loads` on a chat chunk: the reader decodes one per token).
* `Take`: what a stream's caller does with each piece (`hand_over`, the default: yield it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, TypeVar

import httpx
from pydantic_core import from_json

from cortex_worker.llm.stream import ModelError, Piece

__all__ = ["Decoder", "SSEParser", "T", "Take", "decode_lines", "hand_over", "json_event",
           "sse_events", "taken"]

T = TypeVar("T")
Take = Callable[[Piece], T | None]
"""What a stream's caller does with each piece, in whichever thread reads the stream: None when
it has dealt with the piece there, else work that the stream hands to the caller's thread."""


class SSEParser:
    """Server-sent events, one line at a time: `line` returns `(event, data)` when a line ends
    an event. The `event:` name is "message" when none was given; multi-line data is joined
    with newlines; comments and events without data are skipped."""

    __slots__ = ("data", "event")

    def __init__(self) -> None:
        self.data: list[str] = []
        self.event = "message"

    def line(self, line: str) -> tuple[str, str] | None:
        if not line:
            if not self.data:
                self.event = "message"
                return None
            done = self.event, "\n".join(self.data)
            self.data, self.event = [], "message"
            return done
        if line[0] == ":":
            return None
        field, _, value = line.partition(":")
        if field == "data":
            self.data.append(value[1:] if value[:1] == " " else value)
        elif field == "event":
            self.event = value[1:] if value[:1] == " " else value
        return None

    def end(self) -> tuple[str, str] | None:
        """The last event, when the stream ended without its blank line."""
        return self.line("")


def sse_events(lines: Iterable[str]) -> Iterator[tuple[str, str]]:
    """`(event, data)` of each server-sent event in `lines` (see `SSEParser`)."""
    parser = SSEParser()
    for line in lines:
        event = parser.line(line)
        if event is not None:
            yield event
    event = parser.end()
    if event is not None:
        yield event


class Decoder(Protocol):
    """A provider's reading of one streamed response, an event at a time: `event` returns
    the pieces an event completes (raising `ModelError` on a bad one), `end` those left when
    the body has ended (raising `ModelError` if the message never finished)."""

    finished: bool
    """The message is whole: a failure after this loses only its trailer (usage)."""
    done: bool
    """The provider's last event was read: whatever follows is ignored."""

    def event(self, name: str, data: str) -> list[Piece]: ...

    def end(self) -> list[Piece]: ...


def decode_lines(decoder: Decoder, lines: Iterable[str]) -> Iterator[Piece]:
    """The pieces of a response read line by line in this thread (`Response.iter_lines`)."""
    try:
        for name, data in sse_events(lines):
            yield from decoder.event(name, data)
            if decoder.done:
                break
    except httpx.HTTPError:
        if not decoder.finished:
            raise
    yield from decoder.end()


def json_event(url: str, data: str) -> dict[str, Any] | None:
    """An event's data as a JSON object (None: other JSON, which providers skip); data that
    is not JSON is a retryable `ModelError` (the stream is broken)."""
    try:
        value = from_json(data)
    except ValueError:
        raise ModelError(f"model endpoint {url} sent an event that is not JSON: "
                         f"{data[:200]!r}", retryable=True) from None
    return value if isinstance(value, dict) else None


def hand_over(piece: Piece) -> Piece:
    """The default `take`: every piece goes to the caller's thread as it is."""
    return piece


def taken(pieces: Iterable[Piece], take: Take[T]) -> Iterator[T]:
    """What `take` hands over of `pieces`, read in this thread (a replayed transcript)."""
    for piece in pieces:
        result = take(piece)
        if result is not None:
            yield result
