import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cortex_worker.protocol.variables import (
    PathError,
    Reference,
    Unresolved,
    find_references,
    iter_references,
    render,
    resolve_path,
    substitute,
)

pytestmark = pytest.mark.unit

LOOKUP = {
    "papers": [{"title": "A", "year": 2020}, {"title": "B", "year": 2021}],
    "cfg": {"depth": 3, "tags": ["x", "y"], "nested": {"ok": True}, "0": "zero-key"},
    "n": 42,
    "none": None,
    "flag": False,
    "name": "Ada",
    "price": 9.5,
    "uni": "naïve ☃",
}


# --- iter_references ---------------------------------------------------------------


def test_iter_references_simple_and_braced():
    refs = list(iter_references("a $x and ${y.z} b"))
    assert refs == [
        Reference("x", (), 2, 4, "$x"),
        Reference("y", ("z",), 9, 15, "${y.z}"),
    ]


def test_iter_references_paths():
    (ref,) = iter_references("$papers.0.title")
    assert ref.name == "papers"
    assert ref.path == ("0", "title")
    assert ref.text == "$papers.0.title"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("see $x.", [("x", ())]),
        ("see $x.y.", [("x", ("y",))]),
        ("$x..y", [("x", ())]),
        ("$x.0abc", [("x", ())]),
        ("$x.01", [("x", ("01",))]),
        ("$x._a1", [("x", ("_a1",))]),
        ("${a}b", [("a", ())]),
        ("$ab", [("ab", ())]),
        ("$a-b", [("a", ())]),
        ("$5", []),
        ("$", []),
        ("$ x", []),
        ("$$x", []),
        ("$${x}", []),
        ("$$$x", [("x", ())]),
        ("$$$$x", []),
        ("${", []),
        ("${x", []),
        ("${x.}", []),
        ("${5}", []),
        ("${x y}", []),
        ("${}", []),
        ("${$x}", [("x", ())]),
        ("$é", []),
        ("a$x", [("x", ())]),
        ("$x$y", [("x", ()), ("y", ())]),
    ],
)
def test_iter_references_grammar(text, expected):
    assert [(r.name, r.path) for r in iter_references(text)] == expected


def test_reference_span_matches_text():
    text = "pre ${a.b.1} mid $c.d post"
    for ref in iter_references(text):
        assert text[ref.start : ref.end] == ref.text


def test_reference_is_frozen():
    ref = next(iter_references("$x"))
    with pytest.raises(AttributeError):
        ref.name = "y"  # type: ignore[misc]


# --- find_references ---------------------------------------------------------------


def test_find_references_nested():
    value = {
        "query": "$topic",
        "$key_not_scanned": 1,
        "items": ["${a.b}", {"deep": ["text $c.0 more", 5, None, True]}],
        "escaped": "$$notref",
        "t": ("$tup",),
    }
    assert find_references(value) == {"topic", "a", "c", "tup"}


def test_find_references_scalars_and_empty():
    assert find_references("$x") == {"x"}
    assert find_references(3) == set()
    assert find_references(None) == set()
    assert find_references({}) == set()
    assert find_references("no refs $5 $$y") == set()


# --- resolve_path ------------------------------------------------------------------


def test_resolve_path_dicts_and_lists():
    assert resolve_path(LOOKUP["papers"], ["1", "title"]) == "B"
    assert resolve_path(LOOKUP["cfg"], ("tags", "0")) == "x"
    assert resolve_path(LOOKUP["cfg"], ()) is LOOKUP["cfg"]
    assert resolve_path(LOOKUP["cfg"], ["0"]) == "zero-key"


@pytest.mark.parametrize(
    "value, path, reason",
    [
        ({"a": 1}, ["b"], "no field 'b'"),
        ([1, 2], ["2"], "index 2 out of range (length 2)"),
        ([1, 2], ["x"], "cannot look up field 'x' in a list"),
        (5, ["x"], "cannot look up 'x' in int"),
        ("abc", ["0"], "cannot look up '0' in str"),
        (None, ["a"], "cannot look up 'a' in NoneType"),
    ],
)
def test_resolve_path_errors(value, path, reason):
    with pytest.raises(PathError) as info:
        resolve_path(value, path)
    assert info.value.reason == reason
    assert info.value.index == 0
    assert reason in str(info.value)
    assert isinstance(info.value, ValueError)


def test_resolve_path_error_index():
    with pytest.raises(PathError) as info:
        resolve_path({"a": {"b": []}}, ["a", "b", "0"])
    assert info.value.index == 2


# --- substitute: whole values ------------------------------------------------------


@pytest.mark.parametrize(
    "param, expected",
    [
        ("$papers", LOOKUP["papers"]),
        ("${papers}", LOOKUP["papers"]),
        ("$cfg", LOOKUP["cfg"]),
        ("$n", 42),
        ("$none", None),
        ("$flag", False),
        ("$price", 9.5),
        ("$papers.0", {"title": "A", "year": 2020}),
        ("${papers.1.year}", 2021),
        ("$cfg.nested.ok", True),
        ("$cfg.0", "zero-key"),
    ],
)
def test_whole_value_keeps_type(param, expected):
    result, unresolved = substitute(param, LOOKUP)
    assert result == expected
    assert type(result) is type(expected)
    assert unresolved == []


def test_whole_value_is_the_looked_up_object():
    result, _ = substitute("$papers", LOOKUP)
    assert result is LOOKUP["papers"]


def test_whole_value_in_params():
    params = {"items": "$papers", "limit": "$n", "opts": {"verbose": "$flag"}, "list": ["$none"]}
    result, unresolved = substitute(params, LOOKUP)
    assert result == {
        "items": LOOKUP["papers"],
        "limit": 42,
        "opts": {"verbose": False},
        "list": [None],
    }
    assert unresolved == []


# --- substitute: inline text -------------------------------------------------------


@pytest.mark.parametrize(
    "param, expected",
    [
        ("Hello $name!", "Hello Ada!"),
        ("Hello ${name}!", "Hello Ada!"),
        ("${name}son", "Adason"),
        ("$name$name", "AdaAda"),
        ("n=$n", "n=42"),
        ("v=$none", "v=null"),
        ("f=$flag", "f=false"),
        ("p=$price", "p=9.5"),
        ("first: $papers.0", 'first: {"title": "A", "year": 2020}'),
        ("tags=$cfg.tags", 'tags=["x", "y"]'),
        ("title: $papers.1.title.", "title: B."),
        ("u: $uni", "u: naïve ☃"),
        ("obj $cfg.nested", 'obj {"ok": true}'),
        (" $n", " 42"),
        ("$n ", "42 "),
    ],
)
def test_inline_becomes_text(param, expected):
    result, unresolved = substitute(param, LOOKUP)
    assert result == expected
    assert unresolved == []


def test_inline_non_json_value_uses_str():
    class Thing:
        def __str__(self) -> str:
            return "THING"

    result, _ = substitute("x=$t", {"t": Thing()})
    assert result == 'x="THING"'


def test_inline_unicode_not_escaped():
    result, _ = substitute("d=$d", {"d": {"k": "é"}})
    assert result == 'd={"k": "é"}'


# --- escapes -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "param, expected",
    [
        ("$$", "$"),
        ("cost $$5", "cost $5"),
        ("$$name", "$name"),
        ("$${name}", "${name}"),
        ("$$$name", "$Ada"),
        ("$$$$name", "$$name"),
        ("a $ b", "a $ b"),
    ],
)
def test_dollar_escapes(param, expected):
    result, unresolved = substitute(param, LOOKUP)
    assert result == expected
    assert unresolved == []
    assert render(param, LOOKUP) == (expected, [])


# --- left as written ---------------------------------------------------------------


@pytest.mark.parametrize(
    "text", ["$5", "$5.00", "costs $5", "${", "${name", "a ${ b", "${5}", "${}"]
)
def test_non_references_untouched(text):
    assert substitute(text, LOOKUP) == (text, [])
    assert render(text, LOOKUP) == (text, [])


def test_malformed_brace_keeps_inner_reference():
    assert render("${$name}", LOOKUP) == ("${Ada}", [])


def test_unknown_names_untouched_and_reported():
    result, unresolved = substitute({"q": "$unknown", "r": "x ${other.a} $name"}, LOOKUP)
    assert result == {"q": "$unknown", "r": "x ${other.a} Ada"}
    assert unresolved == [
        Unresolved("$unknown", "unknown variable"),
        Unresolved("${other.a}", "unknown variable"),
    ]


def test_unresolved_reported_per_occurrence():
    _, unresolved = render("$u $u", {})
    assert unresolved == [Unresolved("$u", "unknown variable")] * 2


@pytest.mark.parametrize(
    "param, reason",
    [
        ("$cfg.missing", "no field 'missing' in $cfg"),
        ("${cfg.nested.no}", "no field 'no' in $cfg.nested"),
        ("$papers.5", "index 5 out of range (length 2) in $papers"),
        ("$papers.title", "cannot look up field 'title' in a list in $papers"),
        ("$n.x", "cannot look up 'x' in int in $n"),
        ("$name.0", "cannot look up '0' in str in $name"),
        ("$none.a", "cannot look up 'a' in NoneType in $none"),
    ],
)
def test_bad_path_left_as_written_and_reported(param, reason):
    assert substitute(param, LOOKUP) == (param, [Unresolved(param, reason)])
    inline = f"before {param} after"
    assert substitute(inline, LOOKUP) == (inline, [Unresolved(param, reason)])
    assert render(inline, LOOKUP) == (inline, [Unresolved(param, reason)])


def test_unresolved_example_from_spec():
    assert substitute("$x.y", {"x": {}}) == ("$x.y", [Unresolved("$x.y", "no field 'y' in $x")])


def test_known_none_is_resolved_not_unknown():
    assert substitute("$v", {"v": None}) == (None, [])


# --- structure handling ------------------------------------------------------------


def test_nested_structures_and_keys_not_substituted():
    params = {
        "$name": "$name",
        "list": ["$n", "n=$n", 1, 2.5, None, True, ["${cfg.tags.1}"]],
        "tuple": ("$n",),
        "deep": {"a": {"b": {"c": "$papers.0.title"}}},
    }
    result, unresolved = substitute(params, LOOKUP)
    assert result == {
        "$name": "Ada",
        "list": [42, "n=42", 1, 2.5, None, True, ["y"]],
        "tuple": (42,),
        "deep": {"a": {"b": {"c": "A"}}},
    }
    assert unresolved == []


@pytest.mark.parametrize("scalar", [0, 1, -3.5, True, False, None])
def test_non_string_scalars_unchanged(scalar):
    result, unresolved = substitute(scalar, LOOKUP)
    assert result is scalar
    assert unresolved == []


def test_input_not_mutated():
    params = {"a": "$papers", "b": ["$n", {"c": "x $name"}], "d": "$$"}
    before = copy.deepcopy(params)
    lookup_before = copy.deepcopy(LOOKUP)
    result, _ = substitute(params, LOOKUP)
    assert params == before
    assert lookup_before == LOOKUP
    assert result is not params
    assert result["b"] is not params["b"]


def test_render_never_types_whole_value():
    assert render("$n", LOOKUP) == ("42", [])
    assert render("$papers.0", LOOKUP) == ('{"title": "A", "year": 2020}', [])
    assert render("$none", LOOKUP) == ("null", [])
    assert render("$name", LOOKUP) == ("Ada", [])


def test_lookup_can_be_any_mapping():
    from types import MappingProxyType

    assert substitute("$a", MappingProxyType({"a": [1]})) == ([1], [])


# --- properties --------------------------------------------------------------------

_alphabet = st.sampled_from(list("$${}.ab_Z09 é\n"))
_texts = st.text(alphabet=_alphabet, max_size=40) | st.text(max_size=40)


@given(st.text().filter(lambda s: "$" not in s), st.dictionaries(st.text(), st.integers()))
def test_text_without_dollar_is_unchanged(text, lookup):
    assert render(text, lookup) == (text, [])
    assert substitute(text, lookup) == (text, [])


@given(_texts)
def test_empty_lookup_only_collapses_dollar_pairs(text):
    # str.replace pairs "$$" left to right without overlap, exactly like the tokenizer: in a run
    # of k dollars both produce k // 2 + k % 2 dollars, and a reference never contains "$"
    # after its first character, so nothing else changes when every name is unknown.
    rendered, unresolved = render(text, {})
    assert rendered == text.replace("$$", "$")
    assert unresolved == [Unresolved(r.text, "unknown variable") for r in iter_references(text)]


@given(_texts, st.dictionaries(st.from_regex(r"[a-z_]{1,3}", fullmatch=True), st.integers()))
def test_escaping_every_dollar_makes_text_literal(text, lookup):
    escaped = text.replace("$", "$$")
    assert list(iter_references(escaped)) == []
    assert render(escaped, lookup) == (text, [])


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=10,
)


@given(_json)
def test_whole_reference_returns_value_unchanged(value):
    assert substitute("$v", {"v": value}) == (value, [])
    assert substitute("${v}", {"v": value}) == (value, [])


@given(_texts)
def test_reference_spans_are_exact(text):
    last = 0
    for ref in iter_references(text):
        assert text[ref.start : ref.end] == ref.text
        assert ref.start >= last
        last = ref.end
        assert ref.text.startswith("$")
        assert "$" not in ref.text[1:]
