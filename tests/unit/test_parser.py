"""Unit and property tests for the incremental protocol parser (cortex_worker.protocol.parser)."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cortex_worker.protocol import parser as p
from cortex_worker.protocol.actions import Action, ActionError, parse_depends_on
from cortex_worker.protocol.document import load_document
from cortex_worker.protocol.parser import (
    ParseEvent,
    StreamParser,
    coalesce,
    parse_attributes,
    parse_document,
)
from tests.manifest_helpers import CORPUS

pytestmark = pytest.mark.unit

CORPUS_DOCS = sorted(CORPUS.glob("*.xml"))

EVENT_TYPES = {p.TEXT, p.THOUGHT_CHUNK, p.THOUGHT_END, p.ACTION_PARSED, p.RESPONSE_CHUNK,
               p.RESPONSE_END, p.CONTEXT_FEED, p.PROTOCOL_ERROR, p.WARNING}
ERROR_KINDS = {"invalid_json", "unclosed_block", "unknown_type", "unknown_mode",
               "duplicate_id"}
WARNING_KINDS = {"repaired_json", "unknown_field", "stray_tag", "invalid_attribute",
                 "runtime_block", "unclosed_block", "malformed_tag"}


# -- helpers -------------------------------------------------------------------------------
def feed_chunks(chunks: list[str], parser: StreamParser | None = None) -> list[ParseEvent]:
    parser = parser or StreamParser()
    events: list[ParseEvent] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return events + parser.close()


def cut(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def ev(text: str) -> list[ParseEvent]:
    return coalesce(parse_document(text))


def kinds(text: str) -> list[tuple[str, str | None]]:
    """(type, kind) of every event; kind only for errors and warnings."""
    return [(e.type, e.data.get("kind")) for e in ev(text)]


def only(text: str, kind: str) -> list[dict[str, Any]]:
    return [e.data for e in ev(text) if e.type == kind]


def errors(text: str) -> list[dict[str, Any]]:
    return only(text, p.PROTOCOL_ERROR)


def warnings(text: str) -> list[dict[str, Any]]:
    return only(text, p.WARNING)


def actions(text: str) -> list[Action]:
    return [e.data["action"] for e in ev(text) if e.type == p.ACTION_PARSED]


def action(text: str) -> Action:
    found = actions(text)
    assert len(found) == 1, ev(text)
    return found[0]


def at(doc: str, line: int, column: int) -> str:
    """The rest of the line at a 1-based (line, column) of `doc`."""
    return doc.split("\n")[line - 1][column - 1:]


# -- chunking and tags ---------------------------------------------------------------------
SPLIT_DOC = ('pre <thought>think </thou</thought><action id="a" mode="async">{"name": "t"}'
             '</action><response final="false">answer</response>post')


def test_split_document_reference_events() -> None:
    a = action(SPLIT_DOC)
    assert [(e.type, e.data if e.type != p.ACTION_PARSED else a.id) for e in ev(SPLIT_DOC)] == [
        (p.TEXT, {"text": "pre "}),
        (p.THOUGHT_CHUNK, {"text": "think </thou"}),
        (p.THOUGHT_END, {"text": "think </thou"}),
        (p.ACTION_PARSED, "a"),
        (p.RESPONSE_CHUNK, {"text": "answer", "final": False}),
        (p.RESPONSE_END, {"text": "answer", "final": False}),
        (p.TEXT, {"text": "post"}),
    ]


def test_tag_split_at_every_position_never_leaks() -> None:
    whole = ev(SPLIT_DOC)
    for k in range(1, len(SPLIT_DOC)):
        events = feed_chunks([SPLIT_DOC[:k], SPLIT_DOC[k:]])
        assert coalesce(events) == whole, k


def test_tag_split_at_every_pair_of_positions() -> None:
    doc = '<thought>a<action id="x">{"name":"t"}</action>b</thought>'
    whole = ev(doc)
    for i in range(1, len(doc)):
        for j in range(i + 1, len(doc)):
            assert coalesce(feed_chunks([doc[:i], doc[i:j], doc[j:]])) == whole, (i, j)


def test_partial_closing_tag_is_held_back_not_leaked() -> None:
    parser = StreamParser()
    first = parser.feed("<thought>deep thinking</tho")
    assert [(e.type, e.data) for e in first] == [(p.THOUGHT_CHUNK, {"text": "deep thinking"})]
    second = parser.feed("ught>")
    assert [(e.type, e.data) for e in second] == [(p.THOUGHT_END, {"text": "deep thinking"})]
    assert parser.close() == []


def test_held_back_prefix_that_is_not_a_tag_is_released_as_content() -> None:
    parser = StreamParser()
    assert [e.data for e in parser.feed("<thought>a </tho")] == [{"text": "a "}]
    assert [e.data for e in parser.feed("se")] == [{"text": "</tho"}, {"text": "se"}]


def test_events_stream_as_chunks_arrive() -> None:
    parser = StreamParser()
    assert parser.feed("<thought>") == []
    assert [(e.type, e.data) for e in parser.feed("I think")] == [
        (p.THOUGHT_CHUNK, {"text": "I think"})]
    assert [e.type for e in parser.feed('<action id="a">{"name": "t"}</action')] == []
    (parsed,) = parser.feed(">")
    assert parsed.type == p.ACTION_PARSED and parsed.data["action"].id == "a"
    assert [(e.type, e.data) for e in parser.feed(" and go on")] == [
        (p.THOUGHT_CHUNK, {"text": " and go on"})]
    assert [(e.type, e.data) for e in parser.feed("</thought>")] == [
        (p.THOUGHT_END, {"text": "I think and go on"})]
    assert [(e.type, e.data) for e in parser.feed("<response>Hi")] == [
        (p.RESPONSE_CHUNK, {"text": "Hi", "final": True})]
    assert parser.close() == [
        ParseEvent(p.PROTOCOL_ERROR, {"kind": "unclosed_block",
                                      "message": "<response> block is never closed with "
                                                 "</response>",
                                      "line": 1, "column": 74}),
        ParseEvent(p.RESPONSE_END, {"text": "Hi", "final": True}),
    ]


def test_tags_are_case_insensitive() -> None:
    doc = ('<THOUGHT>t</Thought><Action TYPE="Agent" MODE="ASYNC" ID="x">{"name": "n"}</ACTION>'
           '<RESPONSE FINAL="FALSE">r</rEsPoNsE><Context_Feed ID="f">1</CONTEXT_FEED>')
    events = ev(doc)
    assert [e.type for e in events] == [p.THOUGHT_CHUNK, p.THOUGHT_END, p.ACTION_PARSED,
                                        p.RESPONSE_CHUNK, p.RESPONSE_END, p.CONTEXT_FEED]
    a = events[2].data["action"]
    assert (a.id, a.type, a.mode, a.name) == ("x", "agent", "async", "n")
    assert events[4].data == {"text": "r", "final": False}
    assert events[5].data == {"id": "f", "value": 1}


@pytest.mark.parametrize("attrs", ['id="a" mode="async"', "id='a' mode='async'",
                                   "id=a mode=async", 'id = "a"  mode =async',
                                   '\n  id="a"\n  mode="async"\n'])
def test_attribute_quoting(attrs: str) -> None:
    a = action(f'<action {attrs}>{{"name": "t"}}</action>')
    assert (a.id, a.mode) == ("a", "async")


def test_parse_attributes() -> None:
    assert parse_attributes(' id="a b" Mode=\'x>y\' retry=3 depends_on=["p", "q"] flag') == {
        "id": "a b", "mode": "x>y", "retry": "3", "depends_on": '["p", "q"]', "flag": ""}
    assert parse_attributes("") == {}


def test_quoted_attribute_value_may_contain_gt() -> None:
    a = action('<action id="a>b" mode=\'async\'>{"name": "t"}</action>')
    assert (a.id, a.mode) == ("a>b", "async")


# -- thoughts, text, responses -------------------------------------------------------------
def test_action_inside_thought() -> None:
    doc = ('<thought>first <action id="a" mode="async">{"name": "t"}</action> second'
           '</thought><action id="b">{"name": "u"}</action>')
    events = ev(doc)
    assert [e.type for e in events] == [p.THOUGHT_CHUNK, p.ACTION_PARSED, p.THOUGHT_CHUNK,
                                        p.THOUGHT_END, p.ACTION_PARSED]
    assert events[0].data == {"text": "first "}
    assert events[2].data == {"text": " second"}
    assert events[3].data == {"text": "first  second"}
    assert events[1].data["action"].in_thought is True
    assert events[4].data["action"].in_thought is False


def test_loose_text_is_kept() -> None:
    doc = "Hello <thought>x</thought> between\n<response>r</response> tail"
    assert [(e.type, e.data["text"]) for e in ev(doc)] == [
        (p.TEXT, "Hello "), (p.THOUGHT_CHUNK, "x"), (p.THOUGHT_END, "x"),
        (p.TEXT, " between\n"), (p.RESPONSE_CHUNK, "r"), (p.RESPONSE_END, "r"),
        (p.TEXT, " tail")]


RAW = 'a < b && c > d <b>bold</b> <div class="x">&amp; &lt;</div> <a href=\'u\'>l</a> $5 <'


def test_raw_markup_in_text_thought_and_response() -> None:
    assert [(e.type, e.data) for e in ev(RAW)] == [(p.TEXT, {"text": RAW})]
    assert [(e.type, e.data) for e in ev(f"<thought>{RAW}</thought>")] == [
        (p.THOUGHT_CHUNK, {"text": RAW}), (p.THOUGHT_END, {"text": RAW})]
    doc = f"<response>{RAW}\n<thought>no</thought><action>{{}}</action></response>"
    body = f"{RAW}\n<thought>no</thought><action>{{}}</action>"
    assert [(e.type, e.data) for e in ev(doc)] == [
        (p.RESPONSE_CHUNK, {"text": body, "final": True}),
        (p.RESPONSE_END, {"text": body, "final": True})]


@pytest.mark.parametrize("noise", ["<actions>", "<b>", "<thoughtful>", "< thought>",
                                   "<response_x>", "<results>", "<context>", "<thought-x>",
                                   "<!-- <x> -->", "<<>>", "</>", "<thou ght>"])
def test_not_a_tag_is_text(noise: str) -> None:
    assert [(e.type, e.data) for e in ev(f"a{noise}b")] == [(p.TEXT, {"text": f"a{noise}b"})]


def test_stray_closing_tag_is_text_with_a_warning() -> None:
    events = ev("x </thought> y")
    assert [e.type for e in events] == [p.TEXT, p.WARNING, p.TEXT]
    assert "".join(e.data["text"] for e in events if e.type == p.TEXT) == "x </thought> y"
    assert events[1].data == {"kind": "stray_tag",
                              "message": "</thought> outside any block is kept as text",
                              "line": 1, "column": 3}


def test_thought_closed_by_response_warns() -> None:
    assert kinds("<thought>x<response>y</response>") == [
        (p.THOUGHT_CHUNK, None), (p.WARNING, "unclosed_block"), (p.THOUGHT_END, None),
        (p.RESPONSE_CHUNK, None), (p.RESPONSE_END, None)]
    assert warnings("<thought>x<response>y</response>")[0]["column"] == 11


@pytest.mark.parametrize(("attr", "final", "warned"), [
    ("", True, False), (' final="true"', True, False), (" final='false'", False, False),
    (" final=false", False, False), (' FINAL="False"', False, False), (' final="0"', False, False),
    (' final="no"', False, False), (' final="yes"', True, False), (" final", True, False),
    (' final="maybe"', True, True),
])
def test_response_final(attr: str, final: bool, warned: bool) -> None:
    events = ev(f"<response{attr}>text $x</response>")
    assert [e.data for e in events if e.type != p.WARNING] == [
        {"text": "text $x", "final": final}, {"text": "text $x", "final": final}]
    assert [e.data["kind"] for e in events if e.type == p.WARNING] == (
        ["invalid_attribute"] if warned else [])


def test_result_block_is_ignored_with_a_warning() -> None:
    events = ev('<result id="a" status="ok">{"x": 1} <b>out</b></result>after')
    assert [(e.type, e.data) for e in events] == [
        (p.WARNING, {"kind": "runtime_block",
                     "message": "<result> blocks are written by the runtime; this one is ignored",
                     "line": 1, "column": 1}),
        (p.TEXT, {"text": "after"})]


def test_context_feed_events() -> None:
    doc = ('<context_feed id="j">\n{"a": [1, 2]}\n</context_feed>'
           "<context_feed id='t'>  2024-06-15  </context_feed>"
           "<context_feed id=n>42</context_feed>")
    assert [(e.type, e.data) for e in ev(doc)] == [
        (p.CONTEXT_FEED, {"id": "j", "value": {"a": [1, 2]}}),
        (p.CONTEXT_FEED, {"id": "t", "value": "2024-06-15"}),
        (p.CONTEXT_FEED, {"id": "n", "value": 42}),
    ]


def test_context_feed_without_id_is_an_error() -> None:
    assert errors("\n  <context_feed>1</context_feed>") == [
        {"kind": "invalid_json", "message": "<context_feed> has no id attribute",
         "line": 2, "column": 3}]


def test_self_closing_tags() -> None:
    a = action('<action id="s" name="ping" mode="async" type="internal"/>')
    assert (a.id, a.name, a.mode, a.type, a.parameters) == ("s", "ping", "async", "internal", {})
    assert [(e.type, e.data) for e in ev("<thought/><response final='false' />")] == [
        (p.THOUGHT_END, {"text": ""}), (p.RESPONSE_END, {"text": "", "final": False})]


def test_self_closing_action_inside_thought() -> None:
    events = ev('<thought>a<action id="s" name="t"/>b</thought>')
    assert [e.type for e in events] == [p.THOUGHT_CHUNK, p.ACTION_PARSED, p.THOUGHT_CHUNK,
                                        p.THOUGHT_END]
    assert events[1].data["action"].in_thought is True
    assert events[3].data == {"text": "ab"}


def test_feed_after_close_raises() -> None:
    parser = StreamParser()
    parser.feed("<thought>x</thought>")
    assert parser.close() == []
    with pytest.raises(RuntimeError, match=r"feed\(\) after close\(\)"):
        parser.feed("more")
    assert parser.close() == []


# -- action bodies -------------------------------------------------------------------------
def test_json_body_containing_angle_brackets() -> None:
    params = {"q": "a < b </act <action> </actions> <b>", "html": "<p>x</p>"}
    body = json.dumps({"name": "t", "parameters": params})
    assert action(f'<action id="a">{body}</action>').parameters == params


@pytest.mark.parametrize(("doc", "line", "column", "rest"), [
    ('<action id="a">{"name": t}</action>', 1, 25, "t}</action>"),
    ('<action id="a">\n{\n  "name": "t",\n  "parameters": {"x": nope}\n}\n</action>', 4, 23,
     "nope}"),
    ('text\n  <thought>\n  <action id="a">{"name": "t" "x": 1}</action></thought>', 3, 31,
     '"x": 1}</action></thought>'),
    ('<action id="a">\n  {"name": "t",}\n  {"extra": 1}</action>', 3, 3, '{"extra": 1}</action>'),
])
def test_invalid_json_position_points_inside_the_body(doc: str, line: int, column: int,
                                                      rest: str) -> None:
    (error,) = errors(doc)
    assert error["kind"] == "invalid_json"
    assert error["message"].startswith("action body: invalid JSON: ")
    assert error["action_id"] == "a"
    assert (error["line"], error["column"]) == (line, column)
    assert at(doc, line, column) == rest
    assert actions(doc) == []
    # The same position whatever the chunking.
    for size in (1, 2, 5):
        chunks = [doc[i:i + size] for i in range(0, len(doc), size)]
        assert coalesce(feed_chunks(chunks)) == ev(doc)


@pytest.mark.parametrize(("body", "repairs"), [
    ('{"name": "t", // the tool\n "parameters": {"q": 1}}', ["removed a comment"]),
    ('{/* a */ "name": "t", "parameters": {"q": 1} /* b */}', ["removed a comment"]),
    ('{"name": "t", "parameters": {"q": 1,},}', ["removed a trailing comma"]),
    ('{"name": "t", "parameters": {"q": 1}, // c\n}',
     ["removed a comment", "removed a trailing comma"]),
])
def test_comments_and_trailing_commas_are_repaired_with_a_warning(body: str,
                                                                  repairs: list[str]) -> None:
    doc = f'<action id="a">{body}</action>'
    a = action(doc)
    assert (a.name, a.parameters) == ("t", {"q": 1})
    assert warnings(doc) == [{"kind": "repaired_json", "message": f"action body: {r}",
                              "line": 1, "column": 1, "action_id": "a"} for r in repairs]
    assert errors(doc) == []


def test_body_must_be_an_object() -> None:
    assert errors('<action id="a">[1, 2]</action>') == [
        {"kind": "invalid_json", "message": "action body must be a JSON object",
         "line": 1, "column": 1, "action_id": "a"}]


def test_unknown_body_field_warns() -> None:
    doc = '<action id="a">{"name": "t", "query": "x"}</action>'
    assert action(doc).parameters == {}
    assert warnings(doc) == [{"kind": "unknown_field",
                              "message": "ignored unknown action field 'query'; tool arguments "
                                         "belong under 'parameters'",
                              "line": 1, "column": 1, "action_id": "a"}]


# -- unclosed blocks -----------------------------------------------------------------------
def test_unclosed_action_at_end() -> None:
    doc = 'x\n<action id="a">{"name": "t"}'
    assert [(e.type, e.data) for e in ev(doc)] == [
        (p.TEXT, {"text": "x\n"}),
        (p.PROTOCOL_ERROR, {"kind": "unclosed_block",
                            "message": "<action> block is never closed with </action>",
                            "line": 2, "column": 1})]


def test_unclosed_action_inside_unclosed_thought() -> None:
    doc = '<thought>t <action id="a">{"name": "t"}'
    assert kinds(doc) == [(p.THOUGHT_CHUNK, None), (p.PROTOCOL_ERROR, "unclosed_block"),
                          (p.PROTOCOL_ERROR, "unclosed_block"), (p.THOUGHT_END, None)]
    assert [(e["line"], e["column"]) for e in errors(doc)] == [(1, 12), (1, 1)]
    assert only(doc, p.THOUGHT_END) == [{"text": "t "}]


def test_unclosed_thought_keeps_its_text() -> None:
    doc = "<thought>still thinking</thou"
    assert [(e.type, e.data) for e in ev(doc)] == [
        (p.THOUGHT_CHUNK, {"text": "still thinking</thou"}),
        (p.PROTOCOL_ERROR, {"kind": "unclosed_block",
                            "message": "<thought> block is never closed with </thought>",
                            "line": 1, "column": 1}),
        (p.THOUGHT_END, {"text": "still thinking</thou"})]


def test_unclosed_response_keeps_its_text() -> None:
    doc = "\n\n<response final='false'>partial answer"
    assert [(e.type, e.data) for e in ev(doc)] == [
        (p.TEXT, {"text": "\n\n"}),
        (p.RESPONSE_CHUNK, {"text": "partial answer", "final": False}),
        (p.PROTOCOL_ERROR, {"kind": "unclosed_block",
                            "message": "<response> block is never closed with </response>",
                            "line": 3, "column": 1}),
        (p.RESPONSE_END, {"text": "partial answer", "final": False})]


def test_unclosed_context_feed() -> None:
    assert [(e["kind"], e["line"], e["column"]) for e in errors("<context_feed id=x>1")] == [
        ("unclosed_block", 1, 1)]


@pytest.mark.parametrize("doc", ['<action id="a"', "<thought ", "<response final='tr",
                                 '<action depends_on=["a"'])
def test_partial_opening_tag_with_attributes_at_end(doc: str) -> None:
    (error,) = errors(doc)
    assert (error["kind"], error["line"], error["column"]) == ("unclosed_block", 1, 1)
    assert error["message"].endswith("tag is never closed with '>'")
    assert [e.type for e in ev(doc)] == [p.PROTOCOL_ERROR]


@pytest.mark.parametrize("doc", ["<thou", "<", "<thought", "</act", "<context_fe", "x <respo"])
def test_partial_tag_name_at_end_is_text(doc: str) -> None:
    assert [(e.type, e.data) for e in ev(doc)] == [(p.TEXT, {"text": doc})]


# -- action fields -------------------------------------------------------------------------
def test_unknown_type_and_mode() -> None:
    assert errors('<action id="a" type="gadget">{"name": "t"}</action>') == [
        {"kind": "unknown_type",
         "message": "unknown action type 'gadget' (expected one of: tool, llm, agent, relic, "
                    "workflow, internal)",
         "line": 1, "column": 1, "action_id": "a"}]
    assert errors('x\n<action id="b">{"name": "t", "mode": "later"}</action>') == [
        {"kind": "unknown_mode",
         "message": "unknown action mode 'later' (expected one of: sync, async, "
                    "fire_and_forget)",
         "line": 2, "column": 1, "action_id": "b"}]


def test_defaults() -> None:
    a = action('<action id="a">{"name": "t"}</action>')
    assert (a.type, a.mode, a.parameters, a.depends_on, a.timeout, a.retry, a.on_error,
            a.output_key, a.in_thought, a.generated_id) == (
        "tool", "sync", {}, (), None, 0, "fail", None, False, False)


def test_duplicate_id() -> None:
    doc = '<action id="a">{"name": "t"}</action>\n  <action id="a">{"name": "u"}</action>'
    events = ev(doc)
    assert [e.type for e in events] == [p.ACTION_PARSED, p.TEXT, p.PROTOCOL_ERROR]
    assert events[0].data["action"].name == "t"
    assert events[2].data == {
        "kind": "duplicate_id",
        "message": "action id 'a' is already used in this job; give each action its own id",
        "line": 2, "column": 3, "action_id": "a"}
    assert [e["kind"] for e in load_document(doc).errors] == ["duplicate_id"]


def test_duplicate_of_a_known_id() -> None:
    parser = StreamParser(known_ids={"a"})
    events = feed_chunks(['<action id="a">{"name": "t"}</action>'], parser)
    assert [(e.type, e.data.get("kind")) for e in events] == [(p.PROTOCOL_ERROR, "duplicate_id")]


def test_generated_ids() -> None:
    doc = ('<action>{"name": "web scraper!"}</action>'
           '<action id="x">{"name": "t"}</action>'
           '<action>{"tool": "t"}</action>'
           '<action name="t"/>'
           '<action id="">{"agent": "..."}</action>')
    assert [(a.id, a.generated_id) for a in actions(doc)] == [
        ("web_scraper-1", True), ("x", False), ("t-3", True), ("t-4", True),
        ("action-5", True)]


def test_generated_ids_respect_first_number_and_known_ids() -> None:
    parser = StreamParser(first_action_number=7, known_ids={"t-7"})
    events = feed_chunks(['<action>{"name": "t"}</action>', '<action>{"name": "t"}</action>'],
                         parser)
    assert [e.data["action"].id for e in events] == ["t-8", "t-9"]


def test_invalid_action_still_counts_for_generated_numbers() -> None:
    doc = '<action>{"name": nope}</action><action>{"name": "t"}</action>'
    assert kinds(doc) == [(p.PROTOCOL_ERROR, "invalid_json"), (p.ACTION_PARSED, None)]
    assert action(doc).id == "t-2"


@pytest.mark.parametrize("key", ["name", "tool", "agent", "relic", "workflow"])
def test_name_aliases(key: str) -> None:
    assert action(f'<action id="a">{{"{key}": "target"}}</action>').name == "target"
    assert action(f'<action id="a" {key}="target"></action>').name == "target"


def test_same_name_under_two_aliases_is_fine_but_different_names_are_not() -> None:
    assert action('<action id="a">{"name": "t", "tool": "t"}</action>').name == "t"
    (error,) = errors('<action id="a" tool="x">{"name": "y"}</action>')
    assert error["kind"] == "invalid_json"
    assert error["message"] == ("action names its target twice, differently: "
                                "{'name': 'y', 'tool': 'x'}")


def test_missing_name_is_an_error() -> None:
    (error,) = errors('<action id="a">{"parameters": {}}</action>')
    assert error["kind"] == "invalid_json"
    assert "has no 'name'" in error["message"]


@pytest.mark.parametrize(("attr", "expected"), [
    ('depends_on="a,b"', ("a", "b")),
    ('depends_on=" a , b ,"', ("a", "b")),
    ('depends_on="a"', ("a",)),
    ("depends_on=a", ("a",)),
    ("depends_on='[\"a\",\"b\"]'", ("a", "b")),
    ('depends_on=["a","b"]', ("a", "b")),
    ('depends_on=["a", "b"]', ("a", "b")),
    ("depends_on=[a,b]", ("a", "b")),
    ("depends_on=\"['a', 'b']\"", ("a", "b")),
    ('depends_on=""', ()),
])
def test_depends_on_attribute_forms(attr: str, expected: tuple[str, ...]) -> None:
    assert action(f'<action id="z" {attr}>{{"name": "t"}}</action>').depends_on == expected


def test_depends_on_body_list_and_union_with_attribute() -> None:
    assert action('<action id="z">{"name": "t", "depends_on": ["b", "a"]}</action>'
                  ).depends_on == ("b", "a")
    assert action('<action id="z">{"name": "t", "depends_on": "a,b"}</action>'
                  ).depends_on == ("a", "b")
    assert action('<action id="z" depends_on="c,a">{"name": "t", "depends_on": ["a", "b"]}'
                  '</action>').depends_on == ("c", "a", "b")


def test_depends_on_invalid_forms() -> None:
    for body in ('{"name": "t", "depends_on": 5}', '{"name": "t", "depends_on": ["a", 1]}'):
        (error,) = errors(f'<action id="z">{body}</action>')
        assert error["kind"] == "invalid_json"
        assert "depends_on" in error["message"]


def test_parse_depends_on() -> None:
    assert parse_depends_on(None) == []
    assert parse_depends_on(["a", " b ", "a", ""]) == ["a", "b"]
    assert parse_depends_on('["x", "y"]') == ["x", "y"]
    assert parse_depends_on("[x, 'y']") == ["x", "y"]
    with pytest.raises(ActionError) as info:
        parse_depends_on({"a": 1})
    assert info.value.kind == "invalid_json"


def test_timeout_retry_on_error_from_attributes() -> None:
    a = action('<action id="a" timeout="2.5" retry=3 on_error="CONTINUE">{"name": "t"}</action>')
    assert (a.timeout, a.retry, a.on_error) == (2.5, 3, "continue")


def test_timeout_retry_on_error_from_body() -> None:
    a = action('<action id="a">{"name": "t", "timeout": 10, "retry": 1, "on_error": "continue"}'
               "</action>")
    assert (a.timeout, a.retry, a.on_error) == (10.0, 1, "continue")


def test_body_wins_over_attribute() -> None:
    a = action('<action id="a" timeout="1" retry="5" mode="sync">'
               '{"name": "t", "timeout": 4, "retry": 2, "mode": "async"}</action>')
    assert (a.timeout, a.retry, a.mode) == (4.0, 2, "async")


@pytest.mark.parametrize("attr", ['timeout="0"', 'timeout="-1"', 'timeout="soon"', 'retry="-1"',
                                  'retry="x"', 'on_error="explode"'])
def test_invalid_timeout_retry_on_error(attr: str) -> None:
    (error,) = errors(f'<action id="a" {attr}>{{"name": "t"}}</action>')
    assert error["kind"] == "invalid_json"
    assert error["message"].startswith("invalid action field ")
    assert error["action_id"] == "a"


def test_output_key_and_parameters() -> None:
    a = action('<action id="a" output_key="k">{"name": "t", "parameters": {"x": "$y"}}</action>')
    assert (a.output_key, a.parameters) == ("k", {"x": "$y"})
    (error,) = errors('<action id="a">{"name": "t", "parameters": [1]}</action>')
    assert error["message"] == "'parameters' must be a JSON object"


def test_action_line_and_column() -> None:
    doc = 'ab\ncd <thought>\n   <action id="q">{"name": "t"}</action></thought>'
    a = action(doc)
    assert (a.line, a.column) == (3, 4)
    assert at(doc, a.line, a.column).startswith('<action id="q">')


# -- property tests ------------------------------------------------------------------------
def chunkings(text: str) -> st.SearchStrategy[list[str]]:
    every = st.just([text[i:i + 1] for i in range(len(text))])
    if len(text) < 2:
        return st.just([text])
    cuts = st.lists(st.integers(1, len(text) - 1), max_size=min(len(text) - 1, 60))
    return st.one_of(every, cuts.map(lambda c: cut(text, c)))


@st.composite
def chunked(draw: st.DrawFn, texts: st.SearchStrategy[str]) -> tuple[str, list[str]]:
    text = draw(texts)
    return text, draw(chunkings(text))


# A model of a document: the strategies build text and the events it must produce.
TEXT_ALPHABET = "ab $&>\n/=\"'.{}[]"  # no '<' and none of the letters of tag names but 'a'
OUTSIDE_NOISE = ["<actions>", "<b>", "< thought>", "<thou ", "<!-- c -->", "&amp;", "$5",
                 "<results>", "a < b", "<context_feedx>", "<", "</", "<respo "]
STRAY = ["</thought>", "</action>", "</response>"]
THOUGHT_NOISE = ["<actions>", "<b>", "</act ", "<thou ", "</response>", "<result>",
                 "<context_feed id=x>", "</tho ", "<", "a < b"]
RESPONSE_NOISE = ["<thought>", "</thought>", "<action id='z'>{}</action>", "<b>", "</respons ",
                  "<", "$x", "${y}", "<response>"]
NAMES = ["web_scraper", "calc", "my tool"]
IDS = ["a", "b", "c"]
FINALS = [("", True), (' final="true"', True), (" final='false'", False), (" final=false", False),
          (' FINAL="False"', False), (' final="maybe"', True), (" final", True)]


def text_with(noise: list[str]) -> st.SearchStrategy[str]:
    piece = st.one_of(st.text(TEXT_ALPHABET, max_size=6), st.sampled_from(noise))
    return st.lists(piece, max_size=5).map("".join)


@st.composite
def action_block(draw: st.DrawFn, in_thought: bool) -> tuple[str, dict[str, Any]]:
    attrs: list[str] = []
    ident = draw(st.none() | st.sampled_from(IDS))
    if ident is not None:
        q = draw(st.sampled_from(['"', "'", ""]))
        attrs.append(f"id={q}{ident}{q}")
    kind = draw(st.sampled_from([None, None, "tool", "agent", "LLM", "bogus"]))
    if kind is not None:
        attrs.append(f'type="{kind}"')
    mode = draw(st.sampled_from([None, "sync", "async", "async", "Fire_And_Forget", "later"]))
    if mode is not None:
        attrs.append(f"mode='{mode}'")
    deps = draw(st.lists(st.sampled_from(["a", "b", "x"]), max_size=3, unique=True))
    form = draw(st.sampled_from(["comma", "json", "unquoted", "body"]))
    body: dict[str, Any] = {}
    if deps and form == "comma":
        attrs.append(f'depends_on="{",".join(deps)}"')
    elif deps and form == "json":
        attrs.append(f"depends_on='{json.dumps(deps)}'")
    elif deps and form == "unquoted":
        attrs.append(f"depends_on={json.dumps(deps, separators=(',', ':'))}")
    elif deps:
        body["depends_on"] = deps
    attrs = draw(st.permutations(attrs))
    sep = draw(st.sampled_from([" ", "\n  ", "  "]))
    name = draw(st.sampled_from(NAMES))
    key = draw(st.sampled_from(["name", "tool", "agent"]))
    params = {"q": draw(st.text("ab<>&$ /\"'\n", max_size=8))}
    body = {key: name, "parameters": params, **body}
    shape = draw(st.sampled_from(["plain", "indent", "comment", "trailing", "invalid", "empty"]))
    repaired = shape in ("comment", "trailing")
    if shape == "plain":
        text = json.dumps(body)
    elif shape == "indent":
        text = "\n" + json.dumps(body, indent=2) + "\n"
    elif shape == "comment":
        text = "{ // a comment </b>\n" + json.dumps(body)[1:]
    elif shape == "trailing":
        text = json.dumps(body)[:-1] + ",\n}"
    elif shape == "invalid":
        text = json.dumps(body)[:-1] + ', "oops": nope}'
    else:
        text = ""
    tag = draw(st.sampled_from(["action", "ACTION", "Action"]))
    opening = f"<{tag}{sep if attrs else ''}{sep.join(attrs)}>"
    model = {"ident": ident, "kind": (kind or "tool").lower(), "mode": (mode or "sync").lower(),
             "name": name, "params": params, "deps": tuple(deps), "in_thought": in_thought,
             "shape": shape, "repaired": repaired}
    return f"{opening}{text}</{tag}>", model


@st.composite
def thought_block(draw: st.DrawFn) -> tuple[str, list[tuple[str, Any]]]:
    parts: list[tuple[str, Any]] = []
    out = []
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.booleans()):
            text = draw(text_with(THOUGHT_NOISE))
            out.append(text)
            if text:
                parts.append(("chunk", text))
        else:
            text, model = draw(action_block(in_thought=True))
            out.append(text)
            parts.append(("action", model))
    tag = draw(st.sampled_from(["thought", "THOUGHT"]))
    return f"<{tag}>{''.join(out)}</{tag}>", parts


@st.composite
def protocol_document(draw: st.DrawFn) -> tuple[str, list[tuple[str, Any]]]:
    """A document and its model: a list of (kind, payload) blocks in order."""
    out: list[str] = []
    model: list[tuple[str, Any]] = []
    for _ in range(draw(st.integers(0, 7))):
        block = draw(st.sampled_from(["text", "stray", "thought", "action", "response", "feed",
                                      "result"]))
        if block == "text":
            text = draw(text_with(OUTSIDE_NOISE))
            out.append(text)
            model.append(("text", text))
        elif block == "stray":
            text = draw(st.sampled_from(STRAY))
            out.append(text)
            model.append(("stray", text))
        elif block == "thought":
            text, parts = draw(thought_block())
            out.append(text)
            model.append(("thought", parts))
        elif block == "action":
            text, action_model = draw(action_block(in_thought=False))
            out.append(text)
            model.append(("action", action_model))
        elif block == "response":
            attr, final = draw(st.sampled_from(FINALS))
            body = draw(text_with(RESPONSE_NOISE))
            tag = draw(st.sampled_from(["response", "Response"]))
            out.append(f"<{tag}{attr}>{body}</{tag}>")
            model.append(("response", (body, final, attr == ' final="maybe"')))
        elif block == "feed":
            ident = draw(st.sampled_from(["f1", "f2"]))
            raw = draw(st.sampled_from(['{"a": 1}', " 42 ", "plain text", "\n[1, 2]\n", ""]))
            out.append(f'<context_feed id="{ident}">{raw}</context_feed>')
            try:
                value: Any = json.loads(raw.strip())
            except ValueError:
                value = raw.strip()
            model.append(("feed", (ident, value)))
        else:
            out.append(f"<result id=r status=ok>{draw(st.text(TEXT_ALPHABET, max_size=5))}"
                       "</result>")
            model.append(("result", None))
    return "".join(out), model


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", "_", name).strip("_")


def expected_events(model: list[tuple[str, Any]]) -> tuple[list[tuple[Any, ...]], dict[str, int]]:
    """The projected, warning-free events a document model must produce, and warning counts."""
    out: list[tuple[Any, ...]] = []
    seen: set[str] = set()
    number = 0
    counts = {"repaired_json": 0, "invalid_attribute": 0, "stray_tag": 0, "runtime_block": 0}

    def add(item: tuple[Any, ...]) -> None:
        if out and item[0] in p.CHUNK_TYPES and out[-1][0] == item[0] and out[-1][2:] == item[2:]:
            out[-1] = (item[0], out[-1][1] + item[1], *item[2:])
        else:
            out.append(item)

    def do_action(m: dict[str, Any]) -> None:
        nonlocal number
        number += 1
        if m["shape"] == "invalid":
            add((p.PROTOCOL_ERROR, "invalid_json"))
            return
        if m["repaired"]:
            counts["repaired_json"] += 1
        if m["shape"] == "empty":
            add((p.PROTOCOL_ERROR, "unknown_type" if m["kind"] == "bogus" else
                 "unknown_mode" if m["mode"] == "later" else "invalid_json"))  # no name
            return
        if m["kind"] == "bogus":
            add((p.PROTOCOL_ERROR, "unknown_type"))
            return
        if m["mode"] == "later":
            add((p.PROTOCOL_ERROR, "unknown_mode"))
            return
        ident = m["ident"] or f"{_slug(m['name'])}-{number}"
        if ident in seen:
            add((p.PROTOCOL_ERROR, "duplicate_id"))
            return
        seen.add(ident)
        add((p.ACTION_PARSED, ident, m["kind"], m["mode"], m["name"], m["params"], m["deps"],
             m["in_thought"], m["ident"] is None))

    for kind, payload in model:
        if kind == "text" and payload:
            add((p.TEXT, payload))
        elif kind == "stray":
            add((p.TEXT, payload))
            counts["stray_tag"] += 1
        elif kind == "thought":
            text = ""
            for part, value in payload:
                if part == "chunk":
                    add((p.THOUGHT_CHUNK, value))
                    text += value
                else:
                    do_action(value)
            out.append((p.THOUGHT_END, text))
        elif kind == "action":
            do_action(payload)
        elif kind == "response":
            body, final, warned = payload
            if body:
                add((p.RESPONSE_CHUNK, body, final))
            out.append((p.RESPONSE_END, body, final))
            counts["invalid_attribute"] += warned
        elif kind == "feed":
            out.append((p.CONTEXT_FEED, *payload))
        elif kind == "result":
            counts["runtime_block"] += 1
    return out, counts


def project(events: list[ParseEvent]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for e in coalesce([e for e in events if e.type != p.WARNING]):
        d = e.data
        if e.type in (p.TEXT, p.THOUGHT_CHUNK, p.THOUGHT_END):
            out.append((e.type, d["text"]))
        elif e.type in (p.RESPONSE_CHUNK, p.RESPONSE_END):
            out.append((e.type, d["text"], d["final"]))
        elif e.type == p.ACTION_PARSED:
            a = d["action"]
            out.append((e.type, a.id, a.type.value, a.mode.value, a.name, a.parameters,
                        a.depends_on, a.in_thought, a.generated_id))
        elif e.type == p.CONTEXT_FEED:
            out.append((e.type, d["id"], d["value"]))
        else:
            out.append((e.type, d["kind"]))
    return out


PROPERTY = settings(max_examples=250, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@PROPERTY
@given(doc=protocol_document(), data=st.data())
def test_generated_documents_match_their_model_under_any_chunking(
        doc: tuple[str, list[tuple[str, Any]]], data: st.DataObject) -> None:
    text, model = doc
    whole = parse_document(text)
    expected, counts = expected_events(model)
    assert project(whole) == expected
    warned = [e.data["kind"] for e in whole if e.type == p.WARNING]
    for kind, count in counts.items():
        assert warned.count(kind) == count, kind
    assert set(warned) <= set(counts)
    chunks = data.draw(chunkings(text))
    assert "".join(chunks) == text
    assert coalesce(feed_chunks(chunks)) == coalesce(whole)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_corpus_documents_under_random_chunkings(data: st.DataObject) -> None:
    assert CORPUS_DOCS, f"no corpus documents in {CORPUS}"
    path = data.draw(st.sampled_from(CORPUS_DOCS))
    text = path.read_text(encoding="utf-8")
    chunks = data.draw(chunkings(text))
    assert coalesce(feed_chunks(chunks)) == coalesce(parse_document(text))


def test_corpus_documents_one_character_at_a_time() -> None:
    assert CORPUS_DOCS, f"no corpus documents in {CORPUS}"
    for path in CORPUS_DOCS:
        text = path.read_text(encoding="utf-8")
        assert coalesce(feed_chunks(list(text))) == coalesce(parse_document(text)), path.name


FUZZ_ALPHABET = st.sampled_from([
    *"<>/\"'=[]{} \n:,ab$&", "thought", "action", "response", "context_feed", "result", "THOUGHT", "Action", "tho",
    "act", "resp", "id=", "final=", "type=", "mode=", "depends_on=", "name", '{"name": "t"}',
    "</", "/>", "async", "sync", '"a"', "'x'", "//", "/*", "*/", ",}"])
FUZZ_TEXT = st.one_of(st.text(max_size=120), st.lists(FUZZ_ALPHABET, max_size=60).map("".join))


def check_well_formed(text: str, events: list[ParseEvent]) -> None:
    lines = text.count("\n") + 1
    thought = ""
    response: list[tuple[str, bool]] = []
    for e in events:
        assert e.type in EVENT_TYPES
        if e.type in (p.PROTOCOL_ERROR, p.WARNING):
            assert e.data["kind"] in (ERROR_KINDS if e.type == p.PROTOCOL_ERROR else WARNING_KINDS)
            assert isinstance(e.data["message"], str) and e.data["message"]
            assert 1 <= e.data["line"] <= lines
            assert e.data["column"] >= 1
        elif e.type in p.CHUNK_TYPES:
            assert e.data["text"]
        if e.type == p.THOUGHT_CHUNK:
            thought += e.data["text"]
        elif e.type == p.THOUGHT_END:
            assert e.data["text"] == thought
            thought = ""
        elif e.type == p.RESPONSE_CHUNK:
            response.append((e.data["text"], e.data["final"]))
        elif e.type == p.RESPONSE_END:
            assert "".join(t for t, _ in response) == e.data["text"]
            assert all(f == e.data["final"] for _, f in response)
            response = []
        elif e.type == p.ACTION_PARSED:
            assert isinstance(e.data["action"], Action)
    assert thought == "" and response == []  # every open block was ended


@PROPERTY
@given(case=chunked(FUZZ_TEXT))
def test_fuzz_never_raises_and_reports_everything_as_events(case: tuple[str, list[str]]) -> None:
    text, chunks = case
    parser = StreamParser()
    events: list[ParseEvent] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.close()
    check_well_formed(text, events)
    assert coalesce(events) == coalesce(parse_document(text))
    with pytest.raises(RuntimeError):
        parser.feed("x")
    if "<" not in text:
        assert [(e.type, e.data) for e in coalesce(events)] == (
            [(p.TEXT, {"text": text})] if text else [])


@PROPERTY
@given(prefix=FUZZ_TEXT)
def test_fuzz_text_then_an_unclosed_block_is_reported(prefix: str) -> None:
    # Whatever came before, an unterminated final block surfaces as an unclosed_block error
    # (or the prefix left the parser inside a block, which is reported the same way).
    events = parse_document(prefix + '<response>"</response>"<thought>\' never closed')
    assert any(e.type == p.PROTOCOL_ERROR and e.data["kind"] == "unclosed_block"
               for e in events)


# -- long tags -----------------------------------------------------------------------------
@pytest.mark.parametrize(("length", "is_tag"), [(p.MAX_TAG_CHARS - 1, True),
                                                (p.MAX_TAG_CHARS, True),
                                                (p.MAX_TAG_CHARS + 1, False)])
def test_long_tag_limit_is_chunking_invariant(length: int, is_tag: bool) -> None:
    opening = "<response x='" + "a" * (length - 15) + "'>"
    assert len(opening) == length
    text = opening + "body</response>"
    whole = ev(text)
    if is_tag:
        assert [(e.type, e.data) for e in whole] == [
            (p.RESPONSE_CHUNK, {"text": "body", "final": True}),
            (p.RESPONSE_END, {"text": "body", "final": True})]
    else:
        assert [(e.type, e.data.get("kind")) for e in whole] == [
            (p.WARNING, "malformed_tag"), (p.TEXT, None), (p.WARNING, "stray_tag")]
        assert whole[1].data["text"] == text
    for size in (1, 2, 7, 1000):
        chunks = [text[i:i + size] for i in range(0, len(text), size)]
        assert coalesce(feed_chunks(chunks)) == whole, size


def test_runaway_attribute_quote_is_chunking_invariant() -> None:
    # The runaway tag becomes text at the limit; what follows is parsed again.
    head = "<thought a='" + "x" * (p.MAX_TAG_CHARS + 100)
    text = head + '<action id="q">{"name": "t"}</action>'
    whole = ev(text)
    assert [(e.type, e.data.get("kind")) for e in whole] == [
        (p.WARNING, "malformed_tag"), (p.TEXT, None), (p.ACTION_PARSED, None)]
    assert whole[0].data["message"] == (f"<thought tag runs past {p.MAX_TAG_CHARS} characters "
                                        "without '>'; treated as text")
    assert whole[1].data["text"] == head
    assert coalesce(feed_chunks(list(text))) == whole
