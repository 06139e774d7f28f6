"""AG-UI's reference client in the tests: `@ag-ui/client`'s `HttpAgent`, run by Node.

    report = run_client(url, thread_id="t1", steps=[Step("r1", messages=[user("hi")])])
    report.steps[0].events        # every AG-UI event the agent applied, after its verifier

`install()` puts the pinned `@ag-ui/client` into a cache outside the checkout
(`$XDG_CACHE_HOME/cortex/npm/ag-ui-client-<version>`, `~/.cache` by default) with npm, once per
version (a lock keeps concurrent installs apart; an install is moved into place whole), so a
fresh machine needs only Node and the npm registry. `tests/agui_client.mjs` runs the client:
one `HttpAgent`, one `runAgent` per step, its own verification on; what the client printed as
warnings (its enforcement strips fields AG-UI does not define) comes back too.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

#: The `@ag-ui/client` the tests run (its `@ag-ui/core` comes with it).
AGUI_CLIENT_VERSION = "1.0.0"
SCRIPT = Path(__file__).with_name("agui_client.mjs")
INSTALL_TIMEOUT_S = 600
RUN_TIMEOUT_S = 120


def cache_dir() -> Path:
    """Where the pinned client is installed: outside the checkout, shared by every clone."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "cortex" / "npm" / f"ag-ui-client-{AGUI_CLIENT_VERSION}"


def install() -> Path:
    """The installed client's directory (installed now if missing); skips the test without
    Node or npm."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("Node.js and npm are needed to run AG-UI's reference client")
    target = cache_dir()
    marker = target / "node_modules" / "@ag-ui" / "client" / "package.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file() and json.loads(marker.read_text())["version"] == AGUI_CLIENT_VERSION:
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            (staging / "package.json").write_text(json.dumps({
                "private": True, "dependencies": {"@ag-ui/client": AGUI_CLIENT_VERSION}}))
            done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--loglevel=error"],
                                  cwd=staging, capture_output=True, text=True,
                                  timeout=INSTALL_TIMEOUT_S)
            if done.returncode != 0:
                raise RuntimeError(f"npm install @ag-ui/client@{AGUI_CLIENT_VERSION} failed:\n"
                                   f"{done.stdout}{done.stderr}")
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def user(text: str) -> dict[str, Any]:
    """A user message, as an AG-UI client adds one."""
    return {"id": uuid.uuid4().hex, "role": "user", "content": text}


@dataclass
class Step:
    """One `runAgent` of the client: its run id, the messages added first, its tools, props,
    extra headers (`Last-Event-ID`), and `resume` (entries, or `{approved, reason}` for every
    pending interrupt, or `{status: "cancelled"}`)."""

    run_id: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    forwarded_props: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    resume: Any = None


@dataclass
class StepReport:
    run_id: str
    events: list[dict[str, Any]]
    result: Any = None
    new_messages: list[dict[str, Any]] = field(default_factory=list)
    pending_interrupts: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    def of(self, kind: str) -> list[dict[str, Any]]:
        """The events of one type."""
        return [event for event in self.events if event["type"] == kind]


@dataclass
class Report:
    steps: list[StepReport]
    warnings: list[str]
    messages: list[dict[str, Any]]


def run_client(url: str, *, thread_id: str, steps: list[Step],
               headers: dict[str, str] | None = None,
               messages: list[dict[str, Any]] | None = None) -> Report:
    """Run the steps with one HttpAgent on `url` (an agent's `/ag-ui` endpoint)."""
    module = install() / "package.json"
    plan = {"module": str(module), "url": url, "headers": headers or {}, "threadId": thread_id,
            "messages": messages or [],
            "steps": [{"runId": s.run_id, "messages": s.messages, "tools": s.tools,
                       "forwardedProps": s.forwarded_props, "headers": s.headers,
                       **({"resume": s.resume} if s.resume is not None else {})}
                      for s in steps]}
    done = subprocess.run(["node", str(SCRIPT)], input=json.dumps(plan), capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"the AG-UI client failed:\n{done.stdout}\n{done.stderr}"
    out = json.loads(done.stdout)
    return Report([StepReport(s["runId"], s["events"], s.get("result"),
                              s.get("newMessages") or [], s.get("pendingInterrupts") or [],
                              s.get("error")) for s in out["steps"]],
                  out["warnings"], out["messages"])
