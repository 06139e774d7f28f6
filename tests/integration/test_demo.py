"""`cortex demo` (what `make demo` runs) starts a private stack, runs the job, stops it all.

Outside a terminal it stops the stack as soon as the job ends and says its links are dead; in
a terminal (tested through a pseudo-terminal) it keeps them up until Enter. Stop signals
mid-run stop everything too, a second one included.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from cortex_worker.protocol.document import load_document
from tests import harness

REPO = Path(__file__).resolve().parents[2]
TRANSCRIPT = REPO / "examples" / "transcripts" / "demo.yaml"


def _processes_mentioning(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CORTEX_", "CELERY_"))}
    env.update(CORTEX_MANIFESTS=str(REPO / "examples" / "manifests"),
               CORTEX_WORKSPACE_ROOT=str(tmp_path / "ws"), COLUMNS="120", PYTHONUNBUFFERED="1")
    return env


def _gone(marker: str, timeout: float = 10.0) -> list[int]:
    """The processes still mentioning `marker` once they had `timeout` seconds to go."""
    deadline = time.monotonic() + timeout
    while (left := _processes_mentioning(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _kill(demo: subprocess.Popen[Any]) -> None:
    """A failed test's demo and the stack it started are killed, not left to later tests."""
    if demo.poll() is None:
        stack = harness.process_tree(demo.pid)
        demo.kill()
        demo.wait()
        for pid in harness.left_behind(stack):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_demo_transcript_turns_are_valid_and_act_in_parallel() -> None:
    turns = yaml.safe_load(TRANSCRIPT.read_text(encoding="utf-8"))["turns"]
    assert len(turns) == 2
    docs = [load_document(turn) for turn in turns]
    assert all(doc.ok for doc in docs), [doc.errors for doc in docs]
    first = docs[0].to_json()["actions"]
    assert sum(1 for a in first if a["mode"] == "async" and a["in_thought"]) >= 8
    assert {a["name"] for a in first} >= {"load_docs", "python", "calculator", "grep", "kv.set"}
    assert [r["final"] for r in docs[1].responses] == [True]
    agents = yaml.safe_load((REPO / "examples" / "manifests" / "agents.yaml").read_text())["agents"]
    demo = next(a for a in agents if a["name"] == "demo")
    assert demo["relics"] == ["kv"] and demo["model"]["transcript"].endswith("demo.yaml")
    assert any(a["name"] == "researcher" for a in agents)


def test_demo_runs_the_agent_job_and_leaves_nothing_running(tmp_path: Path) -> None:
    logs = tmp_path / "demo-logs"
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "cortex_api", "demo", "--log-dir", str(logs)],
                         cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=240)
    took = time.monotonic() - started
    text = out.stdout
    assert out.returncode == 0, text[-4000:] + out.stderr[-3000:]
    assert "job_completed" in text
    assert re.search(r"/jobs/[0-9a-f]{32}\b", text)  # the job page
    flat = " ".join(text.split())  # the answer is wrapped to the terminal's width
    # Figures computed by the tools (none is written in the transcript):
    words = sum(len(p.read_text(encoding="utf-8").split())
                for p in (REPO / "examples" / "docs").glob("*.md"))
    assert f"{words} words" in flat                        # load_docs
    assert "9.14×" in flat and "15.25×" in flat            # calculator
    assert "8.69×" in flat and "171 workers" in flat       # python: the Amdahl simulation
    assert "10.81 s" in flat and "86.6%" in flat           # python: the agent simulation
    assert "19.7" in flat and "26.6" in flat               # python: readability bootstrap
    assert "docs/amdahl.md, line 9" in flat                # grep
    # The kv relic was written, then read back in turn 2:
    assert re.search(r"✓ save \(relic kv\.set\) ok in", text)
    assert "(found: true)" in flat
    # The view: thought lines, action lines, the table, the timeline and the speedup
    assert "│ The question asks what limits the speedup" in text
    assert re.search(r"▶ sim \(tool python\) started", text)
    assert re.search(r"^timeline\s+0 s\s+[\d.]+ s$", text, re.MULTILINE)
    assert re.search(r"^sim\s+python\s+▕[ ◆·█]+▏ [\d.]+ s", text, re.MULTILINE)
    assert re.search(r"^parallel speedup \d+\.\d\d×: 11 actions ran", text, re.MULTILINE)
    assert "thinking while acting" in text
    assert {p.stem for p in logs.glob("*.log")} >= {"redis", "api", "worker-agent", "worker-tool",
                                                    "worker-relic", "worker-llm"}
    assert _gone(str(logs)) == []  # its Redis (by --dir) is gone too
    # Not in a terminal: no links offered once their servers are down, and no waiting.
    closing = flat[flat.index("thinking while acting"):]
    assert "the links above no longer answer" in closing
    assert "http" not in closing and "press Enter" not in flat
    print(f"demo took {took:.1f} s")


def test_a_stop_signal_mid_run_stops_the_demo_and_everything_it_started(tmp_path: Path) -> None:
    """SIGTERM while the job runs, then Ctrl-C while the stack stops: the second signal hurries
    the stop instead of cutting it short. The exit code is the first signal's, 128 + 15."""
    logs = tmp_path / "demo-logs"
    proc = subprocess.Popen([sys.executable, "-m", "cortex_api", "demo", "--log-dir", str(logs)],
                            cwd=REPO, env=_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),  # type: ignore[union-attr]
                              daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any("▶ docs" in line for line in lines):  # the job runs its first action
            assert proc.poll() is None, "".join(lines)[-3000:]
            assert time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.1)
        stack = harness.process_tree(proc.pid)
        assert len(stack) >= 6, stack  # Redis, four workers, the API, Flower
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM, "".join(lines)[-3000:]
    finally:
        _kill(proc)
    reader.join(timeout=5)
    assert "interrupted (SIGTERM); stopping" in "".join(lines)
    assert harness.left_behind(stack, timeout=5) == []
    assert _gone(str(logs)) == []


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_in_a_terminal_the_demo_keeps_its_links_up_until_enter(tmp_path: Path) -> None:
    """`make demo` in a terminal: after the job the links it prints answer, and Enter stops
    everything (exit 0: the job completed)."""
    logs = tmp_path / "demo-logs"
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "cortex_api", "demo", "--log-dir", str(logs)],
                            cwd=REPO, env={**_env(tmp_path), "TERM": "xterm-256color"},
                            stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    output = bytearray()

    def read() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every end of the terminal is closed
                return
            if not chunk:
                return
            output.extend(chunk)

    def text() -> str:
        return ANSI.sub("", output.decode(errors="replace"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while "press Enter" not in text():
            assert proc.poll() is None, text()[-3000:]
            assert time.monotonic() < deadline, text()[-3000:]
            time.sleep(0.1)
        shown = text()
        assert "job_completed" in shown
        page = re.search(r"job page +(http://127\.0\.0\.1:\d+/jobs/[0-9a-f]{32})\s", shown)
        flower = re.search(r"Flower +(http://127\.0\.0\.1:\d+)\s", shown)
        assert page and flower, shown[-3000:]
        stack = harness.process_tree(proc.pid)
        time.sleep(1)
        assert proc.poll() is None  # waiting for Enter, the stack up
        assert httpx.get(page[1], timeout=5).status_code == 200
        assert httpx.get(f"{flower[1]}/healthcheck", timeout=5).status_code == 200
        os.write(master, b"\n")
        assert proc.wait(timeout=60) == 0, text()[-3000:]
    finally:
        _kill(proc)
        reader.join(timeout=5)
        os.close(master)
    assert harness.left_behind(stack, timeout=5) == []
    assert _gone(str(logs)) == []
    with pytest.raises(httpx.ConnectError):  # the links were live until Enter, not after
        httpx.get(page[1], timeout=2)
