"""`cortex exec` follows a document over the wire.

That a redelivered task does not run its action again (at-least-once delivery, exactly-once
results) is tested in-process, in tests/engine/test_exactly_once.py; a delivery after a
worker was killed is tested in tests/chaos."""

from __future__ import annotations

from typing import Any

from tests import harness
from tests.integration.test_documents import action


def test_cortex_exec_follows_a_document(workers: Any, api: Any, cortex_env: dict[str, str],
                                        tmp_path: Any) -> None:
    import subprocess

    path = tmp_path / "doc.xml"
    path.write_text(action("a", "sleep", {"seconds": 0.2}) + action("b", "sleep", {"seconds": 0.2})
                    + "<response>done: $a</response>")
    out = subprocess.run([*harness.cortex_command(), "exec", str(path), "--url", api.url],
                         env={**cortex_env, "COLUMNS": "120"}, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "job_completed" in out.stdout
    assert 'done: {"slept": 0.2}' in out.stdout
    assert "parallel speedup" in out.stdout and "2 actions" in out.stdout
