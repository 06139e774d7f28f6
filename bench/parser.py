"""Parser throughput: how many MB/s `StreamParser` takes in, by feed size.

Usage: python bench/parser.py [--size-mb N]

Builds a document of at least N MB (default 1) by repeating realistic protocol content: a
thought with actions nested in it, a sync join, a progress response, a fire-and-forget action
and a final response with `$references`. Ids get a per-repetition suffix so the document has
no duplicate ids. The document is fed whole, 4 characters at a time (about one model token)
and 1 character at a time; each is timed best of 3. Timed: feeding, close() and
handing each event to a consumer that counts it; the chunks are cut beforehand, as a model
stream hands over ready strings. This is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_header
from cortex_worker.protocol.parser import ACTION_PARSED, PROTOCOL_ERROR, StreamParser

RUNS = 3
ACTIONS_PER_BLOCK = 4

BLOCK = """\
<thought>
Request {n}: the user wants a short report on <b>recent AI research</b> & its costs (< $5k).
I'll fetch sources in parallel while I keep planning.

<action type="tool" mode="async" id="wiki_{n}">
{{
  "name": "web_scraper",
  "parameters": {{"url": "https://en.wikipedia.org/wiki/AI?page={n}"}},
  "output_key": "wiki_data_{n}"
}}
</action>

While Wikipedia loads, search arXiv too.

<action type="tool" mode="async" id="arxiv_{n}">
{{
  "name": "arxiv_search",
  "parameters": {{"query": "machine learning", "max_results": 10}},  // enough for a summary
  "output_key": "papers_{n}"
}}
</action>

Both run in the background; next I join them.
</thought>

<action type="agent" mode="sync" id="analyze_{n}" depends_on='["wiki_{n}","arxiv_{n}"]'>
{{
  "name": "comprehensive_analyzer",
  "parameters": {{
    "wikipedia": "$wiki_data_{n}",
    "research_papers": "${{papers_{n}.items}}",
    "note": "sources: $wiki_data_{n} and $papers_{n}; budget $$5k"
  }},
  "output_key": "analysis_{n}",
  "timeout": 120,
  "retry": 1
}}
</action>

<response final="false">
## Progress {n}
Collected **2 sources**; analysis is running. Details: `$analysis_{n}`.
</response>

<action type="relic" mode="fire_and_forget" id="cache_{n}" depends_on="analyze_{n}">
{{"name": "results_cache", "parameters": {{"key": "report_{n}", "value": "$analysis_{n}", "ttl": 86400}}}}
</action>

<response final="true">
# AI Research Report {n}

$analysis_{n}

Based on ${{wiki_data_{n}.summary}} and $papers_{n}: transformers dominate; cost < $$5k.
</response>
"""


def build_document(size_mb: float) -> tuple[str, int]:
    """The document (at least `size_mb` MB of UTF-8) and the number of repetitions in it."""
    target = int(size_mb * 1_000_000)
    parts: list[str] = []
    size = 0
    n = 0
    while size < target:
        n += 1
        block = BLOCK.format(n=n)
        parts.append(block)
        size += len(block.encode("utf-8"))
    return "".join(parts), n


def split(text: str, size: int | None) -> list[str]:
    """The chunks a stream would deliver: the whole text, or pieces of `size` characters."""
    if size is None:
        return [text]
    return [text[start:start + size] for start in range(0, len(text), size)]


def parse(chunks: list[str]) -> Counter[str]:
    """The timed part: feed the chunks to a fresh parser, close it, and consume each event
    as it comes (counted by type, not kept: a streaming consumer handles events one by one)."""
    parser = StreamParser()
    push = parser.feed
    counts: Counter[str] = Counter()
    for chunk in chunks:
        for event in push(chunk):
            counts[event.type] += 1
    for event in parser.close():
        counts[event.type] += 1
    return counts


def best_of(chunks: list[str]) -> tuple[float, Counter[str]]:
    best = float("inf")
    counts: Counter[str] = Counter()
    for _ in range(RUNS):
        start = time.perf_counter()
        counts = parse(chunks)
        best = min(best, time.perf_counter() - start)
    return best, counts


def first_errors(text: str) -> list[dict]:
    """The first protocol errors of the document, to show what went wrong (untimed)."""
    parser = StreamParser()
    events = parser.feed(text) + parser.close()
    return [event.data for event in events if event.type == PROTOCOL_ERROR][:3]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=1.0,
                    help="minimum document size in MB (default and least: 1)")
    args = ap.parse_args()
    size_mb = max(args.size_mb, 1.0)

    text, repetitions = build_document(size_mb)
    mb = len(text.encode("utf-8")) / 1_000_000
    print_header()
    print(f"document: {mb:.2f} MB, {len(text):,} characters, {repetitions} repetitions, "
          f"{ACTIONS_PER_BLOCK * repetitions} actions")
    print()

    modes = [("whole document", None), ("4 characters (token-sized)", 4), ("1 character", 1)]
    rows = []
    for label, size in modes:
        chunks = split(text, size)  # prepared untimed: a stream hands over ready strings
        feeds = len(chunks)
        seconds, counts = best_of(chunks)
        assert counts[PROTOCOL_ERROR] == 0, f"{label}: protocol errors: {first_errors(text)}"
        assert counts[ACTION_PARSED] == ACTIONS_PER_BLOCK * repetitions, f"{label}: {counts}"
        rows.append((label, feeds, counts.total(), seconds, mb / seconds,
                     counts[PROTOCOL_ERROR]))

    print(f"{'feeding':<28} {'feeds':>10} {'events':>10} {'best of 3 (s)':>14} {'MB/s':>7} "
          f"{'protocol errors':>16}")
    for label, feeds, events, seconds, rate, errors in rows:
        print(f"{label:<28} {feeds:>10,} {events:>10,} {seconds:>14.3f} {rate:>7.2f} "
              f"{errors:>16}")
    one_char = rows[-1][4]
    verdict = "meets" if one_char >= 1.0 else "MISSES"
    print(f"\ntarget: >= 1 MB/s at 1 character per feed: {verdict} ({one_char:.2f} MB/s)")


if __name__ == "__main__":
    main()
