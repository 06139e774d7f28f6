"""Grammars that hold a model to the Streaming Execution Protocol, for engines that constrain
decoding (`model.grammar` in an agent manifest).

`build_grammar(agent, registry, flavour)` generates, from the agent's manifest, a grammar that
admits exactly this shape of a turn:

    [ws] ( <thought>TEXT (ASYNC GAP){1,A}</thought> [ws TAIL]
         | [<thought>TEXT</thought> ws] TAIL )
    TAIL   = ASYNC (ws ASYNC){0,A-1} [ws (SYNC | RESPONSE)]  |  SYNC
           | <response final="true">TEXT</response>
    ASYNC  = <action type="T" mode="async|fire_and_forget">{"name": "N", "parameters": P}</action>
    SYNC   = <action type="T" mode="sync">{"name": "N", "parameters": P}</action>

so every turn starts at least one action or ends with a final response (protocol.md, turns),
and a sync action, at which the runtime stops reading, is the last thing a turn writes.
`T`/`N` is one of the agent's tools, agents, relic operations (`relic.operation`) or workflows,
and `P` is a JSON value that the callable's JSON Schema accepts (agents take
`{"input": "<task>"}`, workflows their `inputs`).

Deliberate limits, all to keep a constrained model out of protocol errors:

- No `id` attribute: a context-free grammar cannot stop a model from reusing an id
  (`duplicate_id`), so the parser numbers the actions itself (`calculator-1`, …) and results
  come back under those ids. No `depends_on` either (it could name an unknown id).
- Text in thoughts and responses never holds `<` followed by a letter, `/` or `<` (so no tag is
  ever half-written); JSON strings never hold a raw `<` (so never `</action>`): a model writes
  `\\u003c`. JSON whitespace is at most one space; between blocks, at most two spaces/newlines.
- Everything is bounded (`Limits`): stretches of text, strings and arrays (a smaller
  `maxLength` / `maxItems` wins; a larger `minLength` / `minItems` too), free-form objects,
  the nesting of any-JSON values, digits, actions per turn. So a turn is bounded too, and a
  `max_tokens` with room for it means no block is ever cut open: no grammar can bound a
  turn in tokens, so the room is measured (docs/performance.md: SmolLM2-135M's longest turn
  was 381 tokens; the tests give 1024).
- `llm` and `internal` actions are not admitted (the issue's list: tools, agents, relics,
  workflows).

JSON Schema support, for parameters:

- enforced: `type` (one or a list), `enum`, `const`, `anyOf`/`oneOf` (as alternatives; the
  "exactly one" of oneOf is not checked), `properties` + `required` (members are written in
  the declared order; only declared members, even when `additionalProperties` allows more),
  `additionalProperties` as the schema of members of an object without `properties`,
  `items`, `minItems`/`maxItems`, `minLength`/`maxLength`, and for integers `minimum`,
  `maximum`, `exclusiveMinimum`, `exclusiveMaximum` (exact digit ranges); for numbers only
  the sign (`minimum: 0` forbids `-`; a positive `minimum`, or `exclusiveMinimum` >= 0,
  forbids `-` and zero).
- not enforced, the value falls back to any value of its type: `pattern`, `format`,
  `multipleOf`, number bounds beyond the sign, `uniqueItems`, `contains`, `minProperties`,
  `maxProperties`, `propertyNames`, `patternProperties`, `dependentRequired`.
- not enforced, the value falls back to any JSON value: `$ref`, `allOf`, `not`,
  `if`/`then`/`else`, `prefixItems`, `dependentSchemas`, and a schema without a `type` that
  names no properties or items.

Flavours (`FLAVOURS`, one row each): `gbnf` (llama.cpp server `grammar`), `ebnf` (XGrammar's
EBNF, which is GBNF-compatible: SGLang `ebnf`, vLLM `structured_outputs.grammar`), `lark`
(llguidance's Lark dialect, which Python's `lark` also parses: vLLM
`structured_outputs.grammar`) and `structural_tag` (XGrammar's structural tag, legacy
`structures`/`triggers` form, as `response_format`: vLLM and SGLang). A structural tag only
constrains what follows its trigger `<action`: text outside actions stays free.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from cortex_worker.actions.table import ACTION_TYPES
from cortex_worker.errors import CortexError
from cortex_worker.llm.config import CHOICES

if TYPE_CHECKING:
    from cortex_worker.actions.types.base import ClientTool
    from cortex_worker.agents.spec import AgentSpec
    from cortex_worker.llm.config import ToolChoice
    from cortex_worker.manifests.loader import Registry

__all__ = [
    "FLAVOURS",
    "Flavour",
    "Grammar",
    "GrammarError",
    "Limits",
    "Target",
    "agent_targets",
    "build_grammar",
    "request_fields",
]

FlavourName = Literal["gbnf", "lark", "ebnf", "structural_tag"]
MODES = ("sync", "async", "fire_and_forget")
_FALLBACK_ANY = ("$ref", "allOf", "not", "if", "then", "else", "prefixItems",
                 "dependentSchemas")


Grammar = str | dict[str, Any]
"""A built grammar: the text of a gbnf, ebnf or lark grammar, or a structural tag object."""


class GrammarError(CortexError, ValueError):
    """The agent names something the registry does not have, or an unknown flavour."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds that keep every constrained turn finite (see the module docstring)."""

    text: int = 300
    """Characters of a thought's text before its first action, or of a response."""
    gap: int = 80
    """Characters of thought text after each action in the thought."""
    string: int = 120
    """Characters of a JSON string (fewer if its `maxLength` says so)."""
    items: int = 6
    """Items of an array (fewer if its `maxItems` says so), members of a free-form object."""
    depth: int = 2
    """Nesting of an any-JSON value (0: scalars only)."""
    digits: int = 15
    """Digits of a number's integer part, and of its fraction (an exponent has 1 or 2)."""
    actions: int = 2
    """Actions inside the thought; async actions after it (then one sync action at most)."""


# ------------------------------------------------------------------- grammar expressions
@dataclass(frozen=True, slots=True)
class Lit:
    text: str


@dataclass(frozen=True, slots=True)
class Chars:
    """One character: in `ranges` (code point pairs), or not in them when `negated`."""

    ranges: tuple[tuple[int, int], ...]
    negated: bool = False


@dataclass(frozen=True, slots=True)
class Seq:
    items: tuple[Expr, ...]


@dataclass(frozen=True, slots=True)
class Alt:
    items: tuple[Expr, ...]


@dataclass(frozen=True, slots=True)
class Rep:
    item: Expr
    lo: int
    hi: int | None  # None: unbounded


@dataclass(frozen=True, slots=True)
class Ref:
    name: str


Expr = Lit | Chars | Seq | Alt | Rep | Ref
EMPTY = Lit("")


def seq(*items: Expr) -> Expr:
    flat: list[Expr] = []
    for item in items:
        parts = item.items if isinstance(item, Seq) else (item,)
        for part in parts:
            if part == EMPTY:
                continue
            if flat and isinstance(part, Lit) and isinstance(flat[-1], Lit):
                flat[-1] = Lit(flat[-1].text + part.text)
            else:
                flat.append(part)
    return flat[0] if len(flat) == 1 else Seq(tuple(flat)) if flat else EMPTY


def alt(*items: Expr) -> Expr:
    unique = tuple(dict.fromkeys(items))
    return unique[0] if len(unique) == 1 else Alt(unique)


def rep(item: Expr, lo: int, hi: int | None) -> Expr:
    if hi == 0:
        return EMPTY
    if lo == hi == 1:
        return item
    return Rep(item, lo, hi)


def opt(item: Expr) -> Expr:
    return rep(item, 0, 1)


def chars(spec: str, *, negated: bool = False) -> Chars:
    """A class from `spec`: single characters, and `a-z` ranges."""
    ranges: list[tuple[int, int]] = []
    i = 0
    while i < len(spec):
        if i + 2 < len(spec) and spec[i + 1] == "-":
            ranges.append((ord(spec[i]), ord(spec[i + 2])))
            i += 3
        else:
            ranges.append((ord(spec[i]), ord(spec[i])))
            i += 1
    return Chars(tuple(ranges), negated)


@dataclass(slots=True)
class Rules:
    """Named rules; `root` is the start. Names are lowercase words joined by '-'."""

    rules: dict[str, Expr] = field(default_factory=dict)
    _by_expr: dict[Expr, str] = field(default_factory=dict)

    def rule(self, hint: str, expr: Expr) -> Ref:
        """A rule for `expr` (the existing one if the same expression has one already)."""
        if isinstance(expr, Ref):
            return expr
        known = self._by_expr.get(expr)
        if known is not None:
            return Ref(known)
        base = _rule_name(hint)
        name, n = base, 1
        while name in self.rules:
            n += 1
            name = f"{base}-{n}"
        self.rules[name] = expr
        self._by_expr[expr] = name
        return Ref(name)

    def placeholder(self, hint: str) -> Ref:
        """A name reserved now and defined later with `define` (for recursive rules)."""
        base = _rule_name(hint)
        name, n = base, 1
        while name in self.rules:
            n += 1
            name = f"{base}-{n}"
        self.rules[name] = EMPTY
        return Ref(name)

    def define(self, ref: Ref, expr: Expr) -> None:
        self.rules[ref.name] = expr


def _rule_name(hint: str) -> str:
    words = re.findall(r"[a-z0-9]+", hint.lower())
    name = "-".join(words) or "rule"
    return name if name[0].isalpha() else f"r-{name}"


# ------------------------------------------------------------------- JSON values
_STRING_CHAR = alt(
    chars('"\\<\x00-\x1f\x7f', negated=True),
    seq(Lit("\\"), alt(chars('"\\/bfnrt'), seq(Lit("u"), rep(chars("0-9a-fA-F"), 4, 4)))),
)
_DIGIT = chars("0-9")
_NONZERO = chars("1-9")


class _Json:
    """JSON Schema → grammar expressions for JSON values, in one `Rules`."""

    def __init__(self, grammar: Rules, limits: Limits) -> None:
        self.g = grammar
        self.limits = limits
        self._any: dict[int, Ref] = {}
        self.ws = grammar.rule("json-ws", opt(Lit(" ")))

    # -- scalars ---------------------------------------------------------------------------
    def string(self, lo: int = 0, hi: int | None = None) -> Expr:
        hi = self.limits.string if hi is None else hi
        hi = max(min(hi, max(self.limits.string, lo)), lo)
        return self.g.rule(f"string-{lo}-{hi}" if (lo, hi) != (0, self.limits.string)
                           else "string", seq(Lit('"'), rep(_STRING_CHAR, lo, hi), Lit('"')))

    def number(self, sign: Literal["any", "not-negative", "positive"] = "any") -> Expr:
        n = self.limits.digits
        whole = seq(_NONZERO, rep(_DIGIT, 0, n - 1))
        fraction = seq(Lit("."), rep(_DIGIT, 1, n))
        exponent = opt(seq(chars("eE"), opt(chars("+-")), rep(_DIGIT, 1, 2)))  # finite, non-zero
        if sign == "positive":  # never 0: a non-zero digit before the point, or after its zeros
            small = seq(Lit("0."), rep(Lit("0"), 0, n - 1), _NONZERO, rep(_DIGIT, 0, n - 1))
            body = seq(alt(seq(whole, opt(fraction)), small), exponent)
        else:
            body = seq(opt(Lit("-")) if sign == "any" else EMPTY, alt(Lit("0"), whole),
                       opt(fraction), exponent)
        return self.g.rule("number" if sign == "any" else f"number-{sign}", body)

    def integer(self, lo: int | None, hi: int | None) -> Expr:
        top = 10 ** self.limits.digits - 1
        lo = -top if lo is None else max(lo, -top)
        hi = top if hi is None else min(hi, top)
        if lo > hi:  # nothing fits: keep the grammar well-formed with the closest value
            hi = lo
        parts: list[Expr] = []
        if hi >= 0:
            parts += _digit_ranges(max(lo, 0), hi)
        if lo < 0:
            parts += [seq(Lit("-"), p) for p in _digit_ranges(-min(hi, -1), -lo)]
        hint = "integer" if (lo, hi) == (-top, top) else f"integer-{lo}-{hi}".replace("--", "-m")
        return self.g.rule(hint, alt(*parts))

    # -- any value ---------------------------------------------------------------------------
    def any(self, depth: int | None = None) -> Expr:
        depth = self.limits.depth if depth is None else depth
        if depth in self._any:
            return self._any[depth]
        scalars = [self.string(), self.number(), Lit("true"), Lit("false"), Lit("null")]
        if depth > 0:
            inner = self.any(depth - 1)
            member = seq(self.string(), self.ws, Lit(":"), self.ws, inner)
            scalars += [self._object_of(member, 0, self.limits.items, f"object-{depth}"),
                        self._array_of(inner, 0, self.limits.items, f"array-{depth}")]
        ref = self.g.rule(f"json-value-{depth}", alt(*scalars))
        self._any[depth] = ref
        return ref

    def _array_of(self, item: Expr, lo: int, hi: int, hint: str) -> Expr:
        more = seq(self.ws, Lit(","), self.ws, item)
        if hi <= 0:
            body = seq(Lit("["), self.ws, Lit("]"))
        else:
            items = seq(item, rep(more, max(lo - 1, 0), hi - 1))
            body = seq(Lit("["), self.ws, items if lo >= 1 else opt(items), self.ws, Lit("]"))
        return self.g.rule(hint, body)

    def _object_of(self, member: Expr, lo: int, hi: int, hint: str) -> Expr:
        more = seq(self.ws, Lit(","), self.ws, member)
        if hi <= 0:
            body = seq(Lit("{"), self.ws, Lit("}"))
        else:
            members = seq(member, rep(more, max(lo - 1, 0), hi - 1))
            body = seq(Lit("{"), self.ws, members if lo >= 1 else opt(members), self.ws,
                       Lit("}"))
        return self.g.rule(hint, body)

    # -- schemas ---------------------------------------------------------------------------
    def value(self, schema: Any, hint: str) -> Expr:
        """The JSON values `schema` accepts (see the module docstring for what is enforced)."""
        if schema is True or schema == {} or not isinstance(schema, Mapping):
            return self.any()
        if "const" in schema:
            return Lit(_dumps(schema["const"]))
        if "enum" in schema and isinstance(schema["enum"], list) and schema["enum"]:
            return alt(*(Lit(_dumps(v)) for v in schema["enum"]))
        if any(key in schema for key in _FALLBACK_ANY):
            return self.any()
        for key in ("anyOf", "oneOf"):
            options = schema.get(key)
            if isinstance(options, list) and options:
                rest = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
                return alt(*(self.value({**rest, **o} if isinstance(o, Mapping) else o,
                                        f"{hint}-{i}") for i, o in enumerate(options)))
        declared = schema.get("type")
        if declared is None:
            if "properties" in schema or "required" in schema:
                declared = "object"
            elif "items" in schema:
                declared = "array"
            else:
                return self.any()
        if isinstance(declared, list):
            return alt(*(self.value({**schema, "type": t}, f"{hint}-{t}") for t in declared))
        make = self._TYPES.get(declared)
        return make(self, schema, hint) if make else self.any()

    def _string(self, schema: Mapping[str, Any], hint: str) -> Expr:
        lo = _int(schema.get("minLength"), 0)
        hi = schema.get("maxLength")
        return self.string(lo, _int(hi, 0) if hi is not None else None)

    def _number(self, schema: Mapping[str, Any], hint: str) -> Expr:
        low, ex_low = schema.get("minimum"), schema.get("exclusiveMinimum")
        if (_is_number(low) and low > 0) or (_is_number(ex_low) and ex_low >= 0):
            return self.number("positive")
        if _is_number(low) and low == 0:
            return self.number("not-negative")
        return self.number()

    def _integer(self, schema: Mapping[str, Any], hint: str) -> Expr:
        lo, hi = schema.get("minimum"), schema.get("maximum")
        lo = _ceil(lo) if _is_number(lo) else None
        hi = _floor(hi) if _is_number(hi) else None
        ex_lo, ex_hi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
        if _is_number(ex_lo):
            lo = max(lo if lo is not None else _floor(ex_lo) + 1, _floor(ex_lo) + 1)
        if _is_number(ex_hi):
            hi = min(hi if hi is not None else _ceil(ex_hi) - 1, _ceil(ex_hi) - 1)
        return self.integer(lo, hi)

    def _array(self, schema: Mapping[str, Any], hint: str) -> Expr:
        items = schema.get("items", True)
        item = self.value(items, f"{hint}-item")
        lo = _int(schema.get("minItems"), 0)
        most = schema.get("maxItems")
        hi = max(lo, min(self.limits.items, self.limits.items if most is None else _int(most, 0)))
        return self._array_of(item, lo, hi, hint)

    def _object(self, schema: Mapping[str, Any], hint: str) -> Expr:
        properties = schema.get("properties")
        properties = dict(properties) if isinstance(properties, Mapping) else {}
        required = [r for r in schema.get("required") or [] if isinstance(r, str)]
        for name in required:  # required but undeclared: any value
            properties.setdefault(name, True)
        properties = {k: v for k, v in properties.items() if v is not False}
        if not properties:
            extra = schema.get("additionalProperties", True)
            if extra is False:
                return self.g.rule(f"{hint}-empty", seq(Lit("{"), self.ws, Lit("}")))
            member = seq(self.string(), self.ws, Lit(":"), self.ws,
                         self.value(extra, f"{hint}-value"))
            return self._object_of(member, 0, self.limits.items, hint)
        members = [(seq(Lit(_dumps(name)), self.ws, Lit(":"), self.ws,
                        self.value(sub, f"{hint}-{name}")), name in required)
                   for name, sub in properties.items()]
        # members[i:], after something (`after`) or not: one rule per (i, after), so a long
        # run of optional members stays linear in size.
        tails: dict[tuple[int, bool], Expr] = {}

        def tail(i: int, after: bool) -> Expr:
            if i == len(members):
                return EMPTY
            if (i, after) not in tails:
                member, needed = members[i]
                lead = seq(self.ws, Lit(","), self.ws) if after else EMPTY
                take = seq(lead, member, tail(i + 1, True))
                expr = take if needed else alt(take, tail(i + 1, after))
                tails[(i, after)] = expr if i == 0 or expr == EMPTY else \
                    self.g.rule(f"{hint}-from-{i}{'-more' if after else ''}", expr)
            return tails[(i, after)]

        body = tail(0, False)
        return self.g.rule(hint, seq(Lit("{"), self.ws, body, self.ws, Lit("}")))

    def _boolean(self, schema: Mapping[str, Any], hint: str) -> Expr:
        return alt(Lit("true"), Lit("false"))

    def _null(self, schema: Mapping[str, Any], hint: str) -> Expr:
        return Lit("null")

    _TYPES: ClassVar[dict[str, Callable[[_Json, Mapping[str, Any], str], Expr]]] = {
        "string": _string, "number": _number, "integer": _integer, "array": _array,
        "object": _object, "boolean": _boolean, "null": _null,
    }


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=True, separators=(", ", ": ")).replace("<", "\\u003c")


def _int(value: Any, default: int) -> int:
    return int(value) if _is_number(value) and value >= 0 else default


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _floor(value: float) -> int:
    return int(value // 1)


def _ceil(value: float) -> int:
    return -int(-value // 1)


def _digit_ranges(lo: int, hi: int) -> list[Expr]:
    """Expressions for the decimal integers lo..hi (0 <= lo <= hi), without leading zeros;
    the widest first (a regex engine that takes the first alternative that matches, as
    Python's does, must not stop at `25` in `250`)."""
    out: list[Expr] = []
    for width in range(len(str(hi)), len(str(lo)) - 1, -1):
        a = max(lo, 10 ** (width - 1) if width > 1 else 0)
        b = min(hi, 10 ** width - 1)
        if a <= b:
            out += [seq(*(_digit_class(x, y) for x, y in pattern))
                    for pattern in _same_width(str(a), str(b))]
    return out


def _digit_class(lo: str, hi: str) -> Expr:
    return Lit(lo) if lo == hi else chars(f"{lo}-{hi}")


def _same_width(a: str, b: str) -> list[list[tuple[str, str]]]:
    """Digit-wise patterns covering a..b (strings of one width)."""
    if len(a) == 1:
        return [[(a, b)]]
    n = len(a) - 1
    zeros, nines = "0" * n, "9" * n
    if a[0] == b[0]:
        return [[(a[0], a[0]), *p] for p in _same_width(a[1:], b[1:])]
    if a[1:] == zeros and b[1:] == nines:
        return [[(a[0], b[0])] + [("0", "9")] * n]
    out: list[list[tuple[str, str]]] = []
    start, end = int(a[0]), int(b[0])
    if a[1:] != zeros:
        out += [[(a[0], a[0]), *p] for p in _same_width(a[1:], nines)]
        start += 1
    if b[1:] != nines:
        end -= 1
    if start <= end:
        out.append([(str(start), str(end))] + [("0", "9")] * n)
    if b[1:] != nines:
        out += [[(b[0], b[0]), *p] for p in _same_width(zeros, b[1:])]
    return out


# ------------------------------------------------------------------- the protocol
@dataclass(frozen=True, slots=True)
class Target:
    """One thing an action may name: its type, name and parameter schema."""

    type: str
    name: str
    parameters: Mapping[str, Any]


def agent_targets(agent: AgentSpec, registry: Registry,
                  client_tools: Sequence[ClientTool] = ()) -> list[Target]:
    """What the agent may call, type by type in the table's order, each in manifest order;
    the job's client tools after the agent's own tools."""
    found: list[Target] = []
    for row in ACTION_TYPES.values():
        try:
            found += [Target(row.name, name, schema) for name, schema in row.callees(agent, registry)]
        except LookupError as exc:
            raise GrammarError(str(exc.args[0])) from None
        if row.client_prompt is not None:  # the type the client tools are targets of
            found += [Target(row.name, tool.name, tool.parameters) for tool in client_tools]
    return found


def _text_char() -> Expr:
    """A character of thought or response text; `<` only before what starts no tag."""
    return alt(chars("<", negated=True), seq(Lit("<"), chars("a-zA-Z/<", negated=True)))


def protocol_grammar(targets: list[Target], limits: Limits = Limits(), *,
                     act: bool = False, output: Mapping[str, Any] | None = None) -> Rules:
    """The grammar of one turn (module docstring) for these callables; `act`: the turn writes
    an action before any response (tool_choice `required`); `output`: the final response is
    a JSON value of this schema (the agent's `output_schema`)."""
    g = Rules()
    root = g.placeholder("root")
    json_values = _Json(g, limits)
    ws = json_values.ws
    block_ws = g.rule("ws", rep(chars(" \n"), 0, 2))
    text = g.rule("text", rep(_text_char(), 0, limits.text))
    answer = text if output is None else json_values.value(output, "output")
    final = g.rule("final-response",
                   seq(Lit('<response final="true">'), answer, Lit("</response>")))
    response = g.rule("response", alt(
        seq(Lit('<response final="false">'), text, Lit("</response>")), final))
    plain_thought = g.rule("thought", seq(Lit("<thought>"), text, Lit("</thought>")))
    if not targets:  # nothing to call (tool_choice none): the answer
        g.define(root, seq(block_ws, opt(seq(plain_thought, block_ws)), final))
        return g
    by_type: dict[str, list[Target]] = {}
    for target in targets:
        by_type.setdefault(target.type, []).append(target)
    calls = {kind: g.rule(f"{kind}-call", alt(*(
        seq(Lit(_dumps(t.name)), Lit(","), ws, Lit('"parameters":'), ws,
            json_values.value(t.parameters, f"{kind}-{t.name}-parameters")) for t in members)))
        for kind, members in by_type.items()}

    def actions(label: str, modes: tuple[str, ...]) -> Ref:
        mode = g.rule(f"mode-{label}", alt(*(Lit(m) for m in modes)))
        return g.rule(f"action-{label}", alt(*(seq(
            Lit(f'<action type="{kind}" mode="'), mode, Lit('">{'), ws, Lit('"name":'), ws, call,
            ws, Lit("}</action>")) for kind, call in calls.items())))

    # A sync action ends the turn (the runtime stops reading at its </action>), so it is the
    # last thing written, never inside a thought; async and fire_and_forget ones go on.
    going, last = actions("async", ("async", "fire_and_forget")), actions("sync", ("sync",))
    n = limits.actions
    gap = g.rule("gap", rep(_text_char(), 0, limits.gap))
    tail = g.rule("tail", alt(
        seq(going, rep(seq(block_ws, going), 0, n - 1), opt(seq(block_ws, alt(last, response)))),
        last, *(() if act else (final,))))
    acting = g.rule("acting-thought", seq(Lit("<thought>"), text, rep(seq(going, gap), 1, n),
                                          Lit("</thought>")))
    g.define(root, seq(block_ws, alt(seq(acting, opt(seq(block_ws, tail))),
                                     seq(opt(seq(plain_thought, block_ws)), tail))))
    return g


# ------------------------------------------------------------------- rendering
def _nullable(e: Expr, rules: Mapping[str, Expr], seen: frozenset[str] = frozenset()) -> bool:
    match e:
        case Lit(text):
            return text == ""
        case Chars():
            return False
        case Seq(items):
            return all(_nullable(i, rules, seen) for i in items)
        case Alt(items):
            return any(_nullable(i, rules, seen) for i in items)
        case Rep(item, lo, _):
            return lo == 0 or _nullable(item, rules, seen)
        case Ref(name):
            return name not in seen and _nullable(rules[name], rules, seen | {name})
    raise TypeError(e)


def _bnf_char(code: int) -> str:
    c = chr(code)
    if (c.isalnum() and code < 128) or c == " ":
        return c
    return f"\\x{code:02X}" if code < 256 else f"\\u{code:04X}" if code < 0x10000 \
        else f"\\U{code:08X}"


def _bnf_literal(text: str) -> str:
    out = []
    for c in text:
        if c in '"\\':
            out.append("\\" + c)
        elif c == "\n":
            out.append("\\n")
        elif ord(c) < 32 or ord(c) == 127:
            out.append(f"\\x{ord(c):02X}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def _class(e: Chars, char: Callable[[int], str]) -> str:
    body = "".join(char(a) if a == b else f"{char(a)}-{char(b)}" for a, b in e.ranges)
    return f"[{'^' if e.negated else ''}{body}]"


def _rep_suffix(lo: int, hi: int | None, *, lark: bool) -> str:
    if (lo, hi) == (0, 1):
        return "?"
    if hi is None:
        return "*" if lo == 0 else "+" if lo == 1 else (f" ~ {lo}.." if lark else f"{{{lo},}}")
    if lark:
        return f" ~ {lo}" if lo == hi else f" ~ {lo}..{hi}"
    return f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"


def _render_bnf(g: Rules, *, header: str) -> str:
    """GBNF (llama.cpp) / XGrammar EBNF: `name ::= ...`, the start rule is `root`."""

    def expr(e: Expr, top: bool = False) -> str:
        match e:
            case Lit(text):
                return _bnf_literal(text)
            case Chars():
                return _class(e, _bnf_char)
            case Ref(name):
                return name
            case Seq(items):
                inner = " ".join(expr(i) for i in items)
                return inner if top else f"({inner})"
            case Alt(items) if EMPTY in items:
                return expr(Rep(alt(*_solid(items)), 0, 1))
            case Alt(items):
                inner = " | ".join(expr(i, top=True) for i in items)
                return inner if top else f"({inner})"
            case Rep(item, lo, hi):
                return expr(item) + _rep_suffix(lo, hi, lark=False)
        raise TypeError(e)

    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    lines += [f"{name} ::= {expr(body, top=True)}" for name, body in g.rules.items()]
    return "\n".join(lines) + "\n"


_REGEX_META = frozenset(".+*?()|[]{}^$#&-~\\")


def _regex_char(code: int) -> str:
    """One character in a Lark `/regex/` that both Python's `lark` (which evaluates `\\x`
    escapes before compiling) and llguidance (Rust `regex`) read the same way: meta characters
    escaped with a backslash, `/` as `\\/`, control characters as `\\xHH`, `<` and `>` raw
    (`\\<` is a word boundary in Rust), everything else as it is."""
    c = chr(code)
    if c in _REGEX_META:
        return "\\" + c
    if c == "/":
        return "\\/"
    if code < 32 or code == 127:
        return f"\\x{code:02X}"
    return c


def _solid(items: tuple[Expr, ...]) -> tuple[Expr, ...]:
    return tuple(i for i in items if i != EMPTY)


def _regular(e: Expr) -> bool:
    match e:
        case Lit() | Chars():
            return True
        case Seq(items) | Alt(items):
            return all(_regular(i) for i in items)
        case Rep(item, _, _):
            return _regular(item)
    return False


def _regex(e: Expr) -> str:
    match e:
        case Lit(text):
            return "".join(_regex_char(ord(c)) for c in text)
        case Chars():
            return _class(e, _regex_char)
        case Seq(items):
            return "".join(_regex(i) if not isinstance(i, Alt) else f"(?:{_regex(i)})"
                           for i in items)
        case Alt(items):  # literals longest first, for engines that take the first match
            if all(isinstance(i, Lit) for i in items):
                items = tuple(sorted(items, key=lambda i: -len(i.text)))  # type: ignore[union-attr]
            return "|".join(_regex(i) for i in items)
        case Rep(item, lo, hi):
            inner = _regex(item)
            if not (isinstance(item, Chars) or (isinstance(item, Lit) and len(item.text) == 1)):
                inner = f"(?:{inner})"
            suffix = "" if (lo, hi) == (1, 1) else "?" if (lo, hi) == (0, 1) else "*" if (lo, hi) == (0, None) else \
                "+" if (lo, hi) == (1, None) else f"{{{lo},}}" if hi is None else \
                f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"
            return inner + suffix
    raise TypeError(e)


def _render_lark(g: Rules, *, header: str) -> str:
    """llguidance's Lark dialect (the subset Python's `lark` also reads): rule names with
    underscores, the start rule `start`, each regular part one `/regex/` terminal (never an
    empty one: an optional regex is written `/.../?`).

    Every alternative, option or repetition below the top of a rule gets a rule of its own:
    Lark multiplies a rule's optional parts out into separate expansions (2^n for n options),
    which a JSON object with a few optional spaces would make explode.
    """
    lines = [f"// {line}" if line else "//" for line in header.splitlines()]
    hoisted: dict[str, str] = {}  # body → rule name
    counts: dict[str, int] = {}
    out: list[tuple[str, str]] = []

    def name(rule: str) -> str:
        return "start" if rule == "root" else rule.replace("-", "_")

    def hoist(e: Expr, owner: str) -> str:
        body = expr(e, owner, top=True)
        if body not in hoisted:
            counts[owner] = counts.get(owner, 0) + 1
            hoisted[body] = f"{owner}_{counts[owner]}"
            out.append((hoisted[body], body))
        return hoisted[body]

    def expr(e: Expr, owner: str, top: bool = False) -> str:
        if isinstance(e, Alt) and EMPTY in e.items:
            e = Rep(alt(*_solid(e.items)), 0, 1)
        if _regular(e) and not isinstance(e, Lit) and not _nullable(e, g.rules):
            return f"/{_regex(e)}/"
        match e:
            case Lit(text):
                return _bnf_literal(text)
            case Ref(rule):
                return name(rule)
            case Seq(items):
                inner = " ".join(expr(i, owner) for i in items)
                return inner if top else f"({inner})"
            case Alt(items) if top:
                return " | ".join(expr(i, owner, top=True) for i in items)
            case Rep(item, 0, 1) if _regular(item) and not _nullable(item, g.rules):
                atom = _bnf_literal(item.text) if isinstance(item, Lit) else f"/{_regex(item)}/"
                return f"{atom}?" if top else hoist(e, owner)
            case Rep(item, lo, hi) if top:
                if _regular(item) and lo == 0 and not _nullable(item, g.rules):
                    return f"/{_regex(Rep(item, 1, hi))}/?"
                atom = expr(item, owner)
                if isinstance(item, Seq | Alt | Rep):
                    atom = hoist(item, owner)
                return atom + _rep_suffix(lo, hi, lark=True)
            case Alt() | Rep():
                return hoist(e, owner)
        raise TypeError(e)

    for rule, body in g.rules.items():
        out.append((name(rule), expr(body, name(rule), top=True)))
    lines += [f"{rule}: {body}" for rule, body in out]
    return "\n".join(lines) + "\n"


def _structural_tag(targets: list[Target]) -> dict[str, Any]:
    """XGrammar's structural tag (legacy form): one structure per callable and mode, whose
    `begin` runs up to the parameters, so `schema` is the callable's own parameter schema."""
    structures = [
        {"begin": f'<action type="{t.type}" mode="{m}">{{"name": {_dumps(t.name)}, '
                  '"parameters": ',
         "schema": dict(t.parameters),
         "end": "}</action>"}
        for t in targets for m in MODES
    ]
    return {"type": "structural_tag", "structures": structures, "triggers": ["<action"]}


# ------------------------------------------------------------------- the flavour table
@dataclass(frozen=True, slots=True)
class Flavour:
    """One way to hand the grammar to an engine."""

    name: FlavourName
    engines: str
    build: Callable[[list[Target], Limits, str, bool, Mapping[str, Any] | None], Grammar]
    """(callables, limits, a title for the grammar's header comment, whether the turn must
    act, the final response's schema) → the grammar."""
    fields: Callable[[Any], dict[str, Any]]
    """The request body fields that carry the grammar."""


def _bnf(targets: list[Target], limits: Limits, title: str, act: bool,
         output: Mapping[str, Any] | None) -> str:
    return _render_bnf(protocol_grammar(targets, limits, act=act, output=output), header=title)


def _lark(targets: list[Target], limits: Limits, title: str, act: bool,
          output: Mapping[str, Any] | None) -> str:
    return _render_lark(protocol_grammar(targets, limits, act=act, output=output),
                        header=title)


FLAVOURS: dict[str, Flavour] = {row.name: row for row in (
    Flavour("gbnf", "llama.cpp server (and llama-cpp-python's)", _bnf,
            lambda grammar: {"grammar": grammar}),
    Flavour("ebnf", "SGLang (XGrammar backend), vLLM (xgrammar backend)", _bnf,
            lambda grammar: {"ebnf": grammar, "structured_outputs": {"grammar": grammar}}),
    Flavour("lark", "vLLM (guidance backend), llguidance", _lark,
            lambda grammar: {"structured_outputs": {"grammar": grammar}}),
    Flavour("structural_tag", "XGrammar through vLLM or SGLang",
            lambda targets, limits, title, act, output: _structural_tag(targets),
            lambda grammar: {"response_format": grammar}),
)}


def build_grammar(agent: AgentSpec, registry: Registry, flavour: str | None,
                  *, limits: Limits = Limits(), tool_choice: ToolChoice = "auto",
                  client_tools: Sequence[ClientTool] = ()) -> Grammar | None:
    """The agent's protocol grammar in `flavour` (None: no grammar, None back), for
    `tool_choice`: `required`, an action before any response; a tool's name, an action of
    that tool before any response, and no other; `none`, no action at all (XGrammar's
    structural tag only triggers on actions: it cannot demand one). An agent
    with an `output_schema` writes its final response as a JSON value of it. `client_tools`:
    the job's (`JobOptions.client_tools`), callable as tools like the agent's own.

    A string for gbnf, ebnf and lark; a dict for structural_tag. GrammarError if the flavour
    is unknown or the agent lists something the registry does not have.
    """
    if flavour is None:
        return None
    row = FLAVOURS.get(flavour)
    if row is None:
        raise GrammarError(f"unknown grammar flavour {flavour!r} (expected one of: "
                           f"{', '.join(FLAVOURS)})")
    title = f"The Streaming Execution Protocol for agent {agent.name} (generated by Cortex)"
    targets = [] if tool_choice == "none" else agent_targets(agent, registry, client_tools)
    if tool_choice not in CHOICES:  # a tool's name: an action of that tool, and nothing else
        # (tools are the type whose targets are native functions: client tools join them)
        targets = [t for t in targets
                   if ACTION_TYPES[t.type].client_prompt is not None and t.name == tool_choice]
        if not targets:
            raise GrammarError(f"tool_choice {tool_choice!r} is not a tool of agent "
                               f"{agent.name!r}")
    schema = agent.output_schema if isinstance(agent.output_schema, dict) else None
    return row.build(targets, limits, title, tool_choice not in ("auto", "none"), schema)


def request_fields(flavour: str, grammar: Grammar) -> dict[str, Any]:
    """The chat-completion request fields that carry `grammar` to the engine of `flavour`."""
    row = FLAVOURS.get(flavour)
    if row is None:
        raise GrammarError(f"unknown grammar flavour {flavour!r} (expected one of: "
                           f"{', '.join(FLAVOURS)})")
    return row.fields(grammar)
