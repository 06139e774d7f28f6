"""Unit tests for action-body JSON: strict, with comments and trailing commas repaired."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cortex_worker.protocol.lenient_json import JSONBodyError, loads

pytestmark = pytest.mark.unit

COMMENT = "removed a comment"
COMMA = "removed a trailing comma"


@pytest.mark.parametrize("text", [
    '{"name": "t", "parameters": {"q": [1, 2.5, true, null]}}',
    "[]", "{}", '"s"', "0", " \n\t{ }\n",
    '{"url": "http://x.org/a//b", "c": "/* not a comment */", "d": "a, ]"}',
    '{"esc": "quote \\" // still string", "s": "\\\\"}',
])
def test_valid_json_is_untouched(text: str) -> None:
    assert loads(text) == (json.loads(text), [])


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text("ab/*,]}\"\\ \n", max_size=8),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text("ab/*,", max_size=3), inner, max_size=3),
    max_leaves=10)


@settings(max_examples=200, deadline=None)
@given(value=JSON_VALUES, indent=st.sampled_from([None, 1]))
def test_any_valid_json_is_untouched(value: Any, indent: int | None) -> None:
    text = json.dumps(value, indent=indent)
    assert loads(text) == (value, [])


@pytest.mark.parametrize(("text", "value", "repairs"), [
    ('{"a": 1 // one\n}', {"a": 1}, [COMMENT]),
    ('// leading\n{"a": 1}', {"a": 1}, [COMMENT]),
    ('{"a": 1} // trailing, no newline', {"a": 1}, [COMMENT]),
    ('{/* x */"a": /* y\n z */ 1}', {"a": 1}, [COMMENT, COMMENT]),
    ('{"a": [1, 2,]}', {"a": [1, 2]}, [COMMA]),
    ('{"a": 1,}', {"a": 1}, [COMMA]),
    ('{"a": {"b": 1,\n},\n}', {"a": {"b": 1}}, [COMMA, COMMA]),
    ('[1, // one\n 2, /* two */\n]', [1, 2], [COMMENT, COMMENT, COMMA]),  # comma seen at ]
    ('{"u": "http://x//y", "v": "a,]", // c\n "w": "/*",}',
     {"u": "http://x//y", "v": "a,]", "w": "/*"}, [COMMENT, COMMA]),
])
def test_comments_and_trailing_commas_are_repaired(text: str, value: Any,
                                                   repairs: list[str]) -> None:
    assert loads(text) == (value, repairs)


def test_comment_like_text_inside_strings_is_untouched_when_repairing() -> None:
    text = '{"a": "// x", "b": "/* y */", "c": "z,}", "d": "q\\"//",}'
    assert loads(text) == ({"a": "// x", "b": "/* y */", "c": "z,}", "d": 'q"//'}, [COMMA])


@pytest.mark.parametrize(("text", "line", "column", "message"), [
    ('{"a" 1}', 1, 6, "invalid JSON: Expecting ':' delimiter"),
    ('\n\n  {"a": tru}', 3, 9, "invalid JSON: Expecting value"),
    ("", 1, 1, "invalid JSON: Expecting value"),
    ("1 2", 1, 3, "invalid JSON: Extra data"),
    ("{'a': 1}", 1, 2, "invalid JSON: Expecting property name enclosed in double quotes"),
    ('{"a": "unterminated}', 1, 7, "invalid JSON: Unterminated string starting at"),
    # a repair happened but the text is still invalid: the position is in the original text
    ('{"a": 1, // c\n "b": nope,}', 2, 7, "invalid JSON: Expecting value"),
    ('/* c */ {"a": 1} x', 1, 18, "invalid JSON: Extra data"),
])
def test_other_errors_raise_with_position(text: str, line: int, column: int,
                                          message: str) -> None:
    with pytest.raises(JSONBodyError) as info:
        loads(text)
    assert (info.value.message, info.value.line, info.value.column) == (message, line, column)
    assert isinstance(info.value, ValueError)
    assert str(info.value) == message


@pytest.mark.parametrize("text", ["[" * 100_000, "[" * 100_000 + "]" * 100_000,
                                  '{"a":' * 50_000 + "1" + "}" * 50_000,
                                  "[" * 100_000 + "1,]" + "]" * 99_999])
def test_deep_nesting_raises_json_body_error_not_recursion_error(text: str) -> None:
    with pytest.raises(JSONBodyError) as info:
        loads(text)
    assert info.value.message == "invalid JSON: nested too deeply"
    assert (info.value.line, info.value.column) == (1, 1)


def test_moderate_nesting_is_fine() -> None:
    text = "[" * 200 + "]" * 200
    value, repairs = loads(text)
    assert repairs == []
    depth = 0
    while value:
        value = value[0]
        depth += 1
    assert depth == 199
