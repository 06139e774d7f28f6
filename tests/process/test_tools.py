"""Built-in tools and the tool runtime (cortex_worker.tools), with real sandboxed subprocesses."""

from __future__ import annotations

import http.server
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cortex_worker.manifests.loader import Registry, load_registry
from cortex_worker.sandbox.process import live_groups
from cortex_worker.settings import Settings
from cortex_worker.tools import calculator
from cortex_worker.tools import http as http_tool
from cortex_worker.tools.calculator import evaluate
from cortex_worker.tools.context import ToolContext, workspace_for
from cortex_worker.tools.errors import ToolError, ToolTimeout
from cortex_worker.tools.runtime import builtin_function, run_tool
from cortex_worker.tools.spec import (
    BUILTIN_TOOLS,
    ToolSpec,
    queue_for,
    render_argv,
    validate_parameters,
)

pytestmark = pytest.mark.process

REPO_ROOT = Path(__file__).resolve().parents[2]
TEST_MANIFESTS = REPO_ROOT / "tests" / "manifests"


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(workspace_root=tmp_path / "workspaces", http_allow_hosts=[])


@pytest.fixture
def ctx(settings: Settings) -> ToolContext:
    return ToolContext.for_job(settings, "job-1", "act-1", timeout=10)


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_registry(TEST_MANIFESTS)


def call(
    name: str, params: dict[str, Any], ctx: ToolContext, registry: Registry | None = None
) -> Any:
    reg = registry or load_registry(None)
    return run_tool(reg.tool(name), params, ctx, reg.module_paths)


# ---------------------------------------------------------------- context


def test_workspace_for_creates_the_job_directory(settings: Settings) -> None:
    path = workspace_for(settings, "abc_DEF-1")
    assert path.is_dir() and path == (settings.workspace_root / "abc_DEF-1").resolve()
    for bad in ("../etc", "a/b", "", "x y"):
        with pytest.raises(ValueError, match="invalid job id"):
            workspace_for(settings, bad)


# ---------------------------------------------------------------- echo, sleep, calculator


def test_echo(ctx: ToolContext) -> None:
    assert call("echo", {"message": {"a": [1]}}, ctx) == {"a": [1]}
    assert call("echo", {"x": 1, "y": "z"}, ctx) == {"x": 1, "y": "z"}
    with pytest.raises(ToolError, match="parameters must be an object"):
        call("echo", ["not", "an", "object"], ctx)  # type: ignore[arg-type]


def test_sleep(ctx: ToolContext) -> None:
    assert call("sleep", {"seconds": 0.01}, ctx) == {"slept": 0.01}
    short = ToolContext(ctx.job_id, ctx.action_id, ctx.workspace, 0.05, ctx.settings)
    # the timeout ended it, not the 30 s sleep: `sleep` sleeps the timeout, then says so
    with pytest.raises(ToolTimeout, match=r"^timed out after 0\.05s \(asked to sleep 30s\)$"):
        call("sleep", {"seconds": 30}, short)
    with pytest.raises(ToolError, match="parameter 'seconds': -1 is less than the minimum of 0"):
        call("sleep", {"seconds": -1}, ctx)
    with pytest.raises(ToolError, match="'seconds' is a required property"):
        call("sleep", {}, ctx)


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("42 + 8", 50),
        ("2 ** 10 - 1", 1023),
        ("-(3 + 4) * 2", -14),
        ("7 // 2 + 7 % 2", 4),
        ("1 / 4", 0.25),
        ("sqrt(16) + abs(-2) + round(2.6) + min(4, 5) + max(1, 2)", 15),
        ("round(cos(0) + sin(0) + log(e), 6)", 2.0),
        ("round(pi, 2)", 3.14),
    ],
)
def test_calculator_evaluates(expression: str, value: float, ctx: ToolContext) -> None:
    assert call("calculator", {"expression": expression}, ctx) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os')", "unknown function '__import__'"),
        ("9**9**9", "exponent too large"),
        ("2 ** 100000", "exponent too large"),
        ("(10**1000) * (10**1000) * (10**1000) * (10**1000) * (10**1000)", "result too large"),
        ("1 / 0", "division by zero"),
        ("x + 1", "unknown name 'x'"),
        ("math.sqrt(4)", "unknown function 'math.sqrt'"),
        ("(1).__class__", "not allowed in an expression"),
        ("'a' * 3", "only numbers are allowed"),
        ("[1, 2]", "not allowed in an expression"),
        ("lambda: 1", "not allowed"),
        ("1 +", "invalid expression"),
        ("1e308 * 10", "not a finite number"),
        ("(-8) ** 0.5", "complex"),
        ("1" * 1001, "expression too long"),
    ],
)
def test_calculator_refuses(expression: str, message: str) -> None:
    with pytest.raises(ToolError, match=message.replace("(", r"\(").replace(".", r"\.")):
        evaluate(expression)


def test_calculator_parameter_type_error(ctx: ToolContext) -> None:
    with pytest.raises(ToolError) as info:
        call("calculator", {"expression": 5}, ctx)
    assert str(info.value) == "parameter 'expression': 5 is not of type 'string'"


# ---------------------------------------------------------------- python


def test_python_snippet(ctx: ToolContext, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORTEX_SECRET_TOKEN", "hunter2")
    out = call(
        "python",
        {
            "code": "import os\nprint('hello')\nopen('made.txt', 'w').write('x')\n"
            "(os.getcwd(), os.environ.get('CORTEX_SECRET_TOKEN'), 6 * 7)"
        },
        ctx,
    )
    assert out == {"stdout": "hello\n", "result": [str(ctx.workspace), None, 42]}
    assert (ctx.workspace / "made.txt").read_text() == "x"
    assert call("python", {"code": "{1, 2}"}, ctx)["result"] == "{1, 2}"  # not JSON: repr
    assert call("python", {"code": "x = 1"}, ctx)["result"] is None


def test_python_snippet_errors(ctx: ToolContext) -> None:
    with pytest.raises(ToolError) as info:
        call("python", {"code": "print('before')\n{}['missing']"}, ctx)
    assert str(info.value) == "KeyError: 'missing'"
    assert info.value.detail and "Traceback" in info.value.detail
    with pytest.raises(ToolError, match=r"SyntaxError: .* \(line 1\)"):
        call("python", {"code": "def f(:"}, ctx)
    short = ToolContext(ctx.job_id, ctx.action_id, ctx.workspace, 0.5, ctx.settings)
    with pytest.raises(ToolTimeout, match=r"timed out after 0\.5s"):
        call("python", {"code": "import time\ntime.sleep(30)"}, short)
    with pytest.raises(ToolError, match="MemoryError"):
        call("python", {"code": "bytearray(4 * 1024**3)"}, ctx)


# ---------------------------------------------------------------- http_get


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/redirect":
            self._send(302, b"", location="/hello")
        elif self.path == "/elsewhere":
            self._send(302, b"", location="http://10.0.0.1/hello")
        elif self.path == "/big":
            self._send(200, b"x" * 100_000)
        else:
            self._send(200, f"hello {self.headers.get('X-Test', '')}".encode())

    def _send(self, status: int, body: bytes, location: str | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Internal", "not kept")
        if location:
            self.send_header("Location", location)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_http_get_loopback(server: str, ctx: ToolContext) -> None:
    out = call("http_get", {"url": f"{server}/hello", "headers": {"X-Test": "abc"}}, ctx)
    assert out["status"] == 200 and out["text"] == "hello abc" and not out["truncated"]
    assert (
        out["headers"]["content-type"].startswith("text/plain")
        and "x-internal" not in out["headers"]
    )
    big = call("http_get", {"url": f"{server}/big", "max_bytes": 1000}, ctx)
    assert big["text"] == "x" * 1000 and big["truncated"]
    port = server.rsplit(":", 1)[1]
    assert call("http_get", {"url": f"http://localhost:{port}/x"}, ctx)["status"] == 200


def test_http_get_redirects(server: str, ctx: ToolContext) -> None:
    out = call("http_get", {"url": f"{server}/redirect"}, ctx)
    assert out["status"] == 200 and out["url"].endswith("/hello")
    with pytest.raises(ToolError, match=r"redirects to http://10\.0\.0\.1/hello, another host"):
        call("http_get", {"url": f"{server}/elsewhere"}, ctx)


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to resolve or connect fails the test."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"network used: {args!r}")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(httpx.Client, "send", refuse)


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://10.0.0.1/", "host '10.0.0.1' is not allowed"),
        ("http://169.254.169.254/latest/meta-data", "host '169.254.169.254' is not allowed"),
        ("https://example.com/", "host 'example.com' is not allowed"),
        ("http://[fe80::1]/", "is not allowed"),
        ("ftp://127.0.0.1/", "only http and https"),
        ("file:///etc/passwd", "only http and https"),
    ],
)
def test_http_get_refuses_before_connecting(url: str, message: str, ctx: ToolContext) -> None:
    with pytest.raises(ToolError, match=message):
        call("http_get", {"url": url}, ctx)


def test_http_get_refuses_loopback_names_resolving_elsewhere(
    ctx: ToolContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", 80))]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: fake)
    monkeypatch.setattr(httpx.Client, "send", lambda *a, **k: pytest.fail("connected"))
    with pytest.raises(
        ToolError, match=r"resolves to 10\.0\.0\.1, which is not a loopback address"
    ):
        call("http_get", {"url": "http://localhost/"}, ctx)


@pytest.mark.usefixtures("no_network")
def test_http_allow_list() -> None:
    allow = ["api.example.com", ".corp.example", "*.svc.local"]
    for host in (
        "api.example.com",
        "API.example.com",
        "corp.example",
        "a.b.corp.example",
        "x.svc.local",
    ):
        http_tool.check_host(httpx.URL(f"https://{host}/"), allow)
    for host in ("example.com", "evilcorp.example", "svc.local.evil.com"):
        with pytest.raises(ToolError, match="not allowed"):
            http_tool.check_host(httpx.URL(f"https://{host}/"), allow)


# ---------------------------------------------------------------- workspace files


def test_write_read_roundtrip(ctx: ToolContext) -> None:
    assert call("write_file", {"path": "notes/a.txt", "content": "héllo\n"}, ctx) == {
        "path": "notes/a.txt",
        "bytes": 7,
        "appended": False,
    }
    call("write_file", {"path": "notes/a.txt", "content": "more\n", "append": True}, ctx)
    out = call("read_file", {"path": "notes/./a.txt"}, ctx)
    assert out == {
        "path": "notes/a.txt",
        "content": "héllo\nmore\n",
        "size": 12,
        "truncated": False,
    }
    part = call("read_file", {"path": "notes/a.txt", "max_bytes": 3}, ctx)
    assert part["content"] == "hé" and part["truncated"]
    assert call("read_file", {"path": "notes/../notes/a.txt"}, ctx)["size"] == 12
    with pytest.raises(ToolError, match=r"no file 'nope\.txt'"):
        call("read_file", {"path": "nope.txt"}, ctx)
    with pytest.raises(ToolError, match="'notes' is not a regular file"):
        call("read_file", {"path": "notes"}, ctx)


@pytest.mark.parametrize("tool", ["read_file", "write_file"])
def test_files_stay_in_the_workspace(tool: str, ctx: ToolContext, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    os.symlink(outside, ctx.workspace / "link")
    os.symlink(outside / "secret.txt", ctx.workspace / "secret-link.txt")
    extra = {"content": "x"} if tool == "write_file" else {}
    cases = {
        "../x": "escapes the workspace \\(with '..'\\)",
        "a/../../x": "escapes the workspace",
        "/etc/passwd": "is absolute",
        "~/x": "is absolute",
        "link/secret.txt": "escapes the workspace \\(through a symlink\\)",
        "secret-link.txt": "through a symlink",
    }
    for path, message in cases.items():
        with pytest.raises(ToolError, match=message):
            call(tool, {"path": path, **extra}, ctx)
    assert (outside / "secret.txt").read_text() == "secret"


def test_grep(ctx: ToolContext, tmp_path: Path) -> None:
    (ctx.workspace / "src").mkdir()
    (ctx.workspace / "src" / "a.py").write_text("import os\nTODO: fix\nprint('todo later')\n")
    (ctx.workspace / "b.txt").write_text("nothing\nTODO too\n")
    (ctx.workspace / "blob.bin").write_bytes(b"\x00TODO binary")
    (tmp_path / "outside.txt").write_text("TODO outside\n")
    os.symlink(tmp_path / "outside.txt", ctx.workspace / "escape.txt")
    assert call("grep", {"pattern": "TODO"}, ctx) == [
        {"path": "b.txt", "line": 2, "text": "TODO too"},
        {"path": "src/a.py", "line": 2, "text": "TODO: fix"},
    ]
    found = call("grep", {"pattern": "todo", "ignore_case": True, "path": "src"}, ctx)
    assert [m["line"] for m in found] == [2, 3]
    assert len(call("grep", {"pattern": ".", "max_matches": 2}, ctx)) == 2
    assert call("grep", {"pattern": "os", "path": "src/a.py"}, ctx)[0]["line"] == 1
    with pytest.raises(ToolError, match="invalid regular expression"):
        call("grep", {"pattern": "("}, ctx)
    with pytest.raises(ToolError, match="escapes the workspace"):
        call("grep", {"pattern": "x", "path": ".."}, ctx)


# ---------------------------------------------------------------- runtimes


def test_python_runtime_tools(registry: Registry, ctx: ToolContext) -> None:
    page = call("web_scraper", {"url": "https://en.wikipedia.org/wiki/AI"}, ctx, registry)
    assert page["title"] == "AI" and page["url"] == "https://en.wikipedia.org/wiki/AI"
    papers = call("arxiv_search", {"query": "machine learning", "max_results": 3}, ctx, registry)
    assert len(papers) == 3 and papers == call(
        "arxiv_search", {"query": "machine learning", "max_results": 3}, ctx, registry
    )
    with pytest.raises(ToolError) as info:
        call("fail", {"message": "broken on purpose"}, ctx, registry)
    assert str(info.value) == "RuntimeError: broken on purpose"
    with pytest.raises(ToolError, match="parameter 'max_results': 0 is less than the minimum of 1"):
        call("arxiv_search", {"query": "q", "max_results": 0}, ctx, registry)


def test_flaky_fails_then_succeeds(registry: Registry, ctx: ToolContext) -> None:
    for attempt in (1, 2):
        with pytest.raises(ToolError, match=f"attempt {attempt} of 2"):
            call("flaky", {"key": "k1", "failures": 2}, ctx, registry)
    assert call("flaky", {"key": "k1", "failures": 2}, ctx, registry) == {
        "key": "k1",
        "attempts": 3,
    }


def test_python_runtime_missing_module(ctx: ToolContext) -> None:
    spec = ToolSpec(name="ghost", runtime="python", entrypoint="no_such_module_xyz:run")
    with pytest.raises(
        ToolError, match="ModuleNotFoundError: No module named 'no_such_module_xyz'"
    ):
        run_tool(spec, {}, ctx, [])


def test_shell_runtime(registry: Registry, ctx: ToolContext) -> None:
    (ctx.workspace / "words.txt").write_text("one two three\nfour\n")
    out = call("word_count", {"path": "words.txt"}, ctx, registry)
    assert out["returncode"] == 0 and out["stdout"].split()[0] == "4"
    with pytest.raises(ToolError, match=r"wc exited with status 1: .*missing\.txt"):
        call("word_count", {"path": "missing.txt"}, ctx, registry)


def test_shell_arguments_never_go_through_a_shell(ctx: ToolContext) -> None:
    spec = ToolSpec(
        name="say",
        runtime="shell",
        command=["printf", "%s|%s|%s|{{lit}}", "{text}", "{n}", "{flags}"],
        parameters={
            "type": "object",
            "properties": {
                "text": {"type": "string"},
                "n": {"type": "integer"},
                "flags": {"default": [1]},
            },
            "required": ["text", "n"],
        },
    )
    assert render_argv(spec, {"text": "a b", "n": 3}) == [
        "printf",
        "%s|%s|%s|{lit}",
        "a b",
        "3",
        "[1]",
    ]
    out = run_tool(spec, {"text": "$(touch pwned); `id`", "n": 2, "flags": {"x": True}}, ctx)
    assert out["stdout"] == '$(touch pwned); `id`|2|{"x": true}|{lit}'
    assert not (ctx.workspace / "pwned").exists()


def test_tool_timeout_caps_the_context(ctx: ToolContext) -> None:
    spec = ToolSpec(name="slow", runtime="shell", command=["sh", "-c", "sleep 30; touch slept"],
                    timeout=0.3)
    with pytest.raises(ToolTimeout, match=r"^timed out after 0\.3s$"):
        run_tool(spec, {}, ctx)
    # the tool's timeout ended it (not the context's 10 s), before the 30 s sleep was over:
    # the file written after the sleep is not there, and nothing of the tool runs on
    assert not (ctx.workspace / "slept").exists()
    assert live_groups() == frozenset()


def test_docker_runtime_and_queues(ctx: ToolContext) -> None:
    spec = ToolSpec(name="boxed", runtime="docker", image="alpine:3", command=["echo", "hi"])
    assert queue_for(spec) == "docker" and queue_for(BUILTIN_TOOLS["echo"]) == "tool"
    with pytest.raises(ToolError, match="docker pool"):
        run_tool(spec, {}, ctx)


def test_validate_parameters_names_the_nested_field() -> None:
    spec = ToolSpec(
        name="nested",
        runtime="python",
        entrypoint="m:f",
        parameters={
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "items": {"type": "object", "properties": {"n": {"type": "integer"}}},
                }
            },
        },
    )
    with pytest.raises(ToolError) as info:
        validate_parameters(spec, {"items": [{"n": 1}, {"n": "two"}]})
    assert str(info.value) == "parameter 'items[1].n': 'two' is not of type 'integer'"
    validate_parameters(spec, {"items": [{"n": 1}]})


def test_every_builtin_has_a_valid_spec() -> None:
    assert set(BUILTIN_TOOLS) == {
        "echo",
        "sleep",
        "calculator",
        "python",
        "http_get",
        "read_file",
        "write_file",
        "grep",
    }
    for name, spec in BUILTIN_TOOLS.items():
        assert spec.name == name and spec.runtime == "builtin" and spec.description
        assert spec.entrypoint is not None and callable(builtin_function(spec.entrypoint))
        assert spec.parameters["type"] == "object"
    expression = BUILTIN_TOOLS["calculator"].parameters["properties"]["expression"]
    assert expression["maxLength"] == calculator.MAX_LENGTH
