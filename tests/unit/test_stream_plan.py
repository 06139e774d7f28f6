"""One planner, two paths: a whole document (`build_plan`, via `load_document`) and a model's
stream (`StreamPlanner`, one action at a time, as the coordinator feeds it).

The rule both follow when several actions produce the same name (docs/protocol.md, "Which
producer a reference waits for"): `$x` waits for the latest producer of `x` written before it.
A reference with no producer before it is the one difference: a document binds it to the first
producer after it; a stream cannot (the action is dispatched before that producer is written).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from cortex_worker.plan import Plan, PlanIssue, StreamPlanner, build_plan
from cortex_worker.protocol.actions import Action
from cortex_worker.protocol.document import load_document
from cortex_worker.protocol.parser import ACTION_PARSED, StreamParser

pytestmark = pytest.mark.unit

Edges = dict[str, tuple[tuple[str, ...], tuple[str, ...]]]


def act(ident: str, mode: str = "async", **fields: Any) -> Action:
    fields.setdefault("name", "echo")
    return Action(id=ident, mode=mode, **fields)


def tag(ident: str, mode: str = "async", extra: str = "", **body: Any) -> str:
    body.setdefault("name", "echo")
    return f'<action id="{ident}" mode="{mode}"{extra}>{json.dumps(body)}</action>\n'


def use(ident: str, mode: str = "async") -> str:
    return tag(ident, mode, parameters={"v": "$x"})


def document_edges(text: str) -> Edges:
    doc = load_document(text)
    assert doc.plan is not None
    return {i: (n.depends_on, n.after) for i, n in doc.plan.nodes.items()}


def stream_edges(turns: list[str], chunk: int = 7) -> Edges:
    """Plan `turns` as the coordinator does: parse each turn's text as it streams in, give each
    action to the planner when it closes, and keep the planner in JSON between turns."""
    state: dict[str, Any] = {}
    edges: Edges = {}
    for text in turns:
        planner = StreamPlanner.from_json(json.loads(json.dumps(state)))
        parser = StreamParser(known_ids=set(planner.ids), first_action_number=len(planner.ids) + 1)
        events = []
        for start in range(0, len(text), chunk):
            events += parser.feed(text[start:start + chunk])
        events += parser.close()
        for event in events:
            if event.type == ACTION_PARSED:
                deps, after = planner.add(event.data["action"])
                edges[event.data["action"].id] = (tuple(deps), tuple(after))
        state = planner.to_json()
    return edges


TWO_PRODUCERS = [
    use("c0") + tag("p1", extra=' output_key="x"') + use("c1"),
    tag("s", "sync") + tag("p2", extra=' output_key="x"') + use("c2") + use("c3", "sync")
    + tag("p3", type="internal", name="set_variable", parameters={"name": "x", "value": 1})
    + use("c4"),
]


def test_two_producers_the_document_and_the_stream_plan_the_same() -> None:
    document = document_edges("".join(TWO_PRODUCERS))
    assert document == {
        "c0": (("p1",), ()),  # before every producer: the first one after it (documents only)
        "p1": ((), ()),
        "c1": (("p1",), ()),  # between: the latest before it
        "s": ((), ()),
        "p2": ((), ("s",)),
        "c2": (("p2",), ("s",)),  # after: the latest before it, not every producer
        "c3": (("p2",), ("s",)),
        "p3": ((), ("c3",)),
        "c4": (("p3",), ("c3",)),  # an internal set_variable produces `x` too
    }
    expected_stream = {**document, "c0": ((), ())}  # a stream cannot wait for a later action
    assert stream_edges(TWO_PRODUCERS) == expected_stream
    assert stream_edges(["".join(TWO_PRODUCERS)], chunk=1) == expected_stream
    # Without the reference written before every producer, the two plans are equal.
    text = "".join(TWO_PRODUCERS).replace(use("c0"), "")
    assert stream_edges([text]) == document_edges(text)
    assert stream_edges([text, ""]) == {i: e for i, e in document.items() if i != "c0"}


def test_build_plan_is_the_stream_planner_over_the_document() -> None:
    actions = [
        act("a", output_key="k"),
        act("b", depends_on=("later",), parameters={"v": "$k"}),
        act("s", mode="sync", parameters={"v": "$a and $feed"}),
        act("k2", output_key="k"),
        act("later", parameters={"v": "${k.field}"}),
    ]
    plan = build_plan(actions, known=["feed"])
    planner = StreamPlanner(known=frozenset(["feed"]))
    assert {a.id: planner.add(a) for a in actions} == {
        i: (list(n.depends_on), list(n.after)) for i, n in plan.nodes.items()}
    assert planner.waiting == {} and plan.ok and plan.warnings == []
    assert plan.nodes["later"].depends_on == ("k2",)
    assert plan.waves() == [["a"], ["s"], ["k2"], ["later"], ["b"]]


def test_reference_before_any_producer_binds_to_the_first_one_after_it() -> None:
    plan = build_plan([act("use", parameters={"v": "$x"}), act("p1", output_key="x"),
                       act("p2", output_key="x")])
    assert plan.nodes["use"].depends_on == ("p1",)
    assert plan.waves() == [["p1", "p2"], ["use"]]
    assert plan.warnings == []
    assert StreamPlanner().add(act("use", parameters={"v": "$x"})) == ([], [])


def test_a_known_name_counts_as_produced_before_the_first_action() -> None:
    text = ('<context_feed id="x">1</context_feed>\n' + use("c0")
            + tag("p1", extra=' output_key="x"') + use("c1"))
    doc = load_document(text)
    assert doc.plan is not None and doc.ok and doc.warnings == []
    assert document_edges(text) == {"c0": ((), ()), "p1": ((), ()), "c1": (("p1",), ())}


def test_set_variable_reading_its_own_variable_reads_the_previous_setter() -> None:
    def setter(ident: str) -> Action:
        return act(ident, type="internal", name="set_variable",
                   parameters={"name": "n", "value": "$n"})

    actions = [setter("first"), setter("second"), setter("third")]
    plan = build_plan(actions)
    assert {i: n.depends_on for i, n in plan.nodes.items()} == {
        "first": (), "second": ("first",), "third": ("second",)}
    assert plan.ok  # a chain, not a cycle
    assert plan.warnings == [PlanIssue(
        "unknown_reference", "$n in action 'first' names nothing known; it will be left as "
        "written", 1, 1, "first")]
    planner = StreamPlanner()
    assert [planner.add(a)[0] for a in actions] == [[], ["first"], ["second"]]


def test_reference_to_its_own_output_key_binds_to_an_earlier_producer() -> None:
    plan = build_plan([act("a", output_key="total"),
                       act("b", output_key="total", parameters={"v": "$total"})])
    assert plan.ok and plan.nodes["b"].depends_on == ("a",)


def test_self_dependency_the_stream_leaves_the_self_edge_out_and_says_so() -> None:
    planner = StreamPlanner()
    for action in (act("a", depends_on=("a",)), act("b", parameters={"v": "$b"})):
        placed = planner.place(action)
        assert placed.self_loop and placed.depends_on == ()
    assert planner.waiting == {}
    plan = build_plan([act("a", depends_on=("a",)), act("b", parameters={"v": "$b"})])
    assert [e.kind for e in plan.errors] == ["cycle", "cycle"] and plan.waves() == []


def test_unseen_dependency_waits_across_turns_and_the_old_json_still_loads() -> None:
    # As the coordinator stored the planner before the planners were one (same keys).
    old = {"producers": {"a": "a", "x": "a"}, "ids": ["a", "b"], "last_sync": "a",
           "waiting": {"b": ["c", "d"]}}
    planner = StreamPlanner.from_json(json.loads(json.dumps(old)))
    assert planner.to_json() == old
    assert planner.add(act("c", parameters={"v": "$x"})) == (["a"], [])
    assert planner.waiting == {"b": ["d"]}
    planner = StreamPlanner.from_json(json.loads(json.dumps(planner.to_json())))
    assert planner.add(act("d", output_key="x")) == ([], ["a"])
    assert planner.waiting == {}
    assert planner.add(act("e", parameters={"v": "$x"})) == (["d"], ["a"])
    assert StreamPlanner.from_json({}) == StreamPlanner()
    known = StreamPlanner(known=frozenset({"f"}))
    assert StreamPlanner.from_json(json.loads(json.dumps(known.to_json()))) == known


def test_many_actions_waiting_for_one_unseen_id_is_linear() -> None:
    n = 20_000
    actions = [act(f"w{i}", depends_on=("last",)) for i in range(n)] + [act("last")]
    plan = build_plan(actions)
    assert plan.ok
    assert plan.waves() == [["last"], [f"w{i}" for i in range(n)]]


def test_unknown_dependency_is_what_is_still_waiting_at_the_end() -> None:
    plan: Plan = build_plan([act("a", depends_on=("b", "nowhere", "c")), act("b"),
                             act("x", depends_on=("gone",), line=3, column=2)])
    assert [(e.action_id, e.message) for e in plan.errors] == [
        ("a", "action 'a' depends on 'nowhere', which is not an action in this document"),
        ("a", "action 'a' depends on 'c', which is not an action in this document"),
        ("x", "action 'x' depends on 'gone', which is not an action in this document"),
    ]
