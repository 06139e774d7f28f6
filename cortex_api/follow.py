"""Following a job in the terminal: live thoughts, an action table, and a closing timeline.

`JobView` folds a job's events (docs/runtime.md#events) into what the terminal shows; it
does no I/O, so it can be fed synthetic events. `follow_job` streams the events from the
API with `cortex_api.client` (resuming after a dropped connection) and shows them:

- on a terminal, a live view: the last lines of the thought (or response) being written, and
  a table of the actions with their state, start offset and duration;
- elsewhere (a pipe, CI logs), one line per thought line and per action start and end.

Both end with the responses, the job's outcome, a timeline of the actions (a text Gantt
chart) and the parallel speedup.
"""

from __future__ import annotations

import math
import textwrap
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.markdown import Markdown
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from cortex_api.client import Client
from cortex_worker.protocol.events import (
    ACTION_END_EVENTS,
    ACTION_FAILED,
    ACTION_TERMINAL,
    TERMINAL_EVENTS,
    ActionStatus,
    EventType,
)

# An action's row also shows the view's own states: `parsed` (not registered yet) and
# `retrying` (between two attempts).
STYLE = {ActionStatus.ok: "green", ActionStatus.error: "red", ActionStatus.timeout: "red",
         ActionStatus.skipped: "yellow", ActionStatus.cancelled: "yellow",
         ActionStatus.running: "cyan", ActionStatus.queued: "blue", "retrying": "yellow",
         "parsed": "dim"}
THOUGHT_KEEP = 8000  # characters of thought text kept for the live view

# Timeline glyphs: </action> parsed, waiting (dependencies, queue, retry back-off), running,
# ended badly (error, timeout), never ran (skipped, cancelled), the model writing a turn.
GLYPHS = {"parsed": "◆", "wait": "·", "run": "█", "failed": "✗", "not_run": "○", "model": "━"}
ASCII_GLYPHS = {"parsed": "^", "wait": ".", "run": "#", "failed": "x", "not_run": "o", "model": "="}


def stream_events(base_url: str, job_id: str,
                  headers: Mapping[str, str]) -> Iterator[dict[str, Any]]:
    """The job's events from the API, as `JobView.apply` takes them, until its last one."""
    with Client(base_url, headers=headers) as client:
        for event in client.events(job_id):
            yield event.model_dump()


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The spans merged where they overlap, sorted."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """How long two sets of spans (each already merged) overlap."""
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


class JobView:
    """What the terminal shows of a job, folded from its events (`apply` them in order)."""

    def __init__(self) -> None:
        self.actions: dict[str, dict[str, Any]] = {}
        self.turns: dict[int, dict[str, Any]] = {}  # turn -> {start, end (of writing), tokens}
        self.thought = ""          # the tail of everything thought so far, turns apart
        self.response = ""         # the response being written, until its response_end
        self.responses: list[str] = []
        self.finals: list[bool] = []  # whether each of `responses` was final
        self.end: dict[str, Any] | None = None
        self.t0: float | None = None    # the job's start (job_started, else the first event)
        self.last_ts: float | None = None
        self.skew = 0.0  # server clock minus local clock, for the live durations

    # ------------------------------------------------------------------ folding

    def apply(self, event: dict[str, Any]) -> None:
        kind, data, ts = event["type"], event.get("data") or {}, float(event["ts"])
        self.skew = ts - time.time()
        self.last_ts = ts if self.last_ts is None else max(self.last_ts, ts)
        if kind == EventType.job_started or self.t0 is None:
            self.t0 = ts
        if kind == EventType.thought_chunk:
            self.thought = (self.thought + data.get("text", ""))[-THOUGHT_KEEP:]
        elif kind == EventType.thought_end:
            self.thought = self.thought.rstrip() + "\n\n"
        elif kind == EventType.response_chunk:
            self.response += data.get("text", "")
        elif kind == EventType.response_end:
            self.responses.append(data.get("text", ""))
            self.finals.append(bool(data.get("final", True)))
            self.response = ""
        elif kind == EventType.turn_started:
            self.turns[int(data["turn"])] = {"start": ts, "end": None, "tokens": None}
        elif kind == EventType.usage:  # the turn's model stream has ended
            turn = self.turns.get(int(data.get("turn", 0)))
            if turn is not None:
                turn["end"] = turn["end"] or ts
                turn["tokens"] = data.get("completion_tokens")
        elif kind == EventType.turn_completed:
            turn = self.turns.get(int(data.get("turn", 0)))
            if turn is not None and turn["end"] is None:
                turn["end"] = ts
        elif kind == EventType.action_parsed:
            a = data["action"]
            self.actions[a["id"]] = {
                "id": a["id"], "type": a.get("type", "tool"), "name": a.get("name", "?"),
                "mode": a.get("mode", "sync"), "status": "parsed", "parsed": ts, "queued": None,
                "start": None, "end": None, "runs": [], "attempts": 0, "error": None}
        elif kind.startswith("action_") and data.get("action_id") in self.actions:
            self._action(kind, data, ts, self.actions[data["action_id"]])
        elif kind in TERMINAL_EVENTS:
            self.end = event
            for turn in self.turns.values():
                turn["end"] = turn["end"] or ts

    def _action(self, kind: str, data: dict[str, Any], ts: float, row: dict[str, Any]) -> None:
        runs: list[list[float | None]] = row["runs"]
        if kind == EventType.action_queued:
            row["status"], row["queued"] = ActionStatus.queued, row["queued"] or ts
        elif kind == EventType.action_started:
            row["status"], row["attempts"] = ActionStatus.running, row["attempts"] + 1
            row["start"] = row["start"] or ts
            runs.append([ts, None])
        elif kind == EventType.action_retrying:
            row["status"], row["error"] = "retrying", data.get("error")
            if runs and runs[-1][1] is None:
                runs[-1][1] = ts
        elif kind in ACTION_END_EVENTS:
            row["status"] = data.get("status") or ACTION_END_EVENTS[kind]
            row["end"] = ts
            row["error"] = data.get("error") or data.get("reason") or row["error"]
            if runs and runs[-1][1] is None:
                runs[-1][1] = ts

    # ------------------------------------------------------------------ figures

    def offset(self, ts: float | None) -> float | None:
        """Seconds since the job started."""
        return None if ts is None or self.t0 is None else ts - self.t0

    def now(self) -> float:
        """The server's clock now (as far as the events tell), for what is still running."""
        return time.time() + self.skew

    def duration(self, row: dict[str, Any], now: float | None = None) -> float | None:
        """Seconds the action has run (every attempt), None if it never started."""
        if not row["runs"]:
            return None
        return sum((end if end is not None else (now or self.now())) - start
                   for start, end in row["runs"])

    def spans(self) -> list[tuple[float, float]]:
        """Every finished run of every action, as (start, end) server timestamps."""
        return [(s, e) for row in self.actions.values() for s, e in row["runs"]
                if e is not None]

    def writing(self) -> list[tuple[float, float]]:
        """When the model was writing (each turn from its start to the end of its stream)."""
        return _union([(t["start"], t["end"]) for t in self.turns.values() if t["end"]])

    def speedup(self) -> tuple[float, float, float]:
        """(action time, time with at least one action running, their ratio)."""
        spans = self.spans()
        busy, covered = sum(e - s for s, e in spans), _length(_union(spans))
        return busy, covered, (busy / covered if covered > 0 else 1.0)

    def summary(self) -> str:
        """The parallel speedup in one line (two when the model wrote while actions ran)."""
        spans = self.spans()
        if not spans:
            return "no action ran"
        busy, covered, speedup = self.speedup()
        ran = len([r for r in self.actions.values() if r["runs"]])
        makespan = max(e for _, e in spans) - min(s for s, _ in spans)
        line = (f"parallel speedup {speedup:.2f}×: {ran} action{'' if ran == 1 else 's'} ran {busy:.3f} s in {covered:.3f} s "
                f"with at least one running (first start to last end {makespan:.3f} s)")
        writing = self.writing()
        if writing and covered > 0:
            both = _intersection(_union(spans), writing)
            line += (f"\nthinking while acting: for {both:.3f} s of those {covered:.3f} s "
                     f"({100 * both / covered:.0f}%) the model was writing at the same time")
        return line

    # ------------------------------------------------------------------ rendering

    def table(self, now: float | None = None) -> Table:
        """The actions: type, name, state, when the </action> was parsed and the action
        started (seconds since the job started), and how long it ran."""
        now = now if now is not None else self.now()
        table = Table(title="actions", title_justify="left", expand=False)
        for column, justify in (("id", "left"), ("type", "left"), ("name", "left"),
                                ("state", "left"), ("parsed", "right"), ("started", "right"),
                                ("seconds", "right")):
            table.add_column(column, justify=justify)  # type: ignore[arg-type]
        for row in self.actions.values():
            seconds = self.duration(row, now)
            shown = "" if seconds is None else f"{seconds:.3f}"
            if row["status"] == ActionStatus.running:
                shown += "…"
            state = row["status"] + (f" ×{row['attempts']}" if row["attempts"] > 1 else "")
            table.add_row(row["id"], row["type"], row["name"],
                          Text(state, style=STYLE.get(row["status"], "")),
                          _plus(self.offset(row["parsed"])), _plus(self.offset(row["start"])),
                          shown)
        return table

    def thought_lines(self, width: int, lines: int = 6) -> list[str]:
        """The last `lines` lines of the thought, wrapped to `width`."""
        return _tail_lines(self.thought.strip(), width, lines)

    def render(self, width: int = 80, lines: int = 6) -> Group:
        """The live view: the text being written and the action table."""
        if self.response.strip():
            title = "response"
            body = Text("\n".join(_tail_lines(self.response.strip()[-4000:], width - 4, lines)))
        else:
            title = "thinking" + (f" · turn {max(self.turns)}" if self.turns else "")
            body = Text("\n".join(self.thought_lines(width - 4, lines)), style="dim italic")
        elapsed = self.offset(self.last_ts if self.end else self.now())
        running = sum(1 for r in self.actions.values() if r["status"] == ActionStatus.running)
        subtitle = (f"{elapsed or 0:.1f} s · {len(self.actions)} actions, {running} running"
                    if self.t0 is not None else "waiting for the job to start")
        panel = Panel(body, title=title, title_align="left", subtitle=subtitle,
                      subtitle_align="right", width=width, height=lines + 2)
        return Group(panel, self.table())

    def timeline(self, width: int = 100, ascii_only: bool = False,
                 columns: int | None = None) -> list[Text]:
        """A text Gantt chart, `width` characters wide (or with a bar of `columns` cells): a
        row per model turn and per action, in order of time, scaled to the job's duration.

        For an action, `◆` marks when its `</action>` was parsed, `·` the wait for its
        dependencies or a worker, `█` each run (from started to finished), `✗` an end in
        error or timeout, `○` an action that never ran (skipped or cancelled). A model row
        (`━`) spans a turn from its start to the end of the model's stream.
        """
        glyph = ASCII_GLYPHS if ascii_only else GLYPHS
        if self.t0 is None:
            return [Text("timeline: no events")]
        t0, last = self.t0, self.last_ts or self.t0
        ends = [last] + [e for row in self.actions.values() for _, e in row["runs"] if e is not None]
        total = max(max(ends) - t0, 1e-6)

        # (sort key, label, name, [(glyph, style, from ts, to ts)], note)
        rows: list[tuple[float, str, str, list[tuple[str, str, float, float]], str]] = []
        for number, turn in sorted(self.turns.items()):
            end = turn["end"] or last
            note = f"{end - turn['start']:.2f} s" + (f", {turn['tokens']} tokens"
                                                     if turn["tokens"] else "")
            rows.append((turn["start"], f"turn {number}", "model",
                         [(glyph["model"], "magenta", turn["start"], end)], note))
        for row in self.actions.values():
            marks: list[tuple[str, str, float, float]] = []
            first = row["start"] if row["start"] is not None else (row["end"] or last)
            marks.append((glyph["wait"], "dim", row["parsed"], first))
            marks.append((glyph["parsed"], "bold", row["parsed"], row["parsed"]))
            style = STYLE.get(row["status"], "cyan") if row["status"] in ACTION_TERMINAL else "cyan"
            marks += [(glyph["run"], style, s, e if e is not None else last) for s, e in row["runs"]]
            if row["status"] in ACTION_FAILED and row["end"] is not None:
                at = row["runs"][-1][0] if row["runs"] else row["end"]  # on the last run's end
                marks.append((glyph["failed"], "red", at, row["end"]))
            elif not row["runs"] and row["end"] is not None:
                marks.append((glyph["not_run"], "yellow", row["end"], row["end"]))
            seconds = self.duration(row, last)
            note = row["status"] if seconds is None else f"{seconds:.2f} s"
            if row["start"] is not None and row["start"] - row["parsed"] >= 0.05:
                note += f" (waited {row['start'] - row['parsed']:.2f} s)"
            rows.append((row["parsed"], row["id"], row["name"], marks, note))

        ident = max([len(r[1]) for r in rows] + [len("timeline")])
        name = max([len(r[2]) for r in rows] + [4])
        if columns is None:
            columns = max(10, width - ident - name - 5 - max([len(r[4]) for r in rows] + [0]))
        scale = total / columns

        def col(ts: float) -> int:  # the cell holding the instant ts
            return min(columns - 1, max(0, int((ts - t0) / scale)))

        def last_col(start: float, end: float) -> int:  # the last cell [start, end) touches
            return max(col(start), min(columns - 1, math.ceil((end - t0) / scale - 1e-9) - 1))

        left, right = ("|", "|") if ascii_only else ("▕", "▏")
        span = f"{total:.2f} s"
        out = [Text(f"{'timeline':<{ident}} {'':<{name}}  0 s{span:>{max(columns - 2, len(span) + 1)}}",
                    style="bold")]
        for _, label, what, marks, note in sorted(rows, key=lambda r: r[0]):
            cells: list[tuple[str, str]] = [(" ", "")] * columns
            for char, style, start, end in marks:
                if char == glyph["wait"]:  # strictly between the parse and the first run
                    targets = range(col(start) + 1, col(end))
                elif char == glyph["failed"]:  # the last cell of the failed run
                    targets = range(last_col(start, end), last_col(start, end) + 1)
                else:
                    targets = range(col(start), last_col(start, end) + 1)
                for c in targets:
                    cells[c] = (char, style)
            line = Text(f"{label:<{ident}} {what:<{name}} {left}")
            for char, style in cells:
                line.append(char, style=style)
            line.append(f"{right} {note}")
            out.append(line)
        out.append(Text(f"{glyph['parsed']} </action> parsed  {glyph['wait']} waiting  "
                        f"{glyph['run']} running  {glyph['failed']} failed  {glyph['not_run']} "
                        f"not run  {glyph['model']} model writing  (1 column = {scale:.2f} s)",
                        style="dim"))
        return out


def _plus(offset: float | None) -> str:
    return "" if offset is None else f"+{offset:.2f}"


def _tail_lines(text: str, width: int, lines: int) -> list[str]:
    wrapped: list[str] = []
    for paragraph in text.split("\n"):
        wrapped.extend(textwrap.wrap(paragraph, max(width, 10)) or [""])
    return wrapped[-lines:]


class _Plain:
    """The line-by-line view for a console that is not a terminal (pipes, CI logs)."""

    def __init__(self, view: JobView, console: Console) -> None:
        self.view, self.console = view, console
        self.pending = ""  # thought text not yet ended by a newline

    def __call__(self, event: dict[str, Any]) -> None:
        kind, data = event["type"], event.get("data") or {}
        stamp = f"{self.view.offset(float(event['ts'])) or 0:6.2f}s"
        if kind == EventType.thought_chunk:
            self.pending += data.get("text", "")
            *done, self.pending = self.pending.split("\n")
            for line in done:
                self._thought(line)
        elif kind == EventType.thought_end:
            self._thought(self.pending)
            self.pending = ""
        elif kind == EventType.turn_started:
            self._print(f"{stamp}  ── turn {data.get('turn')}", "bold")
        elif kind == EventType.action_started or kind in ACTION_END_EVENTS:
            row = self.view.actions.get(data.get("action_id", ""))
            if row is None:
                return
            what = f"{row['id']} ({row['type']} {row['name']})"
            if kind == EventType.action_started:
                waited = float(event["ts"]) - row["parsed"]
                self._print(f"{stamp}  ▶ {what} started, {waited:.2f} s after its </action>",
                            "cyan")
            else:
                seconds = self.view.duration(row, float(event["ts"]))
                took = f" in {seconds:.3f} s" if seconds is not None else ""
                ok = row["status"] == ActionStatus.ok
                error = f": {row['error']}" if row["error"] and not ok else ""
                mark = "✓" if ok else "✗"
                self._print(f"{stamp}  {mark} {what} {row['status']}{took}{error}",
                            STYLE.get(row["status"], ""))

    def _thought(self, line: str) -> None:
        for part in textwrap.wrap(line, max(self.console.width - 4, 20)) or ([""] if line else []):
            self._print(f"  │ {part}", "dim italic")

    def _print(self, text: str, style: str) -> None:
        self.console.print(Text(text, style=style), highlight=False, soft_wrap=True)


def follow_job(base_url: str, job_id: str, console: Console, headers: Mapping[str, str],
               live: bool | None = None) -> JobView:
    """Show the job until it ends, then its timeline; return what was seen. `headers` are
    a `Client`'s (`client.headers`: its key).

    `live`: the live view (default: when the console is a terminal), else one line per
    thought line and per action start and end.
    """
    view = JobView()
    if live if live is not None else console.is_terminal:
        width = min(console.width, 120)
        lock = threading.Lock()  # Live renders from its own thread

        def render() -> Group:
            with lock:
                return view.render(width)

        with Live(console=console, refresh_per_second=8, transient=False, get_renderable=render):
            for event in stream_events(base_url, job_id, headers):
                with lock:
                    view.apply(event)
    else:
        plain = _Plain(view, console)
        for event in stream_events(base_url, job_id, headers):
            view.apply(event)
            plain(event)
        console.print(view.table(view.last_ts))
    print_outcome(view, console)
    return view


def print_outcome(view: JobView, console: Console) -> None:
    """The responses, how the job ended, the timeline and the speedup."""
    for text, final in zip(view.responses, view.finals, strict=True):
        console.rule("answer" if final else "response (not final)")
        if final and console.is_terminal:  # rendered, wrapped to the terminal's width
            console.print(Markdown(text.strip()), soft_wrap=False)
        elif final:  # a pipe or a log: the answer as the model wrote it, never cut or re-wrapped
            console.print(Text(text.strip()))
        else:
            console.print(Text(text.strip(), style="dim"))
    if view.end:
        data = view.end["data"]
        style = "green" if view.end["type"] == EventType.job_completed else "red"
        took = view.offset(float(view.end["ts"]))
        console.print(f"[{style}]{view.end['type']}[/] after {took or 0:.2f} s "
                      f"{data.get('error') or data.get('reason') or ''}".rstrip(),
                      highlight=False)
    if view.actions or view.turns:
        console.print()
        encoding = (console.encoding or "").lower()
        for line in view.timeline(min(console.width, 160), ascii_only=not encoding.startswith("utf")):
            console.print(line, highlight=False, soft_wrap=True)
    console.print(view.summary(), highlight=False)
