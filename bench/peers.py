"""Cortex and LangGraph side by side on one scripted model: makespans against their ideals.

Usage: python bench/peers.py [--runs 5] [--warmup 1] [--ttft 0.4] [--tps 50] [--jobs 1]
                             [--sleep-scale 1] [--end-token]

Needs the `bench` extra (`pip install -e '.[bench]'`: langgraph, langchain-openai).

One run starts, all on 127.0.0.1: a private redis-server (free port), `cortex worker --pool
tool --concurrency 4xJOBS`, `cortex worker --pool agent --concurrency 200` (threads, the
pool's default), `cortex api`, and the tests' fake OpenAI-compatible model server
(`tests/fake_llm.py`) in this process. The model answers each request after `--ttft` seconds
(time to first token), then streams `--tps` tokens a second; a token is one chunk of 4
characters, or the first fragment (id and name) of a native tool call. A message ends with
its last chunk, or with `--end-token` a token later, as engines stream it (the model's
end-of-turn token is a step of its own: LangGraph acts on a message at its end, Cortex on a
native call at its last argument fragment). It keeps connections alive between requests, as
real providers do, and each peer keeps its own open between jobs: a Cortex worker's
process-wide client, and one `httpx.Client` for every LangGraph run.
Everything is stopped at the end, also on errors and Ctrl-C.

Both peers call the same Python function, `lookup` below (it sleeps `seconds`, then returns
a value and when it ran). For Cortex it is a `@tool` of this module (a `kind: ToolModule`
manifest), run in the tool pool's sandbox; LangGraph's `create_react_agent` calls
`lookup.fn` in this process. The model script, per workload:

- A, four parallel lookups: turn 1 streams a sentence and four `lookup` calls (1.2, 1.5, 0.8
  and 1.0 s), turn 2 a short answer;
- B, sequential ReAct: three turns of a sentence and one call (0.8, 1.0, 1.2 s), then an
  answer.

Variants: LangGraph (ChatOpenAI, streaming, native tool calls); Cortex native (the same
stream; the agent's model has `native_tools: true`); Cortex protocol (the same script with
each call written as an `<action>` block in the text, `async` in A and `sync` in B, and the
answer in a `<response final="true">`; a longer stream).

Measured per job: makespan, from just before the submission (Cortex: POST /v1/jobs; LangGraph:
`invoke`) to completion (`job_completed`'s timestamp; `invoke` returning). With `--jobs N`,
N jobs of a variant run at once and each job's latency counts. Ideals are computed from the
script with the server's exact pacing (a turn of n tokens lasts ttft + (n - 1)/tps): the
turns' streams plus the tools' critical path, a tool starting when its call is complete:

- LangGraph's own ideal: every call of a turn starts when the message ends;
- Cortex native's own ideal: a call starts at its last argument fragment (the one that closes
  its JSON object), as the gateway dispatches: the best possible on the native stream;
- Cortex protocol's own ideal: an action starts at the token that completes its `</action>`;
- best possible (shared, on the native stream): a call starts at its last argument fragment.

Then Cortex's time over its own ideal is split along the job's critical path, from the job's
event log (workers' timestamps), the fake server's log of each request and token, and the
times `lookup` itself reports: submit -> first model request; per turn with tools, for the
call that finished last: its triggering token -> `action_parsed` -> `action_started` ->
`lookup` running (sandbox start-up) -> `lookup` done -> `action_completed` -> the next model
request; the last token -> `job_completed`. LangGraph's likewise, as far as it can be seen.

A measurement, not a test: it exits 0 once the measurement has completed.
"""

from __future__ import annotations

import functools
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from cortex_worker.tools.function import tool  # noqa: E402

if TYPE_CHECKING:
    import argparse

    import httpx

    from bench.agent import Stack
    from tests.fake_llm import FakeLLM, Turn

# This module is also the tools' module: the sandbox imports it for every `lookup` call. Its
# top level therefore imports only what `@tool` needs; the benchmark's own machinery (httpx,
# the harness, LangGraph, even argparse and statistics) is imported where it is used.


@tool
def lookup(key: str, seconds: float) -> dict[str, Any]:
    """Look up `key`; takes `seconds`. Returns its value and when the lookup ran."""
    started = time.time()
    time.sleep(seconds)
    return {"key": key, "value": sum(map(ord, key)), "started": started, "ended": time.time()}


CHUNK_CHARS = 4
AGENT_THREADS = 200  # the agent pool's default (the harness would start 2)
AGENTS = {"native": "peers_native", "protocol": "peers_protocol"}
VARIANTS = ("LangGraph", "Cortex native", "Cortex protocol")
TASK = "Look up the keys I need and tell me their values."
MANIFEST = f"""\
# Written by bench/peers.py: its two agents and its tool module.
agents:
  - name: {AGENTS["native"]}
    description: Calls lookup as native function calls.
    model: {{provider: openai, base_url: "${{CORTEX_TEST_LLM_URL}}", model: peers,
             api_key_env: null, native_tools: true}}
    tools: [lookup]
  - name: {AGENTS["protocol"]}
    description: Calls lookup with <action> blocks.
    model: {{provider: openai, base_url: "${{CORTEX_TEST_LLM_URL}}", model: peers,
             api_key_env: null}}
    tools: [lookup]
"""
TOOL_MODULE = "kind: ToolModule\nname: bench.peers\n"


# --------------------------------------------------------------------------- the script


@dataclass(frozen=True)
class Step:
    """One model turn: a sentence, then calls `(key, seconds)`; none: the final answer."""

    text: str
    calls: tuple[tuple[str, float], ...] = ()


WORKLOADS: dict[str, tuple[Step, ...]] = {
    "A four parallel lookups": (
        Step("I will look up all four keys at once.",
             (("alpha", 1.2), ("beta", 1.5), ("gamma", 0.8), ("delta", 1.0))),
        Step("alpha is 501, beta is 412, gamma is 521 and delta is 510. All four lookups "
             "succeeded."),
    ),
    "B sequential ReAct": (
        Step("First I look up alpha.", (("alpha", 0.8),)),
        Step("alpha is 501; now beta.", (("beta", 1.0),)),
        Step("beta is 412; last, gamma.", (("gamma", 1.2),)),
        Step("alpha is 501, beta is 412 and gamma is 521. All three lookups succeeded."),
    ),
}


def call_id(key: str) -> str:
    """The native call id of a lookup, which is also its Cortex action id."""
    return f"call_{key}"


def arguments(key: str, seconds: float) -> dict[str, Any]:
    return {"key": key, "seconds": seconds}


def action_block(key: str, seconds: float, mode: str) -> str:
    body = json.dumps({"name": "lookup", "parameters": arguments(key, seconds)})
    return f'\n<action type="tool" mode="{mode}" id="{call_id(key)}">{body}</action>'


def protocol_text(step: Step, mode: str) -> str:
    if not step.calls:
        return f'<response final="true">{step.text}</response>'
    return step.text + "".join(action_block(k, s, mode) for k, s in step.calls)


def turns(steps: Sequence[Step], protocol: bool, args: argparse.Namespace) -> list[Turn]:
    """The fake model's turns: native tool calls, or the same as protocol text."""
    from tests.fake_llm import Turn

    mode = "sync" if sum(1 for s in steps if s.calls) > 1 else "async"
    pace = {"tokens_per_second": args.tps, "chunk_chars": CHUNK_CHARS, "delay_s": args.ttft,
            "end_token": args.end_token}
    if protocol:
        return [Turn(text=protocol_text(s, mode), **pace) for s in steps]
    return [Turn(text=s.text, tool_calls=[{"id": call_id(k), "name": "lookup",
                                           "arguments": arguments(k, sec)}
                                          for k, sec in s.calls], **pace) for s in steps]


def chunks(chars: int) -> int:
    return math.ceil(chars / CHUNK_CHARS)


def triggers(turn: Turn, rule: str) -> tuple[int, list[int]]:
    """The turn's tokens as the fake server paces them, and per call (or action) the token
    at which it can start under `rule`: `end` (the message's last token), `complete` (its
    last argument fragment), or `action` (the token that completes its `</action>`). With
    `end_token`, the message's end is a token of its own after the last one."""
    if rule == "action":
        ends, at = [], 0
        while (at := turn.text.find("</action>", at)) >= 0:
            at += len("</action>")
            ends.append(chunks(at) - 1)
        return chunks(len(turn.text)) + turn.end_token, ends
    n, lasts = chunks(len(turn.text)), []
    for call in turn.tool_calls:  # its first fragment (id and name), then its arguments
        n += 1 + chunks(len(json.dumps(call["arguments"])))
        lasts.append(n - 1)
    n += turn.end_token
    return n, [n - 1] * len(lasts) if rule == "end" else lasts


def ideal(steps: Sequence[Step], script: Sequence[Turn], rule: str, ttft: float,
          tps: float) -> float:
    """The zero-overhead makespan: each turn's stream, then its tools' critical path."""
    total = 0.0
    for step, turn in zip(steps, script, strict=True):
        n, starts = triggers(turn, rule)
        tail = [ttft + t / tps + sec for t, (_, sec) in zip(starts, step.calls, strict=True)]
        total += max([ttft + (n - 1) / tps, *tail])
    return total


# --------------------------------------------------------------------------- running


@dataclass
class Job:
    """One job's raw record, for makespans and the breakdown."""

    submitted: float  # time.time()
    done: float
    model: str
    events: list[dict[str, Any]]
    lookups: dict[str, dict[str, Any]]  # call id -> what `lookup` returned
    ran: dict[str, tuple[float, float]]  # Cortex: call id -> the worker's (started, finished)


def run_cortex(stack: Stack, client: httpx.Client, agent: str, script: list[Turn],
               model: str) -> Job:
    from bench.agent import ended_ok, last

    assert stack.llm is not None
    stack.llm.script(model, script)
    body = {"agent": agent, "input": TASK, "options": {"model": model}}
    submitted = time.time()
    response = client.post(f"{stack.api_url}/v1/jobs", json=body)
    if response.status_code != 202:
        raise RuntimeError(f"submit failed: {response.status_code} {response.text[:500]}")
    job_id = response.json()["id"]
    events = stack.wait_job(job_id)
    ended_ok(events)
    ids = [e["data"]["action_id"] for e in events if e["type"] == "action_completed"]
    records = stack.store.results(job_id, ids)
    if len(records) != sum(len(t.tool_calls) or t.text.count("</action>") for t in script):
        raise RuntimeError(f"job {job_id}: lookups missing: {records}")
    return Job(submitted, last(events, "job_completed"), model, events,
               {a: r["value"] for a, r in records.items()},
               {a: (r["started_at"], r["finished_at"]) for a, r in records.items()})


@functools.cache
def _langgraph_http() -> httpx.Client:
    """One HTTP client for every LangGraph run, as a service keeps one: its connections to
    the model stay open between jobs, as a Cortex worker's do."""
    import httpx

    return httpx.Client(trust_env=False)


def run_langgraph(llm_url: str, script: list[Turn], model: str, llm: FakeLLM) -> Job:
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    llm.script(model, script)
    chat = ChatOpenAI(model=model, base_url=llm_url, api_key="unused", streaming=True,
                      max_retries=0, http_client=_langgraph_http())
    agent = create_react_agent(chat, [lookup.fn])
    submitted = time.time()
    state = agent.invoke({"messages": [("user", TASK)]})
    done = time.time()
    lookups = {m.tool_call_id: json.loads(m.content) for m in state["messages"]
               if m.type == "tool"}
    if "All" not in state["messages"][-1].content:
        raise RuntimeError(f"LangGraph ended with {state['messages'][-1]!r}")
    return Job(submitted, done, model, [], lookups, {})


# --------------------------------------------------------------------------- breakdown


def phases(job: Job, variant: str, steps: Sequence[Step], script: Sequence[Turn], rule: str,
           llm: FakeLLM, offset: float, ttft: float, tps: float,
           own_ideal: float) -> dict[str, float]:
    """The job's time over its own ideal, split along its critical path (seconds); names
    indented by two spaces split the row above them. The rows add up to "over ideal"."""
    from bench.agent import first, per_action

    received = [r["received_at"] + offset for r in llm.requests(job.model)]
    ticks = [[t + offset for t in times] for times in llm.token_times(job.model)]
    cortex = variant != "LangGraph"
    out: dict[str, float] = {"over ideal": job.done - job.submitted - own_ideal,
                             "submit -> model request": received[0] - job.submitted}
    if cortex:
        job_queued, job_started = (first(job.events, kind) for kind in ("job_queued",
                                                                         "job_started"))
        out["  submit -> job_queued"] = job_queued - job.submitted
        out["  job_queued -> job_started"] = job_started - job_queued
        out["  job_started -> model request"] = received[0] - job_started
    # On the critical path: each tool turn's stream up to the call that finished last, the
    # final turn's whole stream; the ideal has them at the server's exact pace.
    stream = ticks[-1][-1] - received[-1] - ttft - (triggers(script[-1], rule)[0] - 1) / tps
    shift = 0.0  # the ideal's critical path against the path the job took (<= 0)
    rows: dict[str, float] = {}
    parsed, queued, begun, completed = (
        per_action(job.events, kind)
        for kind in ("action_parsed", "action_queued", "action_started", "action_completed"))
    turn_started = [e["ts"] for e in job.events if e["type"] == "turn_started"]
    for k, (step, turn) in enumerate(zip(steps, script, strict=True)):
        if not step.calls:
            continue
        ids = [call_id(key) for key, _ in step.calls]
        critical = max(ids, key=lambda a: completed[a] if cortex else job.lookups[a]["ended"])
        n, starts = triggers(turn, rule)
        token = starts[ids.index(critical)]
        trigger = ticks[k][token]
        ran = job.lookups[critical]
        seconds = dict(step.calls)[ran["key"]]
        stream += trigger - received[k] - ttft - token / tps
        shift += ttft + token / tps + seconds - max(
            [ttft + (n - 1) / tps, *(ttft + t / tps + sec
                                     for t, (_, sec) in zip(starts, step.calls, strict=True))])
        if cortex:
            run_from, run_to = job.ran[critical]  # around the worker's run of the tool
            chain = {
                "trigger token -> action_parsed": parsed[critical] - trigger,
                "action_parsed -> action_started": begun[critical] - parsed[critical],
                "  action_parsed -> action_queued": queued[critical] - parsed[critical],
                "  action_queued -> action_started": begun[critical] - queued[critical],
                "action_started -> lookup runs (sandbox)": ran["started"] - begun[critical],
                "  action_started -> worker runs the tool": run_from - begun[critical],
                "  -> lookup runs (process, imports)": ran["started"] - run_from,
                "lookup runs over its sleep": ran["ended"] - ran["started"] - seconds,
                "lookup done -> action_completed": completed[critical] - ran["ended"],
                "  lookup done -> worker has the result": run_to - ran["ended"],
                "  -> action_completed (recorded)": completed[critical] - run_to,
                "action_completed -> next model request": received[k + 1] - completed[critical],
                "  action_completed -> turn_started": turn_started[k + 1] - completed[critical],
                "  turn_started -> model request": received[k + 1] - turn_started[k + 1],
            }
        else:
            chain = {
                "trigger token -> lookup runs": ran["started"] - trigger,
                "lookup runs over its sleep": ran["ended"] - ran["started"] - seconds,
                "lookup done -> next model request": received[k + 1] - ran["ended"],
            }
        for name, value in chain.items():
            rows[name] = rows.get(name, 0.0) + value
    out["model streams over their pace"] = stream
    out.update(rows)
    out["last token -> completed"] = job.done - ticks[-1][-1]
    out["critical-path shift"] = shift
    return out


# --------------------------------------------------------------------------- main


RULES = {"LangGraph": "end", "Cortex native": "complete", "Cortex protocol": "action"}


def measure(stack: Stack, client: httpx.Client, variant: str, steps: Sequence[Step],
            args: argparse.Namespace, tag: str) -> list[Job]:
    """`--jobs` jobs of `variant` at once, each with its own model name (its own script)."""
    from concurrent.futures import ThreadPoolExecutor

    assert stack.llm is not None
    llm = stack.llm
    script = turns(steps, variant == "Cortex protocol", args)
    models = [f"peers-{tag}-{n}" for n in range(args.jobs)]
    if variant == "LangGraph":
        def run(model: str) -> Job:
            return run_langgraph(llm.url, script, model, llm)
    else:
        agent = AGENTS["native" if variant == "Cortex native" else "protocol"]

        def run(model: str) -> Job:
            return run_cortex(stack, client, agent, script, model)
    with ThreadPoolExecutor(args.jobs) as pool:
        return list(pool.map(run, models))


def scaled(steps: Sequence[Step], scale: float) -> tuple[Step, ...]:
    return tuple(Step(s.text, tuple((k, round(sec * scale, 6)) for k, sec in s.calls))
                 for s in steps)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import tempfile
    import warnings
    from unittest import mock

    import httpx

    import bench.agent
    from bench.agent import loadavg, machine_ticks
    from bench.common import print_header, stop_on_sigterm

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=5, help="measured rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="rounds not counted (default 1)")
    parser.add_argument("--ttft", type=float, default=0.4,
                        help="seconds to the first token (default 0.4)")
    parser.add_argument("--tps", type=float, default=50.0,
                        help="tokens per second (default 50)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="jobs of a variant run at once (default 1)")
    parser.add_argument("--sleep-scale", type=float, default=1.0,
                        help="multiply the lookups' sleeps (default 1; quick runs: 0.1)")
    parser.add_argument("--end-token", action="store_true",
                        help="end each message a token after its last chunk, as an engine "
                             "does once the model writes its end-of-turn token (default: at "
                             "once)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.jobs < 1:
        parser.error("--runs and --jobs must be at least 1")

    stop_on_sigterm()
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # create_react_agent's
    workloads = {name: scaled(steps, args.sleep_scale) for name, steps in WORKLOADS.items()}
    print_header(f"load average {loadavg()}")
    print(f"model:    fake OpenAI-compatible server on 127.0.0.1, first token after "
          f"{args.ttft:g} s, then {args.tps:g} tokens/s (1 token = 1 chunk of {CHUNK_CHARS} "
          "characters, or a tool call's first fragment); a message ends "
          f"{'a token after its last chunk' if args.end_token else 'with its last chunk'}")
    tool_slots = 4 * args.jobs
    print(f"cortex:   tool pool x{tool_slots} (prefork), agent pool x{AGENT_THREADS} (threads); "
          f"{args.jobs} job(s) at once; {args.runs} measured round(s) after {args.warmup} "
          "warm-up round(s)")

    workdir = Path(tempfile.mkdtemp(prefix="cortex-bench-peers-"))
    manifests = workdir / "manifests"
    manifests.mkdir()
    (manifests / "agents.yaml").write_text(MANIFEST)
    (manifests / "tools.yaml").write_text(TOOL_MODULE)
    stack = bench.agent.Stack(workdir, listen_backlog=max(5, 8 * args.jobs))
    jobs: dict[tuple[str, str], list[list[Job]]] = {}
    t0 = time.monotonic()
    client = httpx.Client(trust_env=False, timeout=60)  # one connection to the API, kept
    try:
        print("  starting redis, fake model, workers, api ...", flush=True)
        # bench.agent's stack, on this benchmark's manifests directory.
        with mock.patch.object(bench.agent, "MANIFESTS_DIR", manifests):
            stack.start({"tool": tool_slots, "agent": AGENT_THREADS})
        print(f"  logs in {stack.log_dir}", flush=True)
        busy0 = machine_ticks()
        for r in range(args.warmup + args.runs):
            if r == args.warmup:
                busy0 = machine_ticks()
            for workload, steps in workloads.items():
                for variant in VARIANTS:
                    batch = measure(stack, client, variant, steps, args, f"{r}-{workload[0]}-"
                                    f"{variant.split()[-1].lower()}")
                    spans = [j.done - j.submitted for j in batch]
                    if r >= args.warmup:
                        jobs.setdefault((workload, variant), []).append(batch)
                    print(f"  {'round' if r >= args.warmup else 'warm-up'} "
                          f"{r + 1 - args.warmup if r >= args.warmup else r + 1}: "
                          f"{workload}, {variant}: {max(spans):.3f} s", flush=True)
        busy1 = machine_ticks()
        print(f"  machine CPU busy (all cores) during the measured rounds: "
              f"{(busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]):.0%}", flush=True)
        offset = time.time() - time.monotonic()
        assert stack.llm is not None
        report(jobs, workloads, stack.llm, offset, args)
    finally:
        print("  stopping everything ...", flush=True)
        client.close()
        stack.stop()
    print(f"total wall time: {time.monotonic() - t0:.1f} s; load average at the end: "
          f"{loadavg()}")
    return 0


def report(jobs: dict[tuple[str, str], list[list[Job]]], workloads: dict[str, tuple[Step, ...]],
           llm: FakeLLM, offset: float, args: argparse.Namespace) -> None:
    import statistics

    from bench.agent import table

    def ideal_of(steps: Sequence[Step], variant: str, rule: str) -> float:
        script = turns(steps, variant == "Cortex protocol", args)
        return ideal(steps, script, rule, args.ttft, args.tps)

    print(f"\nmakespan (s): median of {args.runs} round(s) [min-max]; a round's makespan is "
          f"the first submission to the last completion of its {args.jobs} job(s). Ideals "
          "(s): own = the variant's own dispatch rule, best = every call starting at its last "
          "argument fragment on the native stream. over = a job's latency - ideal (ms, "
          "median over jobs)")
    rows = [("workload", "variant", "makespan", "[min-max]", "own ideal", "over own",
             "best ideal", "over best", "vs LangGraph")]
    medians: dict[tuple[str, str], float] = {}
    for (workload, variant), rounds in jobs.items():
        steps = workloads[workload]
        spans = [max(j.done for j in b) - min(j.submitted for j in b) for b in rounds]
        latencies = [j.done - j.submitted for b in rounds for j in b]
        own = ideal_of(steps, variant, RULES[variant])
        best = ideal_of(steps, "LangGraph", "complete")
        medians[workload, variant] = statistics.median(spans)
        ratio = medians[workload, variant] / medians[workload, "LangGraph"]
        rows.append((workload, variant, f"{statistics.median(spans):.3f}",
                     f"[{min(spans):.3f}-{max(spans):.3f}]", f"{own:.3f}",
                     f"{(statistics.median(latencies) - own) * 1000:.0f}", f"{best:.3f}",
                     f"{(statistics.median(latencies) - best) * 1000:.0f}",
                     "" if variant == "LangGraph" else f"{ratio:.3f}x"))
    table(rows)

    print("\nwhere the time over the own ideal goes (ms, median over jobs; the rows add up "
          "to `over ideal` per job, the indented ones split the row above them):")
    breakdown: dict[tuple[str, str], dict[str, float]] = {}
    names: list[str] = []
    for (workload, variant), rounds in jobs.items():
        steps = workloads[workload]
        script = turns(steps, variant == "Cortex protocol", args)
        own = ideal_of(steps, variant, RULES[variant])
        split = [phases(j, variant, steps, script, RULES[variant], llm, offset, args.ttft,
                        args.tps, own) for b in rounds for j in b]
        breakdown[workload, variant] = {n: statistics.median(s[n] for s in split)
                                        for n in split[0]}
        for before, name in pairwise([None, *split[0]]):  # each after its predecessor
            if name not in names:
                names.insert(names.index(before) + 1 if before in names else len(names), name)
    columns = list(breakdown)
    rows = [("phase", *(f"{w.split()[0]} {v}" for w, v in columns))]
    for name in names:
        rows.append((name, *(f"{breakdown[c][name] * 1000:.1f}" if name in breakdown[c]
                             else "-" for c in columns)))
    table(rows)
    print("\nmakespans (s): " + "; ".join(
        f"{w.split()[0]} {v}: " + ", ".join(f"{max(j.done for j in b) - min(j.submitted for j in b):.3f}"
                                           for b in rounds)
        for (w, v), rounds in jobs.items()))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted; all processes stopped", file=sys.stderr)
        sys.exit(130)
