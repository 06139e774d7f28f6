"""Unit tests for the plan / DAG of a protocol document (cortex_worker.plan.dag)."""

from __future__ import annotations

from typing import Any

import pytest

from cortex_worker.plan import Plan, PlanIssue, PlanNode, build_plan
from cortex_worker.protocol.actions import Action

pytestmark = pytest.mark.unit


def act(ident: str, mode: str = "async", **fields: Any) -> Action:
    fields.setdefault("name", "echo")
    return Action(id=ident, mode=mode, **fields)


def edges(plan: Plan) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    return {i: (n.depends_on, n.after) for i, n in plan.nodes.items()}


def test_n_shaped_dag_waves_and_edges() -> None:
    plan = build_plan(
        [
            act("A"),
            act("B"),
            act("C", depends_on=("A",)),
            act("D", depends_on=("A", "B")),
        ]
    )
    assert plan.ok
    assert plan.errors == [] and plan.warnings == []
    assert plan.waves() == [["A", "B"], ["C", "D"]]
    assert plan.waits_for("C") == ("A",)
    assert plan.waits_for("D") == ("A", "B")
    assert plan.dependents("A") == ("C", "D")
    assert plan.dependents("B") == ("D",)
    assert plan.dependents("C") == ()
    assert plan.topological_order() == ["A", "B", "C", "D"]
    assert list(plan.nodes) == ["A", "B", "C", "D"]
    assert isinstance(plan.nodes["C"], PlanNode)
    assert plan.nodes["C"].id == "C"


def test_implicit_dependency_via_id() -> None:
    plan = build_plan([act("fetch"), act("use", parameters={"data": "$fetch"})])
    assert edges(plan) == {"fetch": ((), ()), "use": (("fetch",), ())}
    assert plan.warnings == []
    assert plan.waves() == [["fetch"], ["use"]]


def test_implicit_dependency_via_output_key() -> None:
    plan = build_plan(
        [act("fetch", output_key="page"), act("use", parameters={"text": "summary of $page"})]
    )
    assert edges(plan)["use"] == (("fetch",), ())
    assert plan.warnings == []


def test_implicit_dependency_via_braced_path_nested_and_any_stream_order() -> None:
    plan = build_plan(
        [
            act("use", parameters={"items": [{"q": "${search.results.0}"}, "$$literal"]}),
            act("search"),
        ]
    )
    assert edges(plan) == {"use": (("search",), ()), "search": ((), ())}
    assert plan.warnings == []
    assert plan.waves() == [["search"], ["use"]]
    assert plan.topological_order() == ["search", "use"]


def test_two_producers_a_reference_waits_for_the_latest_one_before_it() -> None:
    plan = build_plan(
        [
            act("p1", output_key="x"),
            act("between", parameters={"v": "$x"}),
            act("p2", output_key="x"),
            act("last", parameters={"v": "${x.field}", "w": "$p1"}),
        ]
    )
    assert edges(plan) == {
        "p1": ((), ()),
        "between": (("p1",), ()),
        "p2": ((), ()),
        "last": (("p1", "p2"), ()),  # p2 for $x, p1 for $p1
    }
    assert plan.ok and plan.warnings == []


def test_explicit_union_implicit_sorted_and_deduplicated() -> None:
    plan = build_plan(
        [
            act("z"),
            act("m", output_key="mm"),
            act("b"),
            act("x", depends_on=("z", "b"), parameters={"p": "$mm and $z"}),
        ]
    )
    assert plan.nodes["x"].depends_on == ("b", "m", "z")
    assert plan.nodes["x"].after == ()


def test_sync_barrier() -> None:
    plan = build_plan([act("a"), act("s", mode="sync"), act("b")])
    assert edges(plan) == {"a": ((), ()), "s": ((), ()), "b": ((), ("s",))}
    assert plan.waits_for("b") == ("s",)
    assert plan.dependents("s") == ("b",)
    assert plan.waves() == [["a", "s"], ["b"]]
    assert plan.ok


def test_sync_waits_for_earlier_action_only_when_it_depends_on_it() -> None:
    plan = build_plan([act("a"), act("s", mode="sync", depends_on=("a",)), act("b")])
    assert plan.waves() == [["a"], ["s"], ["b"]]


def test_barrier_is_nearest_sync_and_not_doubled_with_depends_on() -> None:
    plan = build_plan(
        [
            act("s1", mode="sync"),
            act("a"),
            act("s2", mode="sync"),
            act("b", depends_on=("s2",)),
            act("c", mode="fire_and_forget"),
            act("d", parameters={"x": "$a"}),
        ]
    )
    assert edges(plan) == {
        "s1": ((), ()),
        "a": ((), ("s1",)),
        "s2": ((), ("s1",)),
        "b": (("s2",), ()),
        "c": ((), ("s2",)),
        "d": (("a",), ("s2",)),
    }
    assert plan.waves() == [["s1"], ["a", "s2"], ["b", "c", "d"]]


def test_unknown_dependency_is_an_error_and_blocks_dependents() -> None:
    plan = build_plan(
        [
            act("x", depends_on=("y",), line=3, column=5),
            act("w", parameters={"v": "$x"}),
            act("ok"),
        ]
    )
    assert not plan.ok
    assert plan.errors == [
        PlanIssue(
            "unknown_dependency",
            "action 'x' depends on 'y', which is not an action in this document",
            3,
            5,
            "x",
        )
    ]
    assert plan.nodes["x"].depends_on == ("y",)
    assert plan.waves() == [["ok"]]
    assert plan.critical_path() == (["ok"], 1.0)


def test_explicit_dependency_on_known_id_is_satisfied() -> None:
    plan = build_plan(
        [act("x", depends_on=("earlier",)), act("y", depends_on=("x",))], known={"earlier"}
    )
    assert plan.ok
    assert plan.waits_for("x") == ("earlier",)
    assert plan.waves() == [["x"], ["y"]]


def test_cycle_of_three_named_in_order() -> None:
    plan = build_plan(
        [
            act("start"),
            act("a", depends_on=("b",), line=2, column=1),
            act("b", parameters={"v": "$c"}, line=3, column=1),
            act("c", depends_on=("a",), line=4, column=1),
            act("after_cycle", depends_on=("c",)),
        ]
    )
    assert plan.errors == [PlanIssue("cycle", "dependency cycle: a -> b -> c -> a", 2, 1, "a")]
    assert plan.waves() == [["start"]]
    assert plan.topological_order() == ["start"]


def test_cycle_message_starts_at_earliest_member_in_stream_order() -> None:
    plan = build_plan(
        [act("c", depends_on=("b",)), act("b", depends_on=("a",)), act("a", depends_on=("c",))]
    )
    assert [e.message for e in plan.errors] == ["dependency cycle: c -> b -> a -> c"]
    assert plan.errors[0].action_id == "c"


def test_component_larger_than_its_shortest_cycle_lists_the_rest() -> None:
    plan = build_plan(
        [
            act("a", depends_on=("b", "c")),
            act("b", depends_on=("a",)),
            act("c", depends_on=("d",)),
            act("d", depends_on=("a",)),
        ]
    )
    assert [e.message for e in plan.errors] == [
        "dependency cycle: a -> b -> a; also caught in it: c, d"
    ]
    assert plan.waves() == []


def test_cycle_through_a_sync_barrier_explains_the_barrier_edge() -> None:
    plan = build_plan([act("s", mode="sync", parameters={"v": "$b"}), act("b")])
    assert edges(plan) == {"s": (("b",), ()), "b": ((), ("s",))}
    assert [e.message for e in plan.errors] == [
        "dependency cycle: s -> b -> s; 'b' waits for sync action 's' because it comes "
        "after it in the document"
    ]


def test_self_reference_is_a_cycle_of_one() -> None:
    plan = build_plan(
        [act("a", parameters={"v": "$a"}, line=7, column=2), act("b", depends_on=("b",)), act("c")]
    )
    assert plan.errors == [
        PlanIssue("cycle", "dependency cycle: a -> a", 7, 2, "a"),
        PlanIssue("cycle", "dependency cycle: b -> b", 1, 1, "b"),
    ]
    assert plan.nodes["a"].depends_on == ()
    assert plan.nodes["b"].depends_on == ()
    assert plan.waves() == [["c"]]


def test_duplicate_id_drops_the_later_action() -> None:
    first = act("a", name="first", line=1, column=1)
    plan = build_plan([first, act("a", name="second", line=4, column=3), act("b")])
    assert list(plan.nodes) == ["a", "b"]
    assert plan.nodes["a"].action is first
    assert plan.errors == [
        PlanIssue(
            "duplicate_id",
            "action id 'a' is already used by the action at line 1, column 1; this later "
            "action was dropped — give every action a unique id",
            4,
            3,
            "a",
        )
    ]


def test_unknown_reference_warning_and_known_names() -> None:
    plan = build_plan(
        [
            act(
                "x",
                parameters={"q": "$input_data", "r": "$feed.items", "cost": "$5"},
                line=2,
                column=9,
            )
        ],
        known=["feed"],
    )
    assert plan.ok
    assert plan.warnings == [
        PlanIssue(
            "unknown_reference",
            "$input_data in action 'x' names nothing known; it will be left as written",
            2,
            9,
            "x",
        )
    ]
    assert plan.nodes["x"].depends_on == ()


def test_critical_path_on_a_diamond_with_estimates() -> None:
    plan = build_plan(
        [
            act("a"),
            act("b", depends_on=("a",)),
            act("c", depends_on=("a",)),
            act("d", depends_on=("b", "c")),
        ]
    )
    assert plan.critical_path({"a": 1.0, "b": 2.0, "c": 5.0, "d": 0.5}) == (["a", "c", "d"], 6.5)
    assert plan.critical_path({"b": 3.0}) == (["a", "b", "d"], 5.0)
    # equal weights: the tie goes to the earlier action in the stream
    assert plan.critical_path() == (["a", "b", "d"], 3.0)
    assert plan.critical_path(default=2.0) == (["a", "b", "d"], 6.0)


def test_critical_path_of_independent_actions_and_empty_plan() -> None:
    plan = build_plan([act("a"), act("b"), act("c")])
    assert plan.critical_path() == (["a"], 1.0)
    assert plan.critical_path({"c": 4.0}) == (["c"], 4.0)
    empty = build_plan([])
    assert empty.critical_path() == ([], 0.0)
    assert empty.waves() == []
    assert empty.topological_order() == []
    assert empty.ok


def test_set_variable_producer() -> None:
    plan = build_plan(
        [
            act("use", parameters={"text": "hello ${greeting}"}),
            act(
                "setv",
                type="internal",
                name="set_variable",
                parameters={"name": "greeting", "value": "hi"},
            ),
        ]
    )
    assert plan.warnings == []
    assert edges(plan) == {"use": (("setv",), ()), "setv": ((), ())}
    assert plan.waves() == [["setv"], ["use"]]


def test_set_variable_reading_its_own_variable_is_not_a_self_cycle() -> None:
    plan = build_plan(
        [act("inc", type="internal", name="set_variable", parameters={"name": "n", "value": "$n"})],
        known=["n"],
    )
    assert plan.ok
    assert plan.warnings == []
    assert plan.nodes["inc"].depends_on == ()


def test_add_context_feed_producer_and_non_internal_set_variable_name() -> None:
    plan = build_plan(
        [
            act("feed", type="internal", name="add_context_feed", parameters={"id": "notes"}),
            act("tool_named_alike", name="set_variable", parameters={"name": "ignored"}),
            act("use", parameters={"a": "$notes", "b": "$ignored"}),
        ]
    )
    assert plan.nodes["use"].depends_on == ("feed",)
    assert [w.message for w in plan.warnings] == [
        "$ignored in action 'use' names nothing known; it will be left as written"
    ]


def test_ten_thousand_node_chain_has_no_recursion_limit() -> None:
    n = 10_000
    actions = [act("n0")] + [act(f"n{i}", parameters={"prev": f"$n{i - 1}"}) for i in range(1, n)]
    plan = build_plan(actions)
    assert plan.ok
    waves = plan.waves()
    assert len(waves) == n
    assert waves[0] == ["n0"] and waves[-1] == [f"n{n - 1}"]
    path, total = plan.critical_path()
    assert total == float(n)
    assert path == [f"n{i}" for i in range(n)]
    assert plan.topological_order() == [f"n{i}" for i in range(n)]


def test_ten_thousand_node_cycle_is_found_iteratively() -> None:
    n = 10_000
    actions = [act(f"n{i}", depends_on=(f"n{(i + 1) % n}",)) for i in range(n)]
    plan = build_plan(actions)
    assert [e.kind for e in plan.errors] == ["cycle"]
    assert plan.errors[0].message.startswith("dependency cycle: n0 -> n1 -> n2 -> ")
    assert plan.errors[0].message.endswith(f" -> n{n - 1} -> n0")
    assert plan.waves() == []
