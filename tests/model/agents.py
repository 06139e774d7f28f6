"""Agent jobs on the real model: the agents, the tasks, and what each job did.

Two agents differ only in `model.grammar`: `smol` (gbnf: llama.cpp constrains decoding with
the protocol grammar of its manifest) and `smol_plain` (no grammar). Both may use the tools
echo and calculator (the built-in ones tests/manifests gives its agents too). A job runs in
this process (`StubBroker`, as tests/engine does): each turn streams from llama.cpp's server
through the gateway into the coordinator's parser, its actions run here, then the next turn.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

from cortex_worker.handles import get_registry
from cortex_worker.jobs import lifecycle as jobs
from cortex_worker.llm.grammar import agent_targets
from cortex_worker.store.state import Store
from cortex_worker.testing import StubBroker

MAX_TOKENS = 1024
ARITHMETIC_TOKENS = 256  # an action and a short answer: the turn that acts ends at its action
MAX_TURNS = 2
TEMPERATURE = 0.7
SEED = 1125
"""Sent with every request (`model.seed`): llama.cpp's server would otherwise seed a request
from the one before, so what a job samples, and how long it writes, would hang on which jobs
and tests the same server ran first."""

AGENTS_YAML = f"""\
# Agents of the real-model tests (tests/model): SmolLM2-135M-Instruct on llama.cpp's server,
# whose URL is ${{CORTEX_SMOLLM_URL}} (read when a request is made).
agents:
  - name: smol
    description: A small self-hosted model held to the protocol by a grammar.
    model: &model
      provider: openai
      base_url: ${{CORTEX_SMOLLM_URL}}
      model: smollm2-135m-instruct
      api_key_env: null
      grammar: gbnf
      max_tokens: {MAX_TOKENS}
      temperature: {TEMPERATURE}
      seed: {SEED}
      max_retries: 1
    tools: [echo, calculator]
    max_turns: {MAX_TURNS}
  - name: smol_plain
    description: The same small model without a grammar.
    model:
      <<: *model
      grammar: null
    tools: [echo, calculator]
    max_turns: {MAX_TURNS}
  - name: smol_must_act
    description: The small model at temperature 0, told to act (tool_choice required).
    model:
      <<: *model
      temperature: 0
      max_tokens: {ARITHMETIC_TOKENS}
      tool_choice: required
    tools: [calculator]
    max_turns: {MAX_TURNS}
"""

TASKS = [
    "What is 17 * 23?",
    "Echo the word banana.",
    "Compute the square root of 144.",
    "Say hello to Ada with the echo tool.",
    "Add 1234 and 4321.",
    "What is 2 to the power of 10?",
    "Repeat back: the sky is blue.",
    "Divide 144 by 12.",
    "What is 15 percent of 80?",
    "Calculate (3 + 4) * 5.",
    "What is the cosine of 0?",
    "Send the message ping through echo.",
    "How much is 99 minus 57?",
    "Compute 7*6*5*4*3*2*1.",
    "What is 3.5 times 4?",
    "Echo the number 42.",
    "Is 91 divisible by 7? Use the calculator.",
    "What is 1000 / 8?",
    "Round 2.567 to two decimals.",
    "Echo the phrase all done.",
    "What is 12 squared?",
    "Subtract 19 from 100.",
]
"""22 tasks: one job each."""

ARITHMETIC = [f"Use the calculator: what is {a} * {b}?"
              for a, b in ((17, 23), (46, 5), (12, 12), (9, 81), (123, 4), (7, 77), (31, 3),
                           (64, 8), (15, 15), (250, 4))]
"""Ten arithmetic questions that say to use the calculator (issue 33's tool_choice check)."""


def write_manifests(directory: Path, seed: int = SEED) -> Path:
    """`AGENTS_YAML` in `directory`, its agents sending `seed` with every request."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "agents.yaml").write_text(AGENTS_YAML.replace(f"seed: {SEED}\n",
                                                               f"seed: {seed}\n"))
    return directory


@dataclass
class JobReport:
    """What one agent job did, read from its event log."""

    task: str
    status: str = ""
    error: str | None = None
    seconds: float = 0.0
    turns: int = 0
    idle_turns: int = 0
    """Turns that neither started an action nor gave a final response."""
    protocol_errors: list[str] = field(default_factory=list)
    """Each as "kind: message"."""
    actions: list[dict[str, Any]] = field(default_factory=list)
    invalid_actions: list[str] = field(default_factory=list)
    """Actions naming no tool of the agent, or whose parameters its schema refuses."""
    failed_actions: int = 0
    final: bool = False
    text: list[str] = field(default_factory=list)
    """What the model wrote, turn by turn (the conversation's assistant messages)."""


def run_job(store: Store, broker: StubBroker, agent: str, task: str) -> JobReport:
    """Submit one agent job, run it to its end here, and report on it."""
    report = JobReport(task=task)
    started = time.monotonic()
    job_id = jobs.submit_agent(store, agent, task)
    broker.join()
    report.seconds = round(time.monotonic() - started, 2)
    spec = get_registry().agent(agent)
    schemas = {(t.type, t.name): t.parameters for t in agent_targets(spec, get_registry())}
    acted = False
    for event in store.events_after(job_id):
        kind, data = event["type"], event["data"]
        if kind == "turn_started":
            if report.turns and not acted:
                report.idle_turns += 1
            report.turns, acted = report.turns + 1, False
        elif kind == "protocol_error":
            report.protocol_errors.append(f"{data['kind']}: {data.get('message', '')}")
        elif kind == "action_parsed":
            acted = True
            action = data["action"]
            report.actions.append({k: action[k] for k in ("type", "mode", "name", "parameters")})
            schema = schemas.get((action["type"], action["name"]))
            if schema is None:
                report.invalid_actions.append(f"{action['type']} {action['name']!r} is not one "
                                              "of the agent's")
            else:
                problems = sorted(Draft202012Validator(dict(schema)).iter_errors(
                    action["parameters"]), key=str)
                if problems:
                    report.invalid_actions.append(
                        f"{action['name']} {action['parameters']!r}: {problems[0].message}")
        elif kind == "action_failed":
            report.failed_actions += 1
        elif kind == "response_end" and data.get("final"):
            acted = report.final = True
        elif kind in ("job_completed", "job_failed", "job_cancelled"):
            report.status, report.error = data["status"], data.get("error")
    if report.turns and not acted:
        report.idle_turns += 1
    report.text = [m.get("content") or "" for m in store.conversation(job_id)
                   if m.get("role") == "assistant"]
    return report


def run_jobs(store: Store, broker: StubBroker, agent: str,
             tasks: Iterable[str] = TASKS) -> list[JobReport]:
    return [run_job(store, broker, agent, task) for task in tasks]


def summary(reports: list[JobReport]) -> dict[str, Any]:
    """The figures docs/performance.md reports for one agent."""
    actions = [a for r in reports for a in r.actions]
    return {
        "jobs": len(reports),
        "completed": sum(r.status == "completed" for r in reports),
        "failed": sum(r.status == "failed" for r in reports),
        "turns": sum(r.turns for r in reports),
        "protocol_errors": sum(len(r.protocol_errors) for r in reports),
        "jobs_with_protocol_errors": sum(bool(r.protocol_errors) for r in reports),
        "error_kinds": sorted({e.split(":")[0] for r in reports for e in r.protocol_errors}),
        "idle_turns": sum(r.idle_turns for r in reports),
        "actions": len(actions),
        "invalid_actions": sum(len(r.invalid_actions) for r in reports),
        "failed_actions": sum(r.failed_actions for r in reports),
        "final_responses": sum(r.final for r in reports),
        "seconds": round(sum(r.seconds for r in reports), 1),
    }
