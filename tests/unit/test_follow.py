"""The terminal view of a job (cortex_api.follow): folding events, the timeline, the output."""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
from rich.console import Console

from cortex_api import follow
from cortex_api.follow import JobView

pytestmark = pytest.mark.unit

T0 = 1_800_000_000.0


class Events:
    """Synthetic job events, `ts` counted in seconds from T0."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def add(self, at: float, event_type: str, /, **data: Any) -> Events:
        self.items.append({"job_id": "j", "seq": len(self.items) + 1, "ts": T0 + at,
                           "type": event_type, "data": data})
        return self

    def action(self, at: float, ident: str, name: str = "echo", kind: str = "tool",
               mode: str = "async") -> Events:
        return self.add(at, "action_parsed", action={"id": ident, "type": kind, "mode": mode,
                                                     "name": name, "parameters": {}})

    def ran(self, ident: str, parsed: float, start: float, end: float, name: str = "echo",
            status: str = "ok") -> Events:
        self.action(parsed, ident, name).add(parsed, "action_queued", action_id=ident)
        self.add(start, "action_started", action_id=ident, attempt=1, worker="w:1")
        if status == "ok":
            return self.add(end, "action_completed", action_id=ident, status="ok",
                            duration_ms=(end - start) * 1000, result=None)
        return self.add(end, "action_failed", action_id=ident, status=status,
                        duration_ms=(end - start) * 1000, error="boom")

    def view(self) -> JobView:
        view = JobView()
        for event in sorted(self.items, key=lambda e: e["ts"]):
            view.apply(event)
        return view


def agent_job() -> Events:
    """Two turns; a and b overlap, c runs alone in turn 2; the job lasts 10 s."""
    ev = Events().add(0, "job_queued", kind="agent").add(0, "job_started", kind="agent")
    ev.add(0, "turn_started", turn=1).add(0.5, "thought_chunk", text="Start a and b.\n")
    ev.ran("a", parsed=1, start=2, end=4, name="python").ran("b", parsed=1.5, start=3, end=5)
    ev.add(4.5, "thought_chunk", text="Both run.").add(6, "thought_end", text="Start a and b. Both run.")
    ev.add(6, "usage", turn=1, prompt_tokens=10, completion_tokens=120)
    ev.add(6, "response_end", final=False, text="working: a=1").add(6, "turn_completed", turn=1)
    ev.add(6, "turn_started", turn=2).ran("c", parsed=7, start=7, end=8, name="kv.get")
    ev.add(9, "usage", turn=2, prompt_tokens=20, completion_tokens=40)
    ev.add(9.5, "response_end", final=True, text="## Done\n\na=**1**")
    ev.add(9.5, "turn_completed", turn=2)
    return ev.add(10, "job_completed", status="completed", result="Done", error=None, turns=2)


# ---------------------------------------------------------------- folding


def test_fold_an_agent_job() -> None:
    view = agent_job().view()
    assert view.t0 == T0 and view.end is not None and view.end["type"] == "job_completed"
    a = view.actions["a"]
    assert (a["type"], a["name"], a["status"]) == ("tool", "python", "ok")
    assert (view.offset(a["parsed"]), view.offset(a["start"]), view.offset(a["end"])) == (1, 2, 4)
    assert view.duration(a) == 2 and a["attempts"] == 1
    assert view.turns[1] == {"start": T0, "end": T0 + 6, "tokens": 120}
    assert view.turns[2]["end"] == T0 + 9  # the end of the model's stream, not of the turn
    assert view.thought == "Start a and b.\nBoth run.\n\n"
    assert view.responses == ["working: a=1", "## Done\n\na=**1**"]
    assert view.finals == [False, True]


def test_retries_failures_skips_and_refusals() -> None:
    ev = Events().add(0, "job_started", kind="document")
    ev.action(0, "r").add(0, "action_queued", action_id="r")
    ev.add(1, "action_started", action_id="r", attempt=1)
    ev.add(2, "action_retrying", action_id="r", attempt=1, status="error", error="flaky")
    ev.add(3, "action_started", action_id="r", attempt=2)
    ev.add(4, "action_completed", action_id="r", status="ok", duration_ms=1000, result=1)
    ev.ran("t", parsed=0, start=1, end=5, status="timeout")
    ev.action(0, "s").add(5, "action_skipped", action_id="s", reason="dependency t did not succeed")
    ev.action(0, "x").add(0, "action_queued", action_id="x")  # refused by the runtime: no start
    ev.add(0, "action_failed", action_id="x", status="error", duration_ms=0.0, error="not allowed")
    ev.action(0, "c").add(6, "action_cancelled", action_id="c")
    view = ev.view()
    r = view.actions["r"]
    assert r["status"] == "ok" and r["attempts"] == 2 and r["runs"] == [[T0 + 1, T0 + 2], [T0 + 3, T0 + 4]]
    assert view.duration(r) == 2  # the runs, not the back-off between them
    assert view.actions["t"]["status"] == "timeout" and view.actions["t"]["error"] == "boom"
    assert view.actions["s"]["status"] == "skipped"
    assert view.actions["s"]["error"] == "dependency t did not succeed"
    assert view.actions["x"]["status"] == "error" and view.duration(view.actions["x"]) is None
    assert view.actions["c"]["status"] == "cancelled"


def test_events_of_unknown_actions_are_ignored() -> None:
    view = Events().add(0, "action_started", action_id="ghost", attempt=1).view()
    assert view.actions == {} and view.summary() == "no action ran"


# ---------------------------------------------------------------- speedup


def test_summary_counts_time_with_at_least_one_action_running() -> None:
    view = agent_job().view()
    busy, covered, speedup = view.speedup()
    # a 2..4 and b 3..5 overlap: 4 s of action time in 3 s; c 7..8 adds 1 s to both.
    assert (busy, covered) == (5, 4) and speedup == 1.25
    lines = view.summary().splitlines()
    assert lines[0].startswith("parallel speedup 1.25×: 3 actions ran 5.000 s in 4.000 s")
    assert "first start to last end 6.000 s" in lines[0]
    # the model wrote 0..6 and 6..9: all 4 s with actions running overlap it
    assert lines[1] == ("thinking while acting: for 4.000 s of those 4.000 s (100%) the model "
                        "was writing at the same time")


def test_summary_of_instant_actions() -> None:
    ev = Events().add(0, "job_started", kind="agent").add(0, "turn_started", turn=1)
    ev.ran("a", 1, 1, 1).add(2, "usage", turn=1, completion_tokens=3)
    assert ev.view().summary().startswith("parallel speedup 1.00×: 1 action ran 0.000 s in 0.000 s")


def test_summary_of_a_document_has_no_writing_line() -> None:
    ev = Events().add(0, "job_started", kind="document")
    ev.ran("a", 0, 0, 1).ran("b", 0, 0, 1).ran("c", 0, 0, 1).add(1, "job_completed", status="completed")
    summary = JobView.summary(ev.view())
    assert summary.startswith("parallel speedup 3.00×: 3 actions ran 3.000 s in 1.000 s")
    assert "\n" not in summary


# ---------------------------------------------------------------- timeline


def bars(view: JobView, columns: int = 10, ascii_only: bool = False) -> dict[str, str]:
    """Each timeline row's label and its bar."""
    rows = {}
    for line in view.timeline(columns=columns, ascii_only=ascii_only)[1:-1]:
        text = line.plain
        match = re.match(rf"(\S+(?: \d+)?)\s+\S+\s+[▕|](.{{{columns}}})[▏|] (.*)$", text)
        assert match, text
        rows[match.group(1)] = match.group(2)
    return rows


def test_timeline_marks_parse_wait_run_and_model_turns() -> None:
    view = agent_job().view()  # 10 s on 10 columns: one column per second
    rows = bars(view)
    assert rows == {
        "turn 1": "━━━━━━    ",
        "a":      " ◆██      ",   # parsed at 1, runs from 2 to 4
        "b":      " ◆·██     ",   # parsed at 1.5 (column 1), waits, runs from 3 to 5
        "turn 2": "      ━━━ ",
        "c":      "       █  ",   # parsed and started at 7: the run covers the parse mark
    }
    lines = [line.plain for line in view.timeline(columns=10)]
    assert re.fullmatch(r"timeline +0 s +10\.00 s", lines[0])
    assert lines[0].index("0 s") == lines[1].index("▕") + 1  # over the first cell
    assert len(lines[0]) == lines[1].index("▏") + 1  # the total ends over the right edge
    assert "(waited 1.00 s)" in lines[2] and "2.00 s" in lines[2]
    assert lines[1].endswith("6.00 s, 120 tokens")
    assert lines[-1].startswith("◆ </action> parsed")
    # rows come in order of time: turn 1, a, b, turn 2, c
    assert [line.split()[0] + (line.split()[1] if line.startswith("turn") else "")
            for line in lines[1:-1]] == ["turn1", "a", "b", "turn2", "c"]


def test_timeline_failures_skips_and_ascii() -> None:
    ev = Events().add(0, "job_started", kind="document")
    ev.ran("bad", parsed=0, start=1, end=3, status="error")
    ev.action(0, "skip").add(4, "action_skipped", action_id="skip", reason="dependency bad")
    ev.add(10, "job_failed", status="failed", error="1 action(s) failed")
    view = ev.view()
    assert bars(view) == {"bad": "◆█✗       ", "skip": "◆···○     "}
    assert bars(view, ascii_only=True) == {"bad": "^#x       ", "skip": "^...o     "}
    assert view.timeline(columns=10, ascii_only=True)[-1].plain.startswith("^ </action> parsed")


def test_timeline_of_a_running_job_draws_up_to_the_last_event() -> None:
    ev = Events().add(0, "job_started", kind="agent").add(0, "turn_started", turn=1)
    ev.action(2, "long").add(2, "action_started", action_id="long", attempt=1)
    ev.add(5, "thought_chunk", text="still thinking")
    view = ev.view()
    assert bars(view, columns=5) == {"turn 1": "━━━━━", "long": "  ███"}
    assert view.actions["long"]["status"] == "running"


def test_timeline_width_fits_the_console() -> None:
    view = agent_job().view()
    for width in (60, 100, 140):
        lines = [line.plain for line in view.timeline(width)]
        assert max(len(line) for line in lines[:-1]) <= width


# ---------------------------------------------------------------- what the terminal shows


def test_render_shows_the_thought_tail_and_the_action_table() -> None:
    ev = Events().add(0, "job_started", kind="agent").add(0, "turn_started", turn=1)
    ev.add(0.1, "thought_chunk", text="\n".join(f"line {n} " + "word " * 30 for n in range(10)))
    ev.action(1, "a", "python").add(1, "action_queued", action_id="a")
    ev.add(1.5, "action_started", action_id="a", attempt=1)
    view = ev.view()
    console = Console(file=io.StringIO(), width=80)
    console.print(view.render(80, lines=4))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "thinking · turn 1" in out and "line 9" in out and "line 0" not in out
    assert re.search(r"│ a\s+│ tool\s+│ python\s+│ running\s+│\s+\+1\.00 │\s+\+1\.50 │ +[\d.]+… │", out)
    assert max(len(line) for line in out.splitlines()) <= 80


def test_render_shows_a_response_being_written() -> None:
    ev = Events().add(0, "job_started", kind="agent").add(0, "turn_started", turn=1)
    ev.add(0.1, "thought_chunk", text="hmm").add(0.2, "response_chunk", text="The answer is", final=True)
    console = Console(file=io.StringIO(), width=60)
    console.print(ev.view().render(60))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "response" in out and "The answer is" in out and "hmm" not in out


@pytest.mark.parametrize("live", [False, True])
def test_follow_job_prints_lines_responses_timeline_and_speedup(
    monkeypatch: pytest.MonkeyPatch, live: bool
) -> None:
    events = agent_job().items
    monkeypatch.setattr(follow, "stream_events", lambda url, job, headers: iter(events))
    console = Console(file=io.StringIO(), width=100, force_terminal=live, color_system=None)
    view = follow.follow_job("http://api", "j", console, {}, live=live)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert view.end is not None and view.end["type"] == "job_completed"
    if not live:  # the line-by-line log
        assert "│ Start a and b." in out and "│ Both run." in out
        assert re.search(r"2\.00s  ▶ a \(tool python\) started, 1\.00 s after its </action>", out)
        assert re.search(r"4\.00s  ✓ a \(tool python\) ok in 2\.000 s", out)
        assert "── turn 2" in out
    if live:  # markdown rendered to the terminal's width
        assert "working: a=1" in out and "Done" in out and "**" not in out
    else:  # a pipe or a log: the answer as the model wrote it
        assert "working: a=1" in out and "## Done\n\na=**1**" in out
    assert "job_completed after 10.00 s" in out
    assert re.search(r"^timeline\s+0 s\s+10\.00 s$", out, re.MULTILINE)
    assert re.search(r"^a\s+python\s+▕", out, re.MULTILINE)
    assert "parallel speedup 1.25×" in out and "thinking while acting" in out


def test_follow_job_without_a_terminal_is_the_default_for_pipes(monkeypatch: pytest.MonkeyPatch) -> None:
    events = agent_job().items
    monkeypatch.setattr(follow, "stream_events", lambda url, job, headers: iter(events))
    console = Console(file=io.StringIO(), width=100)  # a StringIO is not a terminal
    follow.follow_job("http://api", "j", console, {})
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "\x1b[" not in out and "▶ a (tool python) started" in out


def _answered(text: str) -> JobView:
    view = JobView()
    view.responses.append(text)
    view.finals.append(True)
    return view


LONG_ANSWER = ("## Findings\n\n- **The serial part** (Amdahl). A job that is 95% parallel runs 9.14× "
               "faster on 16 workers, and never more than 20.00×; simulating 3,000 such jobs "
               "gave 8.69×.\n- A second point.")


def test_an_answer_to_a_pipe_is_printed_as_written_never_cut_or_rewrapped() -> None:
    out = io.StringIO()
    follow.print_outcome(_answered(LONG_ANSWER), Console(file=out, width=80, soft_wrap=True))
    assert LONG_ANSWER in out.getvalue()


def test_an_answer_in_a_terminal_is_rendered_and_wrapped_to_its_width() -> None:
    out = io.StringIO()
    console = Console(file=out, width=40, soft_wrap=True, force_terminal=True, color_system=None)
    follow.print_outcome(_answered(LONG_ANSWER), console)
    lines = out.getvalue().splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 40
    words = " ".join(out.getvalue().split())
    assert "gave 8.69×" in words and "**" not in words  # every word, as Markdown renders it
