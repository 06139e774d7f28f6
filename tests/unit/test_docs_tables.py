"""The docs' tables of Redis keys, statuses and event types match the code they describe.

docs/architecture.md lists every Redis key (against `cortex_worker/store/keys.py`) and every
job status, action status and event type (against `cortex_worker/protocol/events.py`);
docs/runtime.md's events tables give every event type's `data`. A key or a word added to the
code without its row, or a row left behind by a removal, fails here.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from cortex_worker.protocol.events import (
    ACTION_TERMINAL,
    JOB_TERMINAL,
    ActionStatus,
    EventType,
    JobStatus,
)
from cortex_worker.store import keys

pytestmark = pytest.mark.unit

DOCS = Path(__file__).resolve().parents[2] / "docs"
ARCHITECTURE = DOCS / "architecture.md"
RUNTIME = DOCS / "runtime.md"


def tables(path: Path, section: str | None = None) -> dict[str, list[list[str]]]:
    """The markdown tables of `path` (within `## section`, if given): each by its first
    header cell, as rows of cells."""
    text = path.read_text(encoding="utf-8")
    if section is not None:
        found = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
        assert found, f"no section {section!r} in {path.name}"
        text = found.group(1)
    out: dict[str, list[list[str]]] = {}
    for block in re.findall(r"(?:^\|.*\|\n)+", text, re.M):
        lines = block.splitlines()
        header = _cells(lines[0])[0]
        out.setdefault(header, []).extend(_cells(line) for line in lines[2:])
    return out


def _cells(line: str) -> list[str]:
    # a `|` inside backticks (`<owner>|<expiry>`) is not a column break
    return [c.strip() for c in re.split(r"\|(?=(?:[^`]*`[^`]*`)*[^`]*$)", line.strip("|"))]


def first_word(row: list[str]) -> str:
    """The first `code` word of a row's first cell."""
    found = re.match(r"`([^`]*)`", row[0])
    assert found, f"a row that names nothing: {row}"
    return found.group(1)


def first_words(rows: list[list[str]]) -> set[str]:
    return {first_word(row) for row in rows}


def _shape(key: str) -> str:
    """A key with its placeholders blanked: `cx:alive:<host:pid>` and `cx:alive:<owner>` agree."""
    return re.sub(r"<[^>]*>", "<>", key)


def documented_keys() -> set[str]:
    """Every `cx:` key named in the first cell of architecture.md's key tables."""
    rows = tables(ARCHITECTURE, "Redis keys of a job")["key"]
    assert rows, "no key table under 'Redis keys of a job'"
    return {_shape(k) for row in rows for k in re.findall(r"`(cx:[^`]*)`", row[0])}


def code_keys() -> set[str]:
    """Every key and channel keys.py names: its `cx:` constants, each function's key or keys
    (its parameters as placeholders; cached functions too, such as `model_keys`) and each key
    of a job."""
    found = {value for name, value in vars(keys).items()
             if name.isupper() and isinstance(value, str) and value.startswith(f"{keys.PREFIX}:")}
    for name, function in vars(keys).items():
        plain = inspect.unwrap(function) if callable(function) else function
        if (inspect.isfunction(plain) and plain.__module__ == keys.__name__
                and name != "job_keys"):
            params = inspect.signature(plain).parameters
            named = plain(*(f"<{p}>" for p in params))
            found |= set(named) if isinstance(named, tuple) else {named}
    found |= set(keys.job_keys("job"))
    found.discard(keys.RELIC_KV_PREFIX)  # the prefix of `relic_kv_key`, listed as that
    return {_shape(k) for k in found}


def test_the_key_tables_name_every_key_of_keys_py_and_no_other() -> None:
    documented, code = documented_keys(), code_keys()
    assert code - documented == set(), "keys without a row in architecture.md"
    assert documented - code == set(), "rows of architecture.md for keys keys.py does not name"


def test_the_job_keys_row_names_every_action_status() -> None:
    rows = tables(ARCHITECTURE, "Redis keys of a job")["key"]
    row = next(r for r in rows if r[0] == "`cx:{job}:status`")
    assert set(re.findall(r"`([a-z_]+)`", row[2])) == set(ActionStatus)


def test_the_status_tables_are_the_vocabularys() -> None:
    found = tables(ARCHITECTURE, "Statuses and events")
    jobs, actions = found["job status"], found["action status"]
    assert first_words(jobs) == set(JobStatus)
    assert first_words(actions) == set(ActionStatus)
    assert {first_word(r) for r in jobs if "(terminal)" in r[1]} == set(JOB_TERMINAL)
    assert {first_word(r) for r in actions if "(terminal)" in r[1]} == set(ACTION_TERMINAL)


def test_the_event_table_of_the_architecture_is_the_vocabularys() -> None:
    rows = tables(ARCHITECTURE, "Statuses and events")["event type"]
    assert [first_word(row) for row in rows] == list(EventType)  # in the enum's order


def test_the_runtime_events_tables_give_every_event_type() -> None:
    found = tables(RUNTIME, "Events")["type"]
    assert first_words(found) == set(EventType)
