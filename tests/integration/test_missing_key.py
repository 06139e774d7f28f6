"""The shipped `assistant` agent with no OpenAI key set, as a new user first runs it: the job
fails at once with a message that names the missing variable, and nothing is retried.

`cortex demo --agent assistant` is the subject: a private stack with the example manifests, the
job followed live, the job's own exit code. The provider is never asked (it is not reachable
from here either): before the fix the turn made four attempts at it and failed on the last.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MISSING = ("the model's API key is missing: environment variable OPENAI_API_KEY (api_key_env) "
           "is not set")


def test_the_assistant_without_its_key_fails_at_once_naming_the_variable(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CORTEX_", "CELERY_")) and k != "OPENAI_API_KEY"}
    env.update(CORTEX_MANIFESTS=str(REPO / "examples" / "manifests"),
               CORTEX_WORKSPACE_ROOT=str(tmp_path / "ws"), COLUMNS="200", PYTHONUNBUFFERED="1")
    out = subprocess.run([sys.executable, "-m", "cortex_api", "demo", "Say hello.",
                          "--agent", "assistant", "--log-dir", str(tmp_path / "logs")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    shown = " ".join(out.stdout.split())
    assert out.returncode == 1, out.stdout[-4000:] + out.stderr[-3000:]
    assert "job_failed" in shown and MISSING in shown, shown[-3000:]
    assert "attempt" not in shown  # a retried failure says "4 attempts made"
