"""`cortex demo` (what `make demo` runs) starts a private stack, runs the job, stops it all."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from cortex_worker.protocol.document import load_document

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
    print(f"demo took {took:.1f} s")


def test_ctrl_c_stops_the_demo_and_everything_it_started(tmp_path: Path) -> None:
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
        assert _processes_mentioning(str(logs))  # the stack is up
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130, "".join(lines)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=5)
    assert "interrupted; stopping" in "".join(lines)
    assert _gone(str(logs)) == []
