"""The `python` built-in on the warm runner (cortex_worker/sandbox/snippet.py through
cortex_worker/sandbox/warm.py): each call forked from a zygote, sharing nothing with the
last, under the same limits, with its attempt in its environment; cold, and saying so, where
no zygote can serve. Real sandboxed processes; in namespaces where the kernel allows them."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cortex_worker.sandbox import isolation, warm
from cortex_worker.settings import Settings
from cortex_worker.tools import builtin
from cortex_worker.tools.context import ToolContext
from cortex_worker.tools.errors import ToolError, ToolTimeout
from cortex_worker.tools.spec import Limits

pytestmark = pytest.mark.process

SNIPPET_MODULE = "cortex_worker.sandbox.snippet"
WHERE = "import __main__\n__main__.__spec__.name"
"""The program the call's process runs as `__main__`: the zygote's when it was forked from
one, the runner's when it started cold."""
MODES = ["off", pytest.param("required", marks=pytest.mark.skipif(
    isolation.unavailable_reason() is not None,
    reason=f"namespaces unavailable here: {isolation.unavailable_reason()}"))]


@pytest.fixture(params=MODES)
def ctx(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ToolContext]:
    """A context without namespaces, and one in them where the kernel allows it."""
    root = tmp_path / "workspaces"
    root.mkdir()
    root.chmod(0o755)  # the sandbox user reaches the workspace through it
    settings = Settings(workspace_root=root, http_allow_hosts=[],
                        sandbox_isolation=request.param)
    yield ToolContext.for_job(settings, "job-1", "act-1", timeout=20)


def snippet(code: str, ctx: ToolContext) -> Any:
    return builtin.python({"code": code}, ctx)["result"]


def calls_of_the_snippet_zygote() -> int:
    served = [z.calls for key, z in warm._zygotes.items() if key[0][-1] == SNIPPET_MODULE]
    return served[0] if served else 0


def test_each_call_is_forked_from_the_snippet_zygote(ctx: ToolContext) -> None:
    snippet("1", ctx)  # the zygote started, and may have been retired by another test's call
    before = calls_of_the_snippet_zygote()
    assert snippet(WHERE, ctx) == "cortex_worker.sandbox.zygote"
    assert snippet(WHERE, ctx) == "cortex_worker.sandbox.zygote"
    assert calls_of_the_snippet_zygote() == before + 2
    assert not any(key[0][-1] == SNIPPET_MODULE for key in warm._cold)


def test_two_calls_share_nothing(ctx: ToolContext) -> None:
    snippet("import builtins, json, sys\nimport cortex_worker.sandbox.snippet as s\n"
            "builtins.LEAKED = json.LEAKED = 1\ns.MAX_STDOUT = 3\nsys.path.append('/leaked')\n"
            "open('kept.txt', 'w').write('kept in the workspace')\nX = 1", ctx)
    seen = snippet("import builtins, json, sys\nimport cortex_worker.sandbox.snippet as s\n"
                   "print('a' * 10)\n"
                   "[hasattr(builtins, 'LEAKED'), hasattr(json, 'LEAKED'), s.MAX_STDOUT,"
                   " '/leaked' in sys.path, 'X' in globals(), open('kept.txt').read()]", ctx)
    assert seen == [False, False, 1024 * 1024, False, False, "kept in the workspace"]


def test_the_snippet_sees_its_own_attempt_and_ps_shows_it(ctx: ToolContext) -> None:
    """In its environment, and in its /proc/PID/environ, which `ps e` and whoever looks for an
    attempt's process read (tests/chaos/test_pauses.py): the call's, not its zygote's."""
    code = ("import os\nfrom cortex_worker.tools.attempt import ENV, current\n"
            "a = current()\nshown = open('/proc/self/environ').read().split('\\0')\n"
            "[[os.environ[name] for name in ENV], a.attempt, a.idempotency_key,\n"
            " sorted(v for v in shown if v.startswith('CORTEX_'))]")
    for attempt in (1, 3):  # one zygote for both: the attempt is each call's own
        again = ToolContext(ctx.job_id, ctx.action_id, ctx.workspace, ctx.timeout,
                            ctx.settings, attempt=attempt)
        assert snippet(code, again) == [
            ["job-1", "act-1", str(attempt), "job-1:act-1"], attempt, "job-1:act-1",
            ["CORTEX_ACTION_ID=act-1", f"CORTEX_ATTEMPT={attempt}",
             "CORTEX_IDEMPOTENCY_KEY=job-1:act-1", "CORTEX_JOB_ID=job-1"]]


def test_limits_apply_and_a_killed_call_retires_its_zygote(
        ctx: ToolContext, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ToolError, match=r"^MemoryError"):  # RLIMIT_AS: 512 MB
        snippet("hog = []\nwhile True:\n    hog.append(bytearray(64 * 1024**2))", ctx)
    short = ToolContext(ctx.job_id, ctx.action_id, ctx.workspace, 0.5, ctx.settings)
    zygotes = {id(z) for key, z in warm._zygotes.items() if key[0][-1] == SNIPPET_MODULE}
    with pytest.raises(ToolTimeout, match=r"^timed out after 0\.5s$"):
        snippet("while True:\n    pass", short)
    assert not zygotes & {id(z) for z in warm._zygotes.values()}  # a killed call's is retired
    monkeypatch.setattr(builtin, "PYTHON_LIMITS", Limits(cpu_seconds=1))
    with pytest.raises(ToolError, match="it used up its CPU time limit"):
        snippet("while True:\n    pass", ctx)
    assert snippet(WHERE, ctx) == "cortex_worker.sandbox.zygote"  # a fresh zygote serves


def test_output_is_capped(ctx: ToolContext) -> None:
    out = builtin.python({"code": "print('x' * (2 * 1024 * 1024))"}, ctx)["stdout"]
    assert out.startswith("x" * 1024 * 1024)
    assert out.endswith("\n[... 1048577 more characters not kept]")
    with pytest.raises(ToolError, match=r"^the tool wrote more than 8388608 bytes to stdout$"):
        snippet("import os\nos.write(1, b'x' * (9 * 1024 * 1024))", ctx)


@pytest.mark.parametrize("code, message", [
    ("{}['missing']", "KeyError: 'missing'"),
    ("def f(:", "SyntaxError: invalid syntax (line 1)"),
    ("import sys\nsys.exit(3)", "SystemExit: 3"),
    ("import os\nos._exit(3)",
     "the tool process exited with status 3 without a result: no error output"),
    ("raise KeyboardInterrupt", "the tool process was stopped: it was killed by SIGINT"),
])
def test_errors_read_as_they_did_cold(ctx: ToolContext, code: str, message: str) -> None:
    with pytest.raises(ToolError) as info:
        snippet(code, ctx)
    assert str(info.value) == message


def test_without_pidfds_it_runs_cold_and_says_so(
        ctx: ToolContext, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(warm, "pidfds", lambda: False)
    monkeypatch.setattr(warm, "_cold", {})  # the reason is kept per command: not for later tests
    with caplog.at_level(logging.WARNING, logger=warm.__name__):
        assert snippet(WHERE, ctx) == "cortex_worker.sandbox.function_main"
        assert builtin.python({"code": "print('hi')\n6 * 7"}, ctx) == {"stdout": "hi\n",
                                                                       "result": 42}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"python tool {SNIPPET_MODULE} runs cold (a new interpreter per call): "
                        "this kernel has no pidfds (Linux 5.3 or later)"]
