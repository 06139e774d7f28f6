"""Series-parallel plans compile to a canvas that mirrors them; others do not compile."""

from __future__ import annotations

import pytest
from celery import Celery, group
from celery.canvas import _chain as chain
from celery.canvas import _chord as chord

from cortex_worker.plan.canvas import decompose, to_canvas
from cortex_worker.plan.dag import build_plan
from cortex_worker.protocol.actions import Action

pytestmark = pytest.mark.unit


def plan(ids: str, edges: dict[str, str]):
    return build_plan([Action(id=i, name="echo", mode="async", depends_on=tuple(edges.get(i, "")))
                       for i in ids])


def canvas(step):
    app = Celery("t", set_as_current=False)
    return to_canvas(step, lambda i: app.signature("cortex.action.canvas", args=[i], immutable=True))


def names(sig) -> list:
    """The canvas as nested lists of kinds and action ids."""
    if isinstance(sig, chord):
        return ["chord", [names(t) for t in sig.tasks], names(sig.body)]
    if isinstance(sig, chain):
        return ["chain", *[names(t) for t in sig.tasks]]
    if isinstance(sig, group):
        return ["group", *[names(t) for t in sig.tasks]]
    return sig.args[0]


def test_sequence_is_a_chain():
    step = decompose(plan("abc", {"b": "a", "c": "b"}))
    assert step.shape() == ("chain", ["a", "b", "c"])
    assert names(canvas(step)) == ["chain", "a", "b", "c"]
    assert step.width() == 1


def test_fan_out_is_a_chain_into_a_group():
    step = decompose(plan("abc", {"b": "a", "c": "a"}))
    assert step.shape() == ("chain", ["a", ("group", ["b", "c"])])
    assert names(canvas(step)) == ["chain", "a", ["group", "b", "c"]]


def test_fan_in_is_a_chord():
    step = decompose(plan("abc", {"c": "ab"}))
    assert step.shape() == ("chain", [("group", ["a", "b"]), "c"])
    # Celery turns a group followed by a task into a chord: header a, b; body c.
    assert names(canvas(step)) == ["chord", ["a", "b"], "c"]


def test_diamond_is_chain_group_task():
    step = decompose(plan("abcd", {"b": "a", "c": "a", "d": "bc"}))
    assert step.shape() == ("chain", ["a", ("group", ["b", "c"]), "d"])
    assert step.width() == 2
    assert names(canvas(step)) == ["chain", "a", ["chord", ["b", "c"], "d"]]


def test_nested_series_parallel():
    step = decompose(plan("abcde", {"b": "a", "d": "c", "e": "bd"}))
    assert step.shape() == ("chain", [("group", [("chain", ["a", "b"]), ("chain", ["c", "d"])]), "e"])


def test_independent_actions_are_one_group():
    step = decompose(plan("abcd", {}))
    assert step.shape() == ("group", ["a", "b", "c", "d"])
    assert step.width() == 4


def test_n_shape_is_not_series_parallel():
    # A→C, A→D, B→D: any canvas would make C wait for B; readiness dispatch runs it.
    assert decompose(plan("ABCD", {"C": "A", "D": "AB"})) is None


def test_sync_barrier_edges_count():
    actions = [Action(id="a", name="echo", mode="sync"), Action(id="b", name="echo", mode="async")]
    assert decompose(build_plan(actions)).shape() == ("chain", ["a", "b"])


def test_long_chain_has_no_recursion_limit():
    ids = [f"n{i}" for i in range(3000)]
    actions = [Action(id=i, name="echo", mode="async", depends_on=(ids[k - 1],) if k else ())
               for k, i in enumerate(ids)]
    step = decompose(build_plan(actions))
    assert step.kind == "chain" and len(step.parts) == 3000


def test_plan_with_errors_does_not_compile():
    assert decompose(plan("ab", {"a": "b", "b": "a"})) is None
