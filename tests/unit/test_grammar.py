"""Protocol grammars generated from agent manifests (cortex_worker.llm.grammar).

The Lark flavour is parsed with Python's `lark` (the dialect llguidance reads); documents
sampled at random from the grammar itself must parse with the real `StreamParser` with no
protocol error and call real callables with valid parameters. The GBNF flavour is compiled by
llama.cpp itself in tests/model (it needs the model runtime); the structural tag's shape is
checked here against what XGrammar's `StructuralTagItem` requires.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from typing import get_args

import pytest
from jsonschema import Draft202012Validator
from lark import Lark
from lark.exceptions import LarkError

from cortex_worker.agents.spec import AgentSpec
from cortex_worker.llm import gateway
from cortex_worker.llm import grammar as gr
from cortex_worker.llm.config import ModelConfig
from cortex_worker.llm.stream import ModelError
from cortex_worker.manifests.loader import Registry
from cortex_worker.services.relics.spec import BUILTIN_RELICS
from cortex_worker.tools.spec import BUILTIN_TOOLS, ToolSpec
from cortex_worker.workflows.spec import WorkflowSpec
from tests.fake_llm import FakeLLM, Turn
from tests.model.checks import check

pytestmark = pytest.mark.unit

LOOKUP = ToolSpec(
    name="lookup", runtime="python", entrypoint="testtools:lookup",
    description="A tool whose schema uses every keyword the grammar enforces.",
    parameters={
        "type": "object",
        "properties": {
            "query": {"type": "string", "minLength": 2, "maxLength": 12},
            "limit": {"type": "integer", "minimum": 1, "maximum": 250},
            "offset": {"type": "integer", "minimum": -40, "exclusiveMaximum": 17},
            "score": {"type": "number", "exclusiveMinimum": 0},
            "weight": {"type": "number", "minimum": 0},
            "delta": {"type": "number"},
            "exact": {"type": "boolean"},
            "order": {"enum": ["asc", "desc", 3, None]},
            "mode": {"const": "fast"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                     "minItems": 1, "maxItems": 3},
            "filter": {"type": "object",
                       "properties": {"field": {"type": "string"},
                                      "values": {"type": "array", "items": {"type": "integer"}}},
                       "required": ["field"], "additionalProperties": False},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "either": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "null"}]},
            "many": {"type": ["integer", "boolean"]},
            "blob": {},
        },
        "required": ["query", "limit"],
        "additionalProperties": False,
    })
FLOW = WorkflowSpec(
    name="report", steps=[{"id": "one", "name": "echo"}],
    inputs={"type": "object", "properties": {"topic": {"type": "string", "minLength": 1}},
            "required": ["topic"], "additionalProperties": False})


@pytest.fixture(scope="module")
def registry() -> Registry:
    helper = AgentSpec(name="helper", description="A nested agent.")
    return Registry(tools={**BUILTIN_TOOLS, "lookup": LOOKUP}, agents={"helper": helper},
                    relics=dict(BUILTIN_RELICS), workflows={"report": FLOW})


@pytest.fixture(scope="module")
def agent() -> AgentSpec:
    return AgentSpec(name="smol", tools=["echo", "calculator", "lookup"], agents=["helper"],
                     relics=["kv"], workflows=["report"],
                     model=ModelConfig(grammar="lark", base_url="http://127.0.0.1:1/v1"))


@pytest.fixture(scope="module")
def targets(agent: AgentSpec, registry: Registry) -> list[gr.Target]:
    return gr.agent_targets(agent, registry)


@pytest.fixture(scope="module")
def lark(agent: AgentSpec, registry: Registry) -> Lark:
    text = gr.build_grammar(agent, registry, "lark")
    assert isinstance(text, str)
    return Lark(text, start="start", parser="earley", lexer="dynamic")


def accepts(parser: Lark, document: str) -> bool:
    try:
        parser.parse(document)
    except LarkError:
        return False
    return True


def tool(mode: str, name: str, parameters: str, kind: str = "tool") -> str:
    return f'<action type="{kind}" mode="{mode}">{{"name": "{name}", "parameters": {parameters}}}</action>'


VALID = {
    "a thought, then a sync action": '<thought>I will add them.</thought>\n'
    + tool("sync", "calculator", '{"expression": "2 + 2"}'),
    "a final answer alone": '<response final="true">It is 4 < 5, costing $$3 & more.</response>',
    "actions in the thought": '<thought>\nFirst <action type="tool" mode="async">{"name": "echo", '
    '"parameters": {"message": {"a": [1, 2.5, true, null], "b": "x"}}}</action> then.\n</thought>',
    "actions in the thought, then more": '<thought>a' + tool("async", "echo", "{}") + 'b</thought>'
    '\n' + tool("fire_and_forget", "echo", '{"message": "hi"}'),
    "actions then a progress response": tool("async", "calculator", '{"expression": "1/3"}')
    + "\n" + tool("async", "echo", "{}") + '\n<response final="false">Working on $x.</response>',
    "every keyword": tool("sync", "lookup", '{"query": "ab\\"\\u003c", "limit": 250, '
                      '"offset": -40, "score": 0.001, "weight": 0, "delta": -1.5e3, '
                      '"exact": false, "order": null, "mode": "fast", "tags": ["x", "yz"], '
                      '"filter": {"field": "f", "values": [1, -2]}, "labels": {"k": "v"}, '
                      '"either": null, "many": true, "blob": [{"deep": 1}]}'),
    "the smallest lookup": tool("sync", "lookup", '{"query": "ab", "limit": 1}'),
    "async actions, then a sync one": tool("async", "echo", "{}") + "\n"
    + tool("fire_and_forget", "echo", "{}") + "\n" + tool("sync", "echo", '{"message": 1}'),
    "an agent": tool("sync", "helper", '{"input": "Summarise this."}', kind="agent"),
    "a relic operation": tool("async", "kv.set", '{"key": "k", "value": [1, {}], "ttl": 2}',
                              kind="relic"),
    "a workflow": tool("sync", "report", '{"topic": "AI"}', kind="workflow"),
}

INVALID = {
    "an unknown tool": tool("sync", "shell", '{"expression": "2+2"}'),
    "a tool of the wrong type": tool("sync", "helper", '{"input": "x"}'),
    "a parameter of the wrong type": tool("sync", "calculator", '{"expression": 5}'),
    "a missing required parameter": tool("sync", "calculator", "{}"),
    "an undeclared parameter": tool("sync", "calculator", '{"expression": "1", "x": 1}'),
    "an integer above its maximum": tool("sync", "lookup", '{"query": "ab", "limit": 251}'),
    "an integer below its minimum": tool("sync", "lookup", '{"query": "ab", "limit": 0}'),
    "an exclusive maximum reached": tool("sync", "lookup", '{"query": "ab", "limit": 1, "offset": 17}'),
    "a zero that must be positive": tool("sync", "lookup", '{"query": "ab", "limit": 1, "score": 0}'),
    "a negative that may not be": tool("sync", "lookup", '{"query": "ab", "limit": 1, "weight": -1}'),
    "a string too short": tool("sync", "lookup", '{"query": "a", "limit": 1}'),
    "a string too long": tool("sync", "lookup", '{"query": "abcdefghijklm", "limit": 1}'),
    "a value outside the enum": tool("sync", "lookup", '{"query": "ab", "limit": 1, "order": "up"}'),
    "too many items": tool("sync", "lookup", '{"query": "ab", "limit": 1, "tags": ["a", "b", "c", "d"]}'),
    "too few items": tool("sync", "lookup", '{"query": "ab", "limit": 1, "tags": []}'),
    "a nested object without its required field":
        tool("sync", "lookup", '{"query": "ab", "limit": 1, "filter": {"values": []}}'),
    "a raw < in a string (could close the action)": tool("sync", "echo", '{"message": "</action>"}'),
    "an unknown mode": tool("parallel", "echo", "{}"),
    "an id (the parser numbers actions)": '<action type="tool" mode="sync" id="a">{"name": "echo", '
                                          '"parameters": {}}</action>',
    "a progress response with no action": '<response final="false">Still working.</response>',
    "no action and no final response": "<thought>Hmm.</thought>",
    "loose text": 'Sure! <response final="true">ok</response>',
    "a tag in thought text": '<thought>I <b>think</b></thought><response final="true">x</response>',
    "an unclosed action": '<action type="tool" mode="sync">{"name": "echo", "parameters": {}}',
    "an llm action": tool("sync", "headline", "{}", kind="llm"),
    "an internal action": tool("sync", "set_variable", '{"name": "a", "value": 1}', kind="internal"),
    "a relic without its operation": tool("sync", "kv", '{"key": "k"}', kind="relic"),
    "text over the limit": '<response final="true">' + "x" * 301 + "</response>",
    "three async actions after the thought": "\n".join([tool("async", "echo", "{}")] * 3),
    "three actions in a thought":
        "<thought>" + "".join([tool("async", "echo", "{}")] * 3) + "</thought>",
    "a sync action inside a thought (the turn stops there)":
        '<thought>a' + tool("sync", "echo", "{}") + "b</thought>",
    "anything after a sync action": tool("sync", "echo", "{}") + "\n" + tool("async", "echo", "{}"),
    "thought text after an action over its limit":
        "<thought>a" + tool("async", "echo", "{}") + "y" * 81 + "</thought>",
}


@pytest.mark.parametrize("name", VALID)
def test_the_lark_grammar_accepts_valid_documents(name: str, lark: Lark,
                                                   targets: list[gr.Target]) -> None:
    document = VALID[name]
    assert accepts(lark, document), document
    report = check([document], targets)
    assert report.clean, report


@pytest.mark.parametrize("name", INVALID)
def test_the_lark_grammar_rejects_invalid_documents(name: str, lark: Lark) -> None:
    assert not accepts(lark, INVALID[name]), INVALID[name]


def sample(rules: gr.Rules, rng: random.Random) -> str:
    """One random document of the grammar (a random derivation from `root`)."""
    pool = [chr(c) for c in range(32, 127)] + list("\n\té—中😀\x7f\x01")
    out: list[str] = []

    def walk(e: gr.Expr) -> None:
        match e:
            case gr.Lit(text):
                out.append(text)
            case gr.Chars(ranges, negated):
                inside = [c for c in pool if any(a <= ord(c) <= b for a, b in ranges)]
                choices = [c for c in pool if c not in inside] if negated else inside
                out.append(rng.choice(choices))
            case gr.Seq(items):
                for item in items:
                    walk(item)
            case gr.Alt(items):
                walk(rng.choice(items))
            case gr.Rep(item, lo, hi):
                top = lo + 4 if hi is None else min(hi, lo + 4)
                for _ in range(rng.randint(lo, top)):
                    walk(item)
            case gr.Ref(name):
                walk(rules.rules[name])

    walk(gr.Ref("root"))
    return "".join(out)


def test_documents_sampled_from_the_grammar_are_valid_protocol(
        agent: AgentSpec, registry: Registry, lark: Lark, targets: list[gr.Target]) -> None:
    """Whatever the grammar lets a model write parses with no protocol error (whole, and one
    character at a time) and calls real callables with parameters their schemas accept."""
    rules = gr.protocol_grammar(targets)
    rng = random.Random(20261125)
    seen: set[str] = set()
    for _ in range(150):
        document = sample(rules, rng)
        report = check([document], targets)
        assert report.clean, (document, report)
        assert report.actions or report.final, document  # every turn acts or answers
        assert check(list(document), targets).errors == []
        assert accepts(lark, document), document  # the Lark rendering agrees
        seen |= {f"{a.type.value}:{a.name}" for a in report.actions}
    assert len(seen) >= 8, seen  # the samples reached most callables


def bnf_rules(text: str) -> dict[str, str]:
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    return dict(line.split(" ::= ", 1) for line in lines)


@pytest.mark.parametrize("flavour", ["gbnf", "ebnf"])
def test_bnf_grammars_are_well_formed(flavour: str, agent: AgentSpec,
                                      registry: Registry) -> None:
    text = gr.build_grammar(agent, registry, flavour)
    assert isinstance(text, str) and text.startswith("# The Streaming Execution Protocol")
    rules = bnf_rules(text)
    assert next(iter(rules)) == "root"
    assert all(re.fullmatch(r"[a-z][a-z0-9-]*", name) for name in rules)  # GBNF: no '_'
    bodies = " ".join(re.sub(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]', " ", body)
                      for body in rules.values())
    used = set(re.findall(r"[a-z][a-z0-9-]*", bodies))
    assert used <= set(rules), used - set(rules)
    assert set(rules) - used == {"root"}  # and nothing is left unused
    assert '"\\"calculator\\","' in rules["tool-call"]


def test_the_structural_tag_has_xgrammars_shape(agent: AgentSpec, registry: Registry,
                                                targets: list[gr.Target]) -> None:
    """XGrammar's legacy structural tag (what vLLM and SGLang take as response_format):
    {"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers"}, each
    begin starting with a trigger. The xgrammar wheel needs torch, so it is not a dev
    dependency; this grammar was compiled and matched with xgrammar 0.2.8 when it was written
    (docs/performance.md, 2026-11-25)."""
    tag = gr.build_grammar(agent, registry, "structural_tag")
    assert isinstance(tag, dict)
    assert set(tag) == {"type", "structures", "triggers"} and tag["type"] == "structural_tag"
    assert tag["triggers"] == ["<action"]
    begins = [s["begin"] for s in tag["structures"]]
    assert len(begins) == len(set(begins)) == len(targets) * len(gr.MODES)
    for structure in tag["structures"]:
        assert set(structure) == {"begin", "schema", "end"}
        assert structure["begin"].startswith("<action") and structure["end"] == "}</action>"
        Draft202012Validator.check_schema(structure["schema"])
    json.dumps(tag)  # it travels as JSON
    # Each structure, filled with valid parameters, is one valid action.
    examples = {"echo": {}, "calculator": {"expression": "1+1"}, "helper": {"input": "x"},
                "report": {"topic": "t"}, "lookup": {"query": "ab", "limit": 3},
                "kv.get": {"key": "k"}, "kv.set": {"key": "k", "value": 1},
                "kv.delete": {"key": "k"}, "kv.list": {}}
    for structure in tag["structures"]:
        name = json.loads(structure["begin"].split(">", 1)[1] + "0}")["name"]
        document = structure["begin"] + json.dumps(examples[name]) + structure["end"]
        report = check([document], targets)
        assert report.clean and [a.name for a in report.actions] == [name], document


def test_an_agent_with_nothing_to_call_may_only_answer(registry: Registry) -> None:
    mute = AgentSpec(name="mute")
    parser = Lark(gr.build_grammar(mute, registry, "lark"), start="start", lexer="dynamic")
    assert accepts(parser, '<thought>No tools.</thought>\n<response final="true">Hi</response>')
    assert not accepts(parser, tool("sync", "echo", "{}"))
    assert gr.build_grammar(mute, registry, "structural_tag") == {
        "type": "structural_tag", "structures": [], "triggers": ["<action"]}


def test_no_flavour_no_grammar_and_unknown_names_are_errors(registry: Registry) -> None:
    assert gr.build_grammar(AgentSpec(name="a"), registry, None) is None
    with pytest.raises(gr.GrammarError, match="unknown grammar flavour 'yacc'"):
        gr.build_grammar(AgentSpec(name="a"), registry, "yacc")
    with pytest.raises(gr.GrammarError, match="tool 'nope'"):
        gr.build_grammar(AgentSpec(name="a", tools=["nope"]), registry, "gbnf")
    with pytest.raises(gr.GrammarError, match="relic 'nope'"):
        gr.build_grammar(AgentSpec(name="a", relics=["nope"]), registry, "gbnf")


def test_unsupported_keywords_fall_back_to_any_value_of_the_type(registry: Registry) -> None:
    loose = ToolSpec(name="loose", runtime="python", entrypoint="m:f", parameters={
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$", "maxLength": 5},
                       "ref": {"$ref": "#/$defs/x"}},
        "required": ["code", "ref"], "$defs": {"x": {"type": "integer"}}})
    reg = Registry(tools={"loose": loose})
    parser = Lark(gr.build_grammar(AgentSpec(name="a", tools=["loose"]), reg, "lark"),
                  start="start", lexer="dynamic")
    # `pattern` is not enforced (any string within maxLength), `$ref` takes any JSON value.
    assert accepts(parser, tool("sync", "loose", '{"code": "abc", "ref": {"x": [true]}}'))
    assert not accepts(parser, tool("sync", "loose", '{"code": "abcdef", "ref": 1}'))


@pytest.mark.parametrize(("lo", "hi"), [(0, 0), (0, 9), (1, 250), (7, 1234), (-40, 16),
                                        (-1005, -17), (999, 1000), (123, 987654)])
def test_integer_ranges_are_exact(lo: int, hi: int) -> None:
    rules = gr.Rules()
    ref = gr._Json(rules, gr.Limits()).integer(lo, hi)
    pattern = re.compile(gr._regex(rules.rules[ref.name]))
    probes = {lo - 2, lo - 1, lo, lo + 1, hi - 1, hi, hi + 1, hi + 2, 0, -1, 10, 100, 999,
              1000, (lo + hi) // 2, *random.Random(lo * 7 + hi).sample(range(lo - 50, hi + 50),
                                                                         40)}
    for n in probes:
        assert bool(pattern.fullmatch(str(n))) == (lo <= n <= hi), (lo, hi, n)
    assert not pattern.fullmatch("007") and not pattern.fullmatch("-0")


def test_the_flavour_table_matches_the_manifest_field() -> None:
    assert set(get_args(get_args(ModelConfig.model_fields["grammar"].annotation)[0])) == set(
        gr.FLAVOURS)
    assert ModelConfig().grammar is None  # off by default
    with pytest.raises(ValueError, match="cannot constrain decoding"):
        ModelConfig(provider="anthropic", grammar="gbnf")
    with pytest.raises(ValueError):
        ModelConfig(grammar="regex")


EXPECTED_FIELDS = {
    "gbnf": lambda g: {"grammar": g},
    "ebnf": lambda g: {"ebnf": g, "structured_outputs": {"grammar": g}},
    "lark": lambda g: {"structured_outputs": {"grammar": g}},
    "structural_tag": lambda g: {"response_format": g},
}


@pytest.fixture(scope="module")
def llm() -> Iterator[FakeLLM]:
    with FakeLLM() as server:
        yield server


@pytest.mark.parametrize("flavour", sorted(EXPECTED_FIELDS))
def test_the_gateway_sends_the_grammar_in_the_flavours_fields(
        flavour: str, llm: FakeLLM, agent: AgentSpec, registry: Registry) -> None:
    model = f"grammar-{flavour}"
    llm.script(model, [Turn(text='<response final="true">ok</response>')])
    config = ModelConfig(base_url=llm.url, model=model, api_key_env=None, grammar=flavour)
    grammar = gr.build_grammar(agent, registry, flavour)
    assert grammar is not None
    list(gateway.open_stream(config, [{"role": "user", "content": "hi"}], grammar=grammar))
    (body,) = llm.requests(model)
    sent = {k: v for k, v in body.items() if k in {"grammar", "ebnf", "structured_outputs",
                                                  "response_format"}}
    assert sent == EXPECTED_FIELDS[flavour](grammar)


def test_without_a_grammar_the_request_is_unchanged(llm: FakeLLM) -> None:
    llm.script("plain", [Turn(text="hi")])
    config = ModelConfig(base_url=llm.url, model="plain", api_key_env=None, grammar="gbnf")
    list(gateway.open_stream(config, [{"role": "user", "content": "hi"}]))
    (body,) = llm.requests("plain")
    assert not {"grammar", "ebnf", "structured_outputs", "response_format"} & set(body)


def test_a_grammar_without_a_flavour_is_refused_before_any_request(llm: FakeLLM) -> None:
    config = ModelConfig(base_url=llm.url, model="unflavoured", api_key_env=None)
    with pytest.raises(ModelError, match="names no flavour"):
        list(gateway.open_stream(config, [], grammar='root ::= "x"'))
    assert llm.requests("unflavoured") == []


def test_tool_choice_required_demands_an_action_before_any_response(
        agent: AgentSpec, registry: Registry) -> None:
    """`required`: an answer alone is refused; an action first (in a thought or not) is
    fine, and so is an answer after it. `none`: no action at all."""
    required = gr.build_grammar(agent, registry, "lark", tool_choice="required")
    none = gr.build_grammar(agent, registry, "lark", tool_choice="none")
    assert isinstance(required, str) and isinstance(none, str)
    must, may_not = (Lark(text, start="start", parser="earley", lexer="dynamic")
                     for text in (required, none))
    answer = '<response final="true">4</response>'
    act = tool("async", "calculator", '{"expression": "2 + 2"}')
    assert not accepts(must, answer)
    assert not accepts(must, f"<thought>Easy.</thought>\n{answer}")
    assert accepts(must, f"{act}\n{answer}")
    assert accepts(must, f"<thought>Let me compute.{act}</thought>")
    assert accepts(must, tool("sync", "calculator", '{"expression": "2 + 2"}'))
    assert accepts(may_not, answer)
    assert not accepts(may_not, f"{act}\n{answer}")


def test_a_tool_named_by_tool_choice_is_the_only_action_and_comes_first(
        agent: AgentSpec, registry: Registry) -> None:
    """A tool's name: an action of that tool before any response, and no other target."""
    named = gr.build_grammar(agent, registry, "lark", tool_choice="calculator")
    assert isinstance(named, str)
    parser = Lark(named, start="start", parser="earley", lexer="dynamic")
    answer = '<response final="true">4</response>'
    calculate = tool("async", "calculator", '{"expression": "2 + 2"}')
    echo = tool("async", "echo", '{"message": "hi"}')
    assert accepts(parser, f"{calculate}\n{answer}")
    assert not accepts(parser, answer)
    assert not accepts(parser, f"{echo}\n{answer}")
    with pytest.raises(gr.GrammarError, match="not a tool of agent"):
        gr.build_grammar(agent, registry, "lark", tool_choice="no_such_tool")


def test_an_output_schema_makes_the_final_response_its_json(
        agent: AgentSpec, registry: Registry) -> None:
    """`output_schema`: the final response is a JSON value of it; a progress response
    (final="false") is still text."""
    typed = agent.model_copy(update={"output_schema": {
        "type": "object", "properties": {"answer": {"type": "integer"}},
        "required": ["answer"], "additionalProperties": False}})
    text = gr.build_grammar(typed, registry, "lark")
    assert isinstance(text, str)
    parser = Lark(text, start="start", parser="earley", lexer="dynamic")
    assert accepts(parser, '<response final="true">{"answer": 42}</response>')
    assert not accepts(parser, '<response final="true">It is 42.</response>')
    assert not accepts(parser, '<response final="true">{"answer": "42"}</response>')
    act = tool("async", "calculator", '{"expression": "6 * 7"}')
    assert accepts(parser, f'{act}\n<response final="false">Working on it.</response>')
