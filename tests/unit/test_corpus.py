"""The protocol corpus (tests/corpus): real documents the parser must accept.

The expectations below were written from the documents and docs/protocol semantics
(docs/protocol.md), not copied from the implementation's output:

- `depends_on` is explicit ∪ implicit (a `$x` parameter naming an action's id or output_key,
  or a variable made by an internal `add_context_feed`), sorted;
- `after` is the nearest preceding `sync` action (the barrier), unless already a dependency;
- a `<response>` without `final` is final;
- every corpus document is valid: no errors.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest

from cortex_worker.protocol import parser as p
from cortex_worker.protocol.document import load_document
from tests.manifest_helpers import CORPUS

pytestmark = pytest.mark.unit



class A(NamedTuple):
    """Expected action: everything `Document.to_json` reports for it."""

    id: str
    type: str
    mode: str
    name: str
    depends_on: list[str]
    after: list[str]
    in_thought: bool
    output_key: str | None
    parameters: dict[str, Any]


class Expected(NamedTuple):
    actions: list[A]
    thoughts: list[str]  # one distinctive substring per thought, in order
    responses: list[tuple[bool, str]]  # (final, distinctive substring), in order
    feeds: dict[str, Any]
    warnings: list[tuple[str, str]]  # (kind, a substring of the message)
    waves: list[list[str]]


EXPECTED: dict[str, Expected] = {
    "mk1_01_complete_example.xml": Expected(
        actions=[
            A("wiki", "tool", "async", "web_scraper", [], [], False, "wiki_data",
              {"url": "https://en.wikipedia.org/wiki/AI"}),
            A("arxiv", "tool", "async", "arxiv_search", [], [], False, "papers",
              {"query": "machine learning", "max_results": 10}),
            A("news", "tool", "async", "news_api", [], [], False, "news_articles",
              {"topic": "artificial intelligence", "days": 7}),
            A("analyze", "agent", "sync", "comprehensive_analyzer", ["arxiv", "news", "wiki"],
              [], False, "comprehensive_analysis",
              {"wikipedia": "$wiki_data", "research_papers": "$papers",
               "news": "$news_articles"}),
            # depends on analyze explicitly and via $comprehensive_analysis; the barrier
            # (analyze, sync) is already a dependency, so no `after`.
            A("cache", "relic", "fire_and_forget", "results_cache", ["analyze"], [], False,
              None,
              {"key": "ai_research_report", "value": "$comprehensive_analysis",
               "ttl": 86400}),
        ],
        thoughts=["5. Generating a comprehensive report"],
        responses=[(True, "# AI Research Report")],
        feeds={},
        warnings=[],
        waves=[["wiki", "arxiv", "news"], ["analyze"], ["cache"]],
    ),
    "mk1_02_actions_in_thoughts.xml": Expected(
        actions=[
            A("fetch_wiki", "tool", "async", "web_scraper", [], [], True, None,
              {"url": "https://en.wikipedia.org/wiki/AI"}),
            A("fetch_arxiv", "tool", "async", "arxiv_search", [], [], True, None,
              {"query": "artificial intelligence", "max_results": 10}),
            A("analyze", "agent", "sync", "data_analyzer", ["fetch_arxiv", "fetch_wiki"], [],
              False, "analysis", {"wiki": "$fetch_wiki", "papers": "$fetch_arxiv"}),
        ],
        thoughts=["While Wikipedia is loading, I'll also fetch recent research papers."],
        responses=[(True, "Based on my comprehensive analysis:\n\n$analysis")],
        feeds={},
        warnings=[],
        waves=[["fetch_wiki", "fetch_arxiv"], ["analyze"]],
    ),
    "mk1_03_non_terminating_responses.xml": Expected(
        actions=[
            A("phase1_data", "tool", "async", "data_collector", [], [], False, None,
              {"sources": ["wiki", "arxiv", "news"], "topic": "AI"}),
            A("phase2_analysis", "agent", "sync", "pattern_analyzer", ["phase1_data"], [],
              False, None, {"data": "$phase1_data"}),
            A("phase3_recommendations", "llm", "sync", "generate_recommendations",
              ["phase2_analysis"], [], False, None,
              {"analysis": "$phase2_analysis", "context": "enterprise AI adoption"}),
        ],
        thoughts=["provide updates as I progress", "analyze the patterns across all sources",
                  "generate comprehensive recommendations"],
        responses=[
            (False, "## Phase 1: Data Collection"),
            (False, "## Phase 2: Pattern Analysis"),
            (True, "## Final Report: AI Landscape Analysis"),
        ],
        feeds={},
        warnings=[],
        waves=[["phase1_data"], ["phase2_analysis"], ["phase3_recommendations"]],
    ),
    "mk1_04_context_feeds_runtime.xml": Expected(
        actions=[
            # $current_datetime names a feed of the document: known, no dependency.
            A("lightweight_analysis", "tool", "async", "quick_analyzer", [], [], False, None,
              {"data": "$input_data", "mode": "fast", "timestamp": "$current_datetime"}),
        ],
        thoughts=["use lighter-weight tools"],
        responses=[],
        feeds={
            "current_datetime": "2024-06-15T14:32:18Z",
            "system_metrics": {"cpu": 45.2, "memory": 62.8, "disk": 78.3,
                               "timestamp": "2024-06-15T14:32:18Z"},
        },
        # $input_data names no action, feed or variable of this document.
        warnings=[("unknown_reference", "$input_data")],
        waves=[["lightweight_analysis"]],
    ),
    "mk1_05_internal_actions.xml": Expected(
        actions=[
            A("add_error_feed", "internal", "sync", "add_context_feed", [], [], False, None,
              {"id": "recent_errors", "type": "on_demand",
               "source": {"type": "relic", "name": "log_service",
                          "params": {"filter": "ERROR", "since": "1h", "max_entries": 50}},
               "max_tokens": 1000}),
            # explicit add_error_feed, and $recent_errors is the feed add_error_feed creates.
            A("analyze_errors", "agent", "sync", "error_analyzer", ["add_error_feed"], [],
              False, None, {"logs": "$recent_errors", "context": "$system_metrics"}),
            A("update_metrics_feed", "internal", "sync", "update_context_feed", [],
              ["analyze_errors"], False, None, {"id": "system_metrics", "interval": 10}),
            A("add_debug_feed", "internal", "sync", "add_context_feed", [],
              ["update_metrics_feed"], False, None,
              {"id": "debug_trace", "type": "periodic", "interval": 5,
               "source": {"type": "tool", "name": "debug_tracer",
                          "params": {"level": "verbose"}}}),
            A("retry_operation", "workflow", "sync", "main_workflow", [], ["add_debug_feed"],
              False, None, {"retry": True}),
            # written after the final response: still an action of the document.
            A("cleanup", "internal", "fire_and_forget", "remove_context_feed", [],
              ["retry_operation"], False, None, {"id": "debug_trace"}),
        ],
        thoughts=["add a context feed", "access the error logs via $recent_errors",
                  "attempt the operation again"],
        responses=[
            (False, "## Error Analysis\n\nI've identified the root cause:\n$analyze_errors"),
            (True, "**Cleaning up temporary feeds...**"),
        ],
        feeds={},
        # no <context_feed id="system_metrics"> in this document
        warnings=[("unknown_reference", "$system_metrics")],
        waves=[["add_error_feed"], ["analyze_errors"], ["update_metrics_feed"],
               ["add_debug_feed"], ["retry_operation"], ["cleanup"]],
    ),
    "mk1_06_combined_v1_1.xml": Expected(
        actions=[
            A("collect_logs", "tool", "async", "log_aggregator", [], [], True, None,
              {"since": "24h", "levels": ["ERROR", "WARN"]}),
            A("collect_metrics", "tool", "async", "metrics_collector", [], [], True, None,
              {"period": "24h", "resolution": "1h"}),
            A("add_db_feed", "internal", "sync", "add_context_feed", [], [], False, None,
              {"id": "database_status", "type": "periodic", "interval": 30,
               "source": {"type": "relic", "name": "postgres_monitor",
                          "params": {"metrics": ["connections", "query_time", "locks"]}}}),
            A("correlate_data", "agent", "sync", "correlation_analyzer",
              ["add_db_feed", "collect_logs", "collect_metrics"], [], False, None,
              {"logs": "$collect_logs", "metrics": "$collect_metrics",
               "db_status": "$database_status"}),
            A("generate_report", "llm", "sync", "report_generator", ["correlate_data"], [],
              False, None,
              {"analysis": "$correlate_data", "format": "executive_summary",
               "model": "gemini-1.5-pro"}),
        ],
        thoughts=["While those are running, I'll add a context feed",
                  "real-time database visibility via $database_status"],
        responses=[
            (False, "## Preliminary Analysis - $current_datetime"),
            (False, "**Correlation Findings:**\n$correlate_data"),
            (True, "## Final System Health Report\n**Generated:** $current_datetime"),
        ],
        feeds={"current_datetime": "2024-06-15T16:45:00Z",
               "system_metrics": {"cpu": 28.5, "memory": 45.2}},
        warnings=[],
        waves=[["collect_logs", "collect_metrics", "add_db_feed"], ["correlate_data"],
               ["generate_report"]],
    ),
    "mk1_07_parser_demo_stream.xml": Expected(
        actions=[
            A("fetch_wiki", "tool", "async", "web_scraper", [], [], False, "wiki_data",
              {"url": "https://en.wikipedia.org/wiki/Artificial_intelligence"}),
            A("fetch_arxiv", "tool", "async", "arxiv_search", [], [], False, "papers",
              {"query": "machine learning", "max_results": 5}),
            A("analyze", "agent", "sync", "data_analyzer", ["fetch_arxiv", "fetch_wiki"], [],
              False, "analysis", {"wiki": "$wiki_data", "papers": "$papers"}),
        ],
        thoughts=["fetch data from Wikipedia and arXiv in parallel"],
        # <response> without `final`: final
        responses=[(True, "1. Focus on transformer architectures")],
        feeds={},
        warnings=[],
        waves=[["fetch_wiki", "fetch_arxiv"], ["analyze"]],
    ),
    "mk1_08_depends_on_attribute_variant.xml": Expected(
        actions=[
            A("fetch1", "tool", "async", "web_scraper", [], [], True, "data1",
              {"url": "https://example.com"}),
            A("fetch2", "tool", "async", "api_call", [], [], True, "data2",
              {"endpoint": "/data"}),
            # unquoted attribute depends_on=["fetch1","fetch2"], plus $data1/$data2
            A("analyze", "agent", "sync", "analyzer", ["fetch1", "fetch2"], [], False, None,
              {"input1": "$data1", "input2": "$data2"}),
        ],
        thoughts=["While those run, I'll plan the analysis."],
        responses=[(True, "Analysis complete: ...")],
        feeds={},
        warnings=[],
        waves=[["fetch1", "fetch2"], ["analyze"]],
    ),
    "mk1_09_features_doc_variant.xml": Expected(
        actions=[
            # "tool" key instead of "name"
            A("search", "tool", "async", "web_scraper", [], [], False, None,
              {"url": "https://example.com"}),
            # depends_on="search" attribute
            A("calc", "tool", "sync", "calculator", ["search"], [], False, None,
              {"expression": "42 + 8"}),
        ],
        thoughts=["I'll do these in parallel to save time."],
        responses=[(True, "Based on my search and calculations, here's what I found...")],
        feeds={},
        warnings=[],
        waves=[["search"], ["calc"]],
    ),
}

DOCS = sorted(EXPECTED)


def read(name: str) -> str:
    path = CORPUS / name
    assert path.is_file(), f"corpus document {path} is missing"
    return path.read_text(encoding="utf-8")


def test_corpus_directory_exists_and_is_fully_covered() -> None:
    assert CORPUS.is_dir(), f"protocol corpus not found at {CORPUS}"
    assert sorted(p.name for p in CORPUS.glob("*.xml")) == DOCS


@pytest.mark.parametrize("name", DOCS)
def test_corpus_document(name: str) -> None:
    expected = EXPECTED[name]
    doc = load_document(read(name))
    report = doc.to_json()

    assert report["errors"] == []
    assert doc.ok
    got_actions = [
        A(a["id"], a["type"], a["mode"], a["name"], a["depends_on"], a["after"],
          a["in_thought"], a["output_key"], a["parameters"])
        for a in report["actions"]
    ]
    assert got_actions == expected.actions
    assert report["waves"] == expected.waves

    assert len(report["thoughts"]) == len(expected.thoughts)
    for text, fragment in zip(report["thoughts"], expected.thoughts, strict=True):
        assert fragment in text
        assert "<action" not in text and "</action>" not in text
        assert text == text.strip()

    assert [r["final"] for r in report["responses"]] == [f for f, _ in expected.responses]
    for response, (_, fragment) in zip(report["responses"], expected.responses, strict=True):
        assert fragment in response["text"]
        assert "<response" not in response["text"] and "</response>" not in response["text"]

    # Every corpus document is made of blocks separated by blank lines only.
    assert report["text"] == []
    assert doc.feeds == expected.feeds
    assert [w["kind"] for w in report["warnings"]] == [k for k, _ in expected.warnings]
    for warning, (_, fragment) in zip(report["warnings"], expected.warnings, strict=True):
        assert fragment in warning["message"]


@pytest.mark.parametrize("name", DOCS)
def test_corpus_document_is_chunking_invariant(name: str) -> None:
    text = read(name)
    whole = load_document(text).to_json()
    for size in (1, 2, 3, 5, 13, 64):
        assert load_document(text, chunk=size).to_json() == whole, size


@pytest.mark.parametrize("name", DOCS)
def test_corpus_document_events_have_no_problems(name: str) -> None:
    events = p.coalesce(p.parse_document(read(name)))
    assert [e.data for e in events if e.type == p.PROTOCOL_ERROR] == []
    # Loose text between blocks is whitespace only, and kept (never dropped).
    loose = [e.data["text"] for e in events if e.type == p.TEXT]
    assert loose
    assert all(not t.strip() for t in loose)


def test_actions_inside_thought_interleave_with_thought_chunks() -> None:
    """mk1_02: each action is parsed as soon as its </action> arrives; the thought goes on."""
    events = p.coalesce(p.parse_document(read("mk1_02_actions_in_thoughts.xml")))
    shape = [(e.type, e.data["action"].id if e.type == p.ACTION_PARSED else None)
             for e in events if e.type != p.TEXT]
    assert shape == [
        (p.THOUGHT_CHUNK, None),
        (p.ACTION_PARSED, "fetch_wiki"),
        (p.THOUGHT_CHUNK, None),
        (p.ACTION_PARSED, "fetch_arxiv"),
        (p.THOUGHT_CHUNK, None),
        (p.THOUGHT_END, None),
        (p.ACTION_PARSED, "analyze"),
        (p.RESPONSE_CHUNK, None),
        (p.RESPONSE_END, None),
    ]
    chunks = [e.data["text"] for e in events if e.type == p.THOUGHT_CHUNK]
    assert chunks[0].rstrip().endswith("in parallel.")
    assert chunks[1].strip() == "While Wikipedia is loading, I'll also fetch recent research papers."
    assert chunks[2].strip().startswith("Both of these are now running")
    end = next(e for e in events if e.type == p.THOUGHT_END)
    assert end.data["text"] == "".join(chunks)


def test_action_after_final_response_is_still_parsed() -> None:
    """mk1_05: `cleanup` comes after the final response and is still an action."""
    events = p.parse_document(read("mk1_05_internal_actions.xml"))
    kinds = [(e.type, e.data.get("final")) for e in events
             if e.type in (p.RESPONSE_END, p.ACTION_PARSED)]
    assert kinds[-2:] == [(p.RESPONSE_END, True), (p.ACTION_PARSED, None)]
    last_action = [e for e in events if e.type == p.ACTION_PARSED][-1].data["action"]
    assert last_action.id == "cleanup"
    assert last_action.mode == "fire_and_forget"


def test_response_without_final_attribute_is_final() -> None:
    for name in ("mk1_01_complete_example.xml", "mk1_07_parser_demo_stream.xml",
                 "mk1_09_features_doc_variant.xml"):
        text = read(name)
        assert 'final="' not in text
        ends = [e for e in p.parse_document(text) if e.type == p.RESPONSE_END]
        assert [e.data["final"] for e in ends] == [True]
        chunks = [e for e in p.parse_document(text) if e.type == p.RESPONSE_CHUNK]
        assert chunks and all(e.data["final"] is True for e in chunks)


def test_action_positions_point_at_the_opening_tag() -> None:
    text = read("mk1_09_features_doc_variant.xml")
    doc = load_document(text)
    lines = text.split("\n")
    for action in doc.actions:
        assert lines[action.line - 1][action.column - 1:].startswith(f'<action id="{action.id}"')
    assert [(a.line, a.column) for a in doc.actions] == [(6, 1), (13, 1)]


def test_context_feeds_arrive_as_events_before_the_thought() -> None:
    events = p.parse_document(read("mk1_04_context_feeds_runtime.xml"))
    typed = [e for e in events if e.type != p.TEXT]
    assert [e.type for e in typed[:2]] == [p.CONTEXT_FEED, p.CONTEXT_FEED]
    assert typed[0].data == {"id": "current_datetime", "value": "2024-06-15T14:32:18Z"}
    assert typed[1].data["id"] == "system_metrics"
    assert typed[1].data["value"]["cpu"] == 45.2
