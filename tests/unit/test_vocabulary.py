"""The Lua scripts and the Python engine speak `protocol.events`' vocabulary, and nothing else.

The scripts spell statuses and event types as string literals; these tests read every script
under cortex_worker/store/lua, pull out each status it writes or compares and each event
type it logs, and check them against the enums, both ways: a word the scripts use must be a
member, and a member must be used by the scripts or by the Python engine.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

from cortex_api.routes import page
from cortex_worker.protocol import parser
from cortex_worker.protocol.events import (
    ACTION_TERMINAL,
    END_EVENTS,
    JOB_TERMINAL,
    TERMINAL_EVENTS,
    ActionStatus,
    Event,
    EventType,
    JobStatus,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
LUA = ROOT / "cortex_worker" / "store" / "lua"
ENGINE = ROOT / "cortex_worker"
VOCABULARY = ENGINE / "protocol" / "events.py"

#: `emit('action_' .. decision, ...)` in approval_decide.lua: the decisions it is given.
DECISIONS = ("approved", "rejected")

_WORD = r"'([a-z_]+)'"
#: Lua variables that hold a job's status (`HGET K_JOB 'status'`) in the scripts.
_JOB_VARS = r"(?:job_status|cur|ARGV\[3\])"
#: Lua variables that hold an action's status (`HGET K_STATUS id`, or settle's `status`).
_ACTION_VARS = r"(?:before|src_status|status)"
#: m_job_ended's test of the job's final status (its `status` is a job's, not an action's).
_JOB_ENDED = rf"if status == {_WORD} then return end"


@cache
def scripts() -> dict[str, str]:
    """Every script's text, by file name (comments dropped: they quote words freely)."""
    return {path.name: re.sub(r"--[^\n]*", "", path.read_text())
            for path in sorted(LUA.glob("*.lua"))}


def _all(pattern: str) -> set[str]:
    return {m for text in scripts().values() for m in re.findall(pattern, text)}


def _table(name: str) -> set[str]:
    """The keys of `local NAME = {a = true, ...}` in the prelude."""
    found = re.search(rf"local {name} = \{{([^}}]*)\}}", scripts()["prelude.lua"])
    assert found, f"{name} not found in prelude.lua"
    return set(re.findall(r"(\w+) = true", found.group(1)))


def lua_job_statuses() -> set[str]:
    """Job statuses the scripts write to the job record or compare it with."""
    written = _all(r"HSET', K_JOB, 'status', " + _WORD)
    read = _all(r"HGET', K_JOB, 'status'\) [~=]= " + _WORD)
    compared = {m for n, t in scripts().items() if n in ("claim.lua", "retry.lua", "close.lua")
                for m in re.findall(rf"(?<![\w.]){_JOB_VARS} [~=]= {_WORD}", t)}
    st = {m for n, t in scripts().items() if n in ("begin.lua", "resume.lua")
          for m in re.findall(rf"\bst [~=]= {_WORD}", t)}
    ended = set(re.findall(_JOB_ENDED, scripts()["prelude.lua"]))
    return written | read | compared | st | ended | _table("JOB_TERMINAL")


def lua_action_statuses() -> set[str]:
    """Action statuses the scripts write to the status hash, record or compare with."""
    written = _all(r"HSET', K_STATUS, \w+, " + _WORD)
    read = _all(r"HGET', K_STATUS, \w+\) [~=]= " + _WORD)
    compared = {m for text in scripts().values()
                for m in re.findall(rf"\b{_ACTION_VARS} [~=]= {_WORD}", re.sub(_JOB_ENDED, "", text))}
    st = {m for n, t in scripts().items() if n in ("redrive.lua", "close.lua", "register.lua")
          for m in re.findall(rf"\bst [~=]= {_WORD}", t)}
    records = _all(r'"status":"([a-z_]+)"') | _all(r"status = " + _WORD)
    ended = _all(r"m_ended\(\w+, " + _WORD) | _all(r"\{\w+, " + _WORD + r"\}")
    return written | read | compared | st | records | ended | _table("TERMINAL")


def lua_event_types() -> set[str]:
    """Event types the scripts log themselves (the rest come from Python as arguments)."""
    literal = _all(r"emit\(" + _WORD + r",")
    logged = _all(r"\{" + _WORD + r", '\{\"action_id\"")  # settle's event argument
    prefixed = {prefix + decision for prefix in _all(r"emit\(" + _WORD + r" \.\.")
                for decision in DECISIONS}
    return literal | logged | prefixed


@cache
def python_words() -> set[str]:
    """Every string constant and every `EventType.x` / `JobStatus.x` / `ActionStatus.x` name
    in the engine's Python code, but for the vocabulary itself."""
    words: set[str] = set()
    for path in ENGINE.rglob("*.py"):
        if path == VOCABULARY:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                words.add(node.value)
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id in ("EventType", "JobStatus", "ActionStatus")):
                words.add(node.attr)
            elif isinstance(node, ast.Name) and node.id == "END_EVENTS":  # jobs.end_job
                words |= set(END_EVENTS.values())
    return words


# ---------------------------------------------------------------- the tests


def test_the_extraction_finds_the_scripts_words() -> None:
    # a regex that silently matches nothing would make the checks below pass vacuously
    assert {"queued", "running", "finishing", "completed", "failed"} <= lua_job_statuses()
    assert {"pending", "waiting", "awaiting_approval", "queued", "running", "skipped",
            "cancelled"} <= lua_action_statuses()
    assert {"action_queued", "action_started", "action_skipped", "action_cancelled",
            "action_retrying", "approval_requested", "action_approved", "job_started",
            "warning"} <= lua_event_types()


def test_every_job_status_of_the_scripts_is_a_job_status() -> None:
    assert lua_job_statuses() - set(JobStatus) == set()


def test_every_action_status_of_the_scripts_is_an_action_status() -> None:
    assert lua_action_statuses() - set(ActionStatus) == set()


def test_every_event_type_the_scripts_log_is_an_event_type() -> None:
    assert lua_event_types() - set(EventType) == set()


def test_the_scripts_terminal_tables_are_the_vocabularys() -> None:
    assert _table("TERMINAL") == set(ACTION_TERMINAL)
    assert _table("JOB_TERMINAL") == set(JOB_TERMINAL)


def test_every_member_is_used_by_the_scripts_or_the_engine() -> None:
    used = lua_job_statuses() | lua_action_statuses() | lua_event_types() | python_words()
    unused = {m.value for enum in (JobStatus, ActionStatus, EventType) for m in enum} - used
    assert unused == set(), "members nothing writes or logs: drop them, or use them"


def test_the_parsers_event_kinds_are_event_types() -> None:
    kinds = {parser.TEXT, parser.THOUGHT_CHUNK, parser.THOUGHT_END, parser.ACTION_PARSED,
             parser.RESPONSE_CHUNK, parser.RESPONSE_END, parser.CONTEXT_FEED,
             parser.PROTOCOL_ERROR, parser.WARNING}
    assert kinds - set(EventType) == set()


def test_terminal_events_are_the_end_events_of_the_terminal_statuses() -> None:
    assert set(END_EVENTS) == set(JOB_TERMINAL)
    assert _table("JOB_END_EVENTS") == set(END_EVENTS.values())  # close.lua: usage goes on them
    assert sorted(TERMINAL_EVENTS) == ["job_cancelled", "job_completed", "job_failed"]


def test_an_event_reads_the_wire_shape_the_scripts_write() -> None:
    # prelude.lua's emit: {"job_id":..,"seq":..,"ts":..,"type":"..","data":..}
    wire = ('{"job_id":"j1","seq":7,"ts":1795373958.6077437,"type":"job_cancelled",'
            '"data":{"status":"cancelled","reason":"by request"}}')
    event = Event.model_validate_json(wire)
    assert (event.job_id, event.seq, event.type, event.data["reason"]) == (
        "j1", 7, EventType.job_cancelled, "by request")
    assert event.terminal
    assert Event.model_validate_json(event.model_dump_json()) == event
    later = Event.model_validate({"job_id": "j1", "seq": 8, "ts": 1.0, "type": "a_later_type"})
    assert (later.type, later.data, later.terminal) == ("a_later_type", {}, False)


def test_the_job_page_reads_the_vocabulary() -> None:
    """job.js gets the event types and terminal statuses with its config, and every event
    type and status it spells in its handlers is a member."""
    text = (ROOT / "cortex_api" / "page" / "job.js").read_text()
    read = set(re.findall(r"config\.((?:event_types|terminal_)\w*)", text))
    assert read == set(page.VOCABULARY) == {"event_types", "terminal_jobs", "terminal_actions"}
    assert page.VOCABULARY["event_types"] == list(EventType)
    cases = set(re.findall(r'case "([a-z_]+)":', text))
    assert len(cases) > 20 and cases - set(EventType) == set()
    actions = set(re.findall(r'setStatus\(a, "([a-z_]+)"\)', text))
    assert actions and actions - set(ActionStatus) == set()
    jobs = set(re.findall(r'setJobStatus\("([a-z_]+)"\)', text))
    assert jobs and jobs - set(JobStatus) == set()
