"""The agent loop: streaming dispatch against parse-then-execute and a one-action-per-turn loop.

Usage: python bench/agent.py [--runs N] [--tps T]

One run starts a private redis-server on 127.0.0.1 (free port), `cortex worker --pool tool
--concurrency 4`, `cortex worker --pool agent --concurrency 200` (threads, the agent pool's
default), `cortex api`, and the tests' fake OpenAI-compatible model server (`tests/fake_llm.py`) in this
process on 127.0.0.1. The agent is `tester` from `tests/manifests/agents.yaml`; each job names
its own fake model through `options.model`, so each job gets its own script. All of them are
stopped at the end, also on errors and Ctrl-C.

A "token" here is one streamed chunk of 4 characters; the fake model sends T of them per second
(default 50, so 200 characters per second).

Three transcripts of the same length, each run as a real agent job, `--runs` times each (the
rounds interleave the three so a slow spell of the machine hits all of them):

(a) streaming: one turn; a short thought opening, three independent async actions (sleep 1 s
    each), ~150 tokens more thought, then a `final="true"` response that renders `${a.slept}`
    etc. Each action is dispatched when its `</action>` reaches the parser.
(b) actions at the end: the same text reordered so the three actions are the last bytes of the
    generation (thought, final response, then the three actions). The last action can start only
    after the generation has ended, which is parse-then-execute for this job's makespan (its
    three actions run in parallel either way; the job ends when the last one does).
(c) one action per turn (a ReAct loop): four turns, each a short thought and one *sync* action
    (which ends the generation), the fourth the final response. The thought text is the same
    words split over the turns, trimmed so the total characters match (a) within a few.

Measured, from the job's event log (timestamps are taken by the workers) and the fake model's
own log of when it wrote each chunk:

- dispatch latency: `ts(action_started) - ts(action_parsed)`, p50/p99 (also split at
  `action_queued`), and from the fake server writing the chunk that completes `</action>` to
  `action_parsed`;
- makespan: `job_started` -> `job_completed` (and `job_queued` -> `job_completed`), with the
  time the model spent streaming.

This is a measurement, not a test: it always exits 0 once the measurement has completed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402

from bench.common import pct, print_header, stop_on_sigterm  # noqa: E402
from tests import harness  # noqa: E402
from tests.fake_llm import FakeLLM, Turn  # noqa: E402

MANIFESTS_DIR = REPO_ROOT / "tests" / "manifests"
AGENT = "tester"
CHUNK_CHARS = 4  # one token = one streamed chunk of this many characters
TOOL_CONCURRENCY = 4
SLEEP_S = 1.0
TERMINAL = {"completed", "failed", "cancelled"}

# Filler thought: plain sentences, cut to length at a word boundary.
_FILLER = (
    "The three lookups are independent of each other, so they can all run while I keep "
    "thinking about how to combine their answers. Once they are back I will compare the "
    "values, check that each one reports the time it slept, and write a short final answer "
    "that quotes all three results. If one of them failed I would say so instead of guessing. "
    "Meanwhile I can plan the wording of the answer: first a one-line summary, then the three "
    "values in the order the actions were started, then a note about how long the whole job "
    "took compared with running the steps one after another. There is nothing else to fetch, "
    "and no step depends on another step, so no further actions are needed after these three. "
    "The answer should stay short and plain, without tables or headings, because the user "
    "asked only for the results and a one sentence conclusion about them."
)
HEAD = "I need three independent results; I start all three now and keep planning.\n"


def filler(chars: int) -> str:
    """The first ~`chars` characters of the filler, ending at a word boundary."""
    text = _FILLER
    while len(text) < chars:
        text += " " + _FILLER
    cut = text[:chars]
    return cut[: cut.rfind(" ")] if " " in cut and len(text) > chars else cut


def action_tag(ident: str, mode: str) -> str:
    body = {"name": "sleep", "parameters": {"seconds": SLEEP_S}}
    return f'<action type="tool" mode="{mode}" id="{ident}">{json.dumps(body)}</action>\n'


RESPONSE = ('<response final="true">All three finished: a slept ${a.slept} s, b slept '
            '${b.slept} s, c slept ${c.slept} s.</response>\n')
IDS = ("a", "b", "c")


def loadavg() -> str:
    """The machine's 1, 5 and 15 minute load averages (other work on it skews the figures)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def tokens(text: str) -> int:
    return -(-len(text) // CHUNK_CHARS)


def transcripts(tail_tokens: int) -> dict[str, list[str]]:
    """Variant -> the text of each turn."""
    tail = filler(tail_tokens * CHUNK_CHARS) + "\n"
    acts = [action_tag(i, "async") for i in IDS]
    streaming = f"<thought>{HEAD}{''.join(acts)}{tail}</thought>\n{RESPONSE}"
    at_end = f"<thought>{HEAD}{tail}</thought>\n{RESPONSE}{''.join(acts)}"
    # ReAct: the same thought words over four turns, trimmed to the same total characters.
    syncs = [action_tag(i, "sync") for i in IDS]
    fixed = 4 * len("<thought></thought>\n") + sum(map(len, syncs)) + len(RESPONSE)
    words = (HEAD + tail).replace("\n", " ").split(" ")
    budget = len(streaming) - fixed
    parts: list[list[str]] = [[], [], [], []]
    used = 0
    for n, word in enumerate(words):
        if used + len(word) + 1 > budget:
            break
        parts[min(3, n * 4 // len(words))].append(word)
        used += len(word) + 1
    thoughts = [" ".join(p) + "\n" for p in parts]
    react = [f"<thought>{thoughts[k]}</thought>\n{syncs[k]}" for k in range(3)]
    react.append(f"<thought>{thoughts[3]}</thought>\n{RESPONSE}")
    return {"a": [streaming], "b": [at_end], "c": react}


# --------------------------------------------------------------------------- statistics


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


# --------------------------------------------------------------------------- the stack


def base_env(redis_url: str, workdir: Path, llm_url: str) -> dict[str, str]:
    """Environment of Cortex processes: no inherited CORTEX_/CELERY_ settings, this repo on
    the path, the private Redis, the test manifests and the fake model's URL."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CORTEX_", "CELERY_")) and k != "REDIS_URL"}
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", os.defpath)])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO_ROOT), env.get("PYTHONPATH", "")]
                                        if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["_TYPER_STANDARD_TRACEBACK"] = "1"
    env["CORTEX_REDIS_URL"] = redis_url
    env["CORTEX_MANIFESTS"] = str(MANIFESTS_DIR)
    env["CORTEX_WORKSPACE_ROOT"] = str(workdir / "workspaces")
    env["CORTEX_TEST_LLM_URL"] = llm_url
    # Nothing here goes anywhere but 127.0.0.1.
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    for key in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                "all_proxy"):
        env.pop(key, None)
    return env


class Stack:
    """Redis, the fake model, the API, and whatever workers a benchmark starts."""

    def __init__(self, workdir: Path, listen_backlog: int = 5) -> None:
        self.workdir = workdir
        self.log_dir = workdir / "logs"
        self.redis_server: harness.RedisServer | None = None
        self.llm: FakeLLM | None = None
        self.env: dict[str, str] = {}
        self.api_url = ""
        self.store: Any = None
        self.listen_backlog = listen_backlog

    def start(self, workers: dict[str, int | None] | None = None) -> None:
        self.redis_server = harness.RedisServer(log_dir=self.log_dir,
                                                data_dir=self.workdir / "redis")
        self.redis_server.start()
        self.llm = FakeLLM()
        self.llm.start()
        assert self.llm._server is not None
        if self.listen_backlog > 5:
            # socketserver's default listen backlog is 5: a burst of connects would wait for
            # SYN retransmits (1 s, 3 s...). Re-listen with a deeper queue before any client.
            self.llm._server.socket.listen(self.listen_backlog)
        self.env = base_env(self.redis_server.url, self.workdir, self.llm.url)
        # This process's own Cortex imports must see the private Redis, never a default one.
        for key in [k for k in os.environ if k.startswith("CORTEX_")]:
            del os.environ[key]
        os.environ.update({k: v for k, v in self.env.items() if k.startswith("CORTEX_")})
        from cortex_worker.store.state import Store

        self.store = Store.from_url(self.redis_server.url)
        if workers:
            harness.start_workers(workers, self.env, log_dir=self.log_dir, cwd=self.workdir,
                                  timeout=90)
        api = harness.start_api(self.env, log_dir=self.log_dir, cwd=self.workdir)
        self.api_url = api.url

    def stop(self) -> None:
        try:
            harness.stop_all()
        finally:
            try:
                if self.store is not None:
                    self.store.redis.close()
                if self.llm is not None:
                    self.llm.close()
            finally:
                if self.redis_server is not None:
                    self.redis_server.close()

    # -- jobs

    def submit_agent(self, model: str, text: str = "Run the benchmark task.",
                     client: httpx.Client | None = None) -> str:
        body = {"agent": AGENT, "input": text, "options": {"model": model}}
        post = client.post if client is not None else httpx.post
        response = post(f"{self.api_url}/v1/jobs", json=body, timeout=60)
        if response.status_code != 202:
            raise RuntimeError(f"submit failed: {response.status_code} {response.text[:500]}")
        return response.json()["id"]

    def wait_job(self, job_id: str, timeout: float = 120.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            job = self.store.peek(job_id, "status")
            if job is not None and job.status in TERMINAL:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job and job.status} after {timeout}s")
            time.sleep(0.01)
        return self.store.events_after(job_id)


def ended_ok(events: list[dict[str, Any]]) -> None:
    if events[-1]["type"] != "job_completed":
        raise RuntimeError(f"job ended {json.dumps(events[-1])[:800]}")


# --------------------------------------------------------------------------- one job


def first(events: list[dict[str, Any]], kind: str) -> float:
    return next(e["ts"] for e in events if e["type"] == kind)


def last(events: list[dict[str, Any]], kind: str) -> float:
    return [e["ts"] for e in events if e["type"] == kind][-1]


def per_action(events: list[dict[str, Any]], kind: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for e in events:
        if e["type"] == kind:
            ident = (e["data"].get("action_id") or e["data"].get("action", {}).get("id"))
            out.setdefault(ident, e["ts"])
    return out


def run_variant(stack: Stack, variant: str, turns: list[str], tps: float,
                clock_offset: float) -> dict[str, Any]:
    """Run one job of `variant`; return its figures."""
    assert stack.llm is not None
    model = f"bench-{variant}-{uuid.uuid4().hex[:8]}"
    stack.llm.script(model, [Turn(text=t, tokens_per_second=tps, chunk_chars=CHUNK_CHARS)
                             for t in turns])
    job_id = stack.submit_agent(model)
    events = stack.wait_job(job_id)
    ended_ok(events)
    result = next(e["data"]["result"] for e in events if e["type"] == "job_completed")
    if "$" in (result or "") or "1.0 s" not in (result or ""):
        raise RuntimeError(f"response not rendered: {result!r}")
    parsed = per_action(events, "action_parsed")
    queued = per_action(events, "action_queued")
    started = per_action(events, "action_started")
    completed = per_action(events, "action_completed")
    logs = stack.llm.stream_log(model)
    requests = stack.llm.requests(model)
    # When the fake server wrote the chunk that completed each `</action>` (unix seconds).
    wire: dict[str, float] = {}
    for k, text in enumerate(turns):
        for ident in IDS:
            tag = f'id="{ident}"'
            at = text.find(tag)
            if at < 0:
                continue
            end = text.find("</action>", at) + len("</action>")
            when = next((t for t, chars in logs[k] if chars >= end), None)
            if when is not None:
                wire[ident] = when + clock_offset
    streaming_s = sum(log[-1][0] - req["received_at"]
                      for log, req in zip(logs, requests, strict=True) if log)
    # Between turns (c): the sync action completed -> the next model request arrived.
    turnaround = [requests[k + 1]["received_at"] + clock_offset - completed[ident]
                  for k, ident in enumerate(IDS) if k + 1 < len(requests)]
    return {
        "job_id": job_id,
        "parse_to_start": [started[a] - parsed[a] for a in IDS],
        "parse_to_queue": [queued[a] - parsed[a] for a in IDS],
        "queue_to_start": [started[a] - queued[a] for a in IDS],
        "wire_to_parse": [parsed[a] - wire[a] for a in IDS if a in wire],
        # Agent jobs log `job_started` with their first `turn_started` (older engines did not
        # log it at all: then the first `turn_started` stands in).
        "makespan": last(events, "job_completed") - first(events, "job_started" if any(
            e["type"] == "job_started" for e in events) else "turn_started"),
        "has_job_started": any(e["type"] == "job_started" for e in events),
        "from_queued": last(events, "job_completed") - first(events, "job_queued"),
        "streaming": streaming_s,
        "requests": len(requests),
        "stream_end_to_last_start": max(started.values()) - (logs[-1][-1][0] + clock_offset),
        "turnaround": turnaround,
        "close": last(events, "job_completed") - max(max(completed.values()),
                                                     logs[-1][-1][0] + clock_offset),
        "actions_span": max(completed.values()) - min(started.values()),
        "tokens": sum(tokens(t) for t in turns),
    }


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=5, help="jobs per variant (default 5)")
    parser.add_argument("--tps", type=float, default=50.0,
                        help="tokens (4-character chunks) per second (default 50)")
    parser.add_argument("--tail-tokens", type=int, default=150,
                        help="tokens of thought after the three actions in (a) (default 150)")
    args = parser.parse_args(argv)

    stop_on_sigterm()
    scripts = transcripts(args.tail_tokens)
    print_header(f"load average {loadavg()}")
    print(f"model:    fake OpenAI-compatible server, {args.tps:g} tokens/s, 1 token = 1 chunk "
          f"of {CHUNK_CHARS} characters, no time to first token")
    print(f"pools:    tool x{TOOL_CONCURRENCY} (prefork), agent x100 (threads, the default)")
    for name, turns in scripts.items():
        chars = [len(t) for t in turns]
        print(f"variant {name}: {len(turns)} turn(s), {sum(chars)} characters = "
              f"{sum(tokens(t) for t in turns)} tokens ({' + '.join(str(tokens(t)) for t in turns)})"
              f", {sum(tokens(t) for t in turns) / args.tps:.2f} s of streaming")
    for ident in IDS:
        text = scripts["a"][0]
        end = text.find("</action>", text.find(f'id="{ident}"')) + len("</action>")
        print(f"  (a) </action> of {ident} ends at token {tokens(text[:end])} of "
              f"{tokens(text)}")
    text = scripts["b"][0]
    ends = [tokens(text[:text.find("</action>", text.find(f'id="{i}"')) + 9]) for i in IDS]
    print(f"  (b) the </action> of a, b, c end at tokens {', '.join(map(str, ends))} of "
          f"{tokens(text)} (the last token is the newline after c)")

    workdir = Path(tempfile.mkdtemp(prefix="cortex-bench-agent-"))
    stack = Stack(workdir)
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in scripts}
    t0 = time.monotonic()
    try:
        print("  starting redis, fake model, workers, api ...", flush=True)
        stack.start({"tool": TOOL_CONCURRENCY, "agent": 100})
        print(f"  logs in {stack.log_dir}", flush=True)
        offset = time.time() - time.monotonic()
        # Warm-up: the first job of each variant pays for imports, connections and registry loads.
        for _ in range(2):
            for name, turns in scripts.items():
                run_variant(stack, name, turns, args.tps, offset)
        print("  warm-up done (2 jobs per variant)", flush=True)
        busy0 = machine_ticks()
        for r in range(args.runs):
            for name, turns in scripts.items():
                res = run_variant(stack, name, turns, args.tps, offset)
                results[name].append(res)
                print(f"  round {r + 1}/{args.runs} ({name}): makespan {res['makespan']:.3f} s",
                      flush=True)
        busy1 = machine_ticks()
        print(f"  machine CPU busy (all cores) during the measured rounds: "
              f"{(busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]):.0%}", flush=True)
    finally:
        print("  stopping everything ...", flush=True)
        stack.stop()
    print(f"total wall time: {time.monotonic() - t0:.1f} s; load average at the end: "
          f"{loadavg()}\n")
    report(results, args)
    return 0


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    def collect(name: str, key: str) -> list[float]:
        return [x for r in results[name] for x in r[key]]

    print("dispatch latency (ms), `</action>` at the parser -> task started:")
    rows = [("variant", "samples", "parsed->started p50", "p99", "max", "parsed->queued p50",
             "queued->started p50", "wire->parsed p50", "p99")]
    labels = {"a": "(a) streaming, 3 async", "b": "(b) 3 async at the end",
              "c": "(c) 1 sync per turn"}
    for name in results:
        pts, ptq, qts, wtp = (collect(name, k) for k in
                              ("parse_to_start", "parse_to_queue", "queue_to_start",
                               "wire_to_parse"))
        rows.append((labels[name], str(len(pts)), ms(pct(pts, 50)), ms(pct(pts, 99)),
                     ms(max(pts)), ms(pct(ptq, 50)), ms(pct(qts, 50)), ms(pct(wtp, 50)),
                     ms(pct(wtp, 99))))
    allp = [x for n in results for x in collect(n, "parse_to_start")]
    rows.append(("all", str(len(allp)), ms(pct(allp, 50)), ms(pct(allp, 99)), ms(max(allp)),
                 "", "", "", ""))
    table(rows)

    start = ("job_started" if all(r["has_job_started"] for rs in results.values() for r in rs)
             else "first turn_started (no job_started logged)")
    print(f"\nmakespan (s), median of {args.runs} jobs (min-max), {start} -> job_completed:")
    med: dict[str, float] = {}
    rows = [("variant", "tokens", "requests", "makespan", "min", "max",
             "job_queued->completed", "model streaming", "makespan - streaming")]
    for name, runs in results.items():
        spans = [r["makespan"] for r in runs]
        med[name] = statistics.median(spans)
        rows.append((labels[name], str(runs[0]["tokens"]), str(runs[0]["requests"]),
                     f"{med[name]:.3f}", f"{min(spans):.3f}", f"{max(spans):.3f}",
                     f"{statistics.median(r['from_queued'] for r in runs):.3f}",
                     f"{statistics.median(r['streaming'] for r in runs):.3f}",
                     f"{statistics.median(r['makespan'] - r['streaming'] for r in runs):.3f}"))
    table(rows)
    print("\nwhere the time goes (ms, median):")
    for name in ("a", "b"):
        runs = results[name]
        lead = statistics.median(r["stream_end_to_last_start"] for r in runs) * 1000
        print(f"  {labels[name]}: the last action started {abs(lead):.1f} ms "
              f"{'before' if lead < 0 else 'after'} the model's last chunk was written; first "
              f"action start -> last action completion "
              f"{statistics.median(r['actions_span'] for r in runs) * 1000:.1f}; the later of "
              "(last chunk, last action completion) -> job_completed "
              f"{statistics.median(r['close'] for r in runs) * 1000:.1f}")
    turn = [x for r in results["c"] for x in r["turnaround"]]
    print(f"  {labels['c']}: sync action completed -> next model request received "
          f"p50 {ms(pct(turn, 50))}, max {ms(max(turn))} ({len(turn)} samples); "
          f"stream end -> job_completed {statistics.median(r['close'] for r in results['c']) * 1000:.1f}")
    print(f"\nspeedup of streaming dispatch: b/a = {med['b'] / med['a']:.2f}x, "
          f"c/a = {med['c'] / med['a']:.2f}x")
    print("makespans (s): " + "; ".join(
        f"{n}: " + ", ".join(f"{r['makespan']:.3f}" for r in runs) for n, runs in results.items()))


def table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:],
                                                                          strict=True)]
        print("  ".join(cells).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted; all processes stopped", file=sys.stderr)
        sys.exit(130)
