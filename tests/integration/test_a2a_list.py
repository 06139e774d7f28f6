"""A2A `ListTasks` with the official `a2a-sdk` client: the caller's tasks of one agent, a
context's, by state, newest first, in pages, and never another tenant's (the real API and
workers; the fake model answers)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from a2a.types.a2a_pb2 import ListTasksRequest, ListTasksResponse, TaskState
from a2a.utils.errors import InvalidParamsError

from tests import harness
from tests.fake_llm import FakeLLM
from tests.integration.test_a2a import ALPHA, BETA, a2a_client, collect, keyed_api, request
from tests.integration.test_agents import final, turn, unique

__all__ = ["keyed_api"]  # the module's fixture, used here too


@pytest.fixture
def api(workers: Any, api: harness.Process) -> harness.Process:  # tasks need the pools
    return api


def test_list_tasks_reads_a_context_by_state_newest_first_in_pages(
        api: harness.Process, fake_llm: FakeLLM) -> None:
    model = unique("a2a-list")
    fake_llm.script(model, [turn(final("one")), turn(final("two")), turn(final("three"))])

    async def main() -> tuple[list[Any], dict[str, ListTasksResponse]]:
        async with a2a_client(api.url) as (client, _):
            [one] = await collect(client.send_message(request("first", model)))
            context = one.task.context_id
            [two] = await collect(client.send_message(request("second", context_id=context)))
            [three] = await collect(client.send_message(request("other", model)))
            pages = {
                "context": await client.list_tasks(ListTasksRequest(context_id=context)),
                "first": await client.list_tasks(ListTasksRequest(context_id=context,
                                                                  page_size=1)),
                "all": await client.list_tasks(ListTasksRequest(
                    status=TaskState.TASK_STATE_COMPLETED, page_size=100,
                    include_artifacts=True)),
                "working": await client.list_tasks(ListTasksRequest(
                    context_id=context, status=TaskState.TASK_STATE_WORKING)),
                "nobody": await client.list_tasks(ListTasksRequest(context_id="no-such")),
            }
            pages["second"] = await client.list_tasks(ListTasksRequest(
                context_id=context, page_size=1, page_token=pages["first"].next_page_token))
            with pytest.raises(InvalidParamsError):
                await client.list_tasks(ListTasksRequest(page_size=1000))
            return [one.task, two.task, three.task], pages

    (one, two, three), pages = asyncio.run(main())
    context = pages["context"]
    assert [t.id for t in context.tasks] == [two.id, one.id]  # newest status first
    assert context.total_size == 2 and not context.next_page_token
    assert not any(t.artifacts for t in context.tasks)  # includeArtifacts is false by default
    assert [t.history[0].parts[0].text for t in context.tasks] == ["second", "first"]
    first, second = pages["first"], pages["second"]
    assert [t.id for t in first.tasks] == [two.id] and first.next_page_token
    assert [t.id for t in second.tasks] == [one.id] and not second.next_page_token
    assert first.total_size == second.total_size == 2
    listed = {t.id: t for t in pages["all"].tasks}
    assert {one.id, two.id, three.id} <= set(listed)
    assert all(t.status.state == TaskState.TASK_STATE_COMPLETED for t in listed.values())
    assert listed[three.id].artifacts[0].parts[0].text == "three"
    assert not pages["working"].tasks and not pages["nobody"].tasks


def test_list_tasks_shows_the_callers_tenant_only(keyed_api: harness.Process, workers: Any,
                                                  fake_llm: FakeLLM) -> None:
    model = unique("a2a-list-keys")
    fake_llm.script(model, [turn(final("alpha's"))])

    async def main() -> tuple[str, ListTasksResponse, ListTasksResponse, ListTasksResponse]:
        async with a2a_client(keyed_api.url, key=ALPHA) as (client, _):
            [mine] = await collect(client.send_message(request("mine", model)))
            own = await client.list_tasks(ListTasksRequest(page_size=100))
        async with a2a_client(keyed_api.url, key=BETA) as (other, _):
            theirs = await other.list_tasks(ListTasksRequest(page_size=100))
            by_context = await other.list_tasks(ListTasksRequest(
                context_id=mine.task.context_id))
        return mine.task.id, own, theirs, by_context

    task_id, own, theirs, by_context = asyncio.run(main())
    assert task_id in {t.id for t in own.tasks}
    assert task_id not in {t.id for t in theirs.tasks}
    assert not by_context.tasks and by_context.total_size == 0
