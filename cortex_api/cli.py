"""The `cortex` command line."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from cortex_worker.pools import BY_NAME, NAMES, UP, lanes
from cortex_worker.protocol.document import Document, load_document

if TYPE_CHECKING:
    from cortex_api.client import APIError, Client, JobCreated

# soft_wrap: print lines as they are, never re-wrapped at the width of a terminal, or at 80
# columns when the output is a pipe or a file (`cortex up` keeps its processes' output in logs).
console = Console(soft_wrap=True)
stderr = Console(stderr=True, soft_wrap=True)


def _readable(params: list[Any]) -> list[Any]:
    """Help that reads like click's: an argument is FILE (typer writes `{file}`), and a flag
    shows nothing after it (typer writes `<bool>`)."""
    for param in params:
        if isinstance(param, TyperOption) and param.is_flag:
            param.metavar = ""  # typer shows it in the type column
        elif isinstance(param, TyperArgument) and param.metavar is None:
            param.metavar = param.name.upper()
    return params


class Command(TyperCommand):
    """A command with readable help: every command of `cortex` is one."""

    def get_params(self, ctx: typer.Context) -> list[Any]:
        return _readable(super().get_params(ctx))

    def collect_usage_pieces(self, ctx: typer.Context) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, TyperArgument):
                name = f"{param.metavar}{'...' if param.nargs != 1 else ''}"
                pieces.append(name if param.required else f"[{name}]")
            else:
                pieces.extend(param.get_usage_pieces(ctx))
        return pieces


class Group(TyperGroup):
    """A group of commands with readable help."""

    def get_params(self, ctx: typer.Context) -> list[Any]:
        return _readable(super().get_params(ctx))


app = typer.Typer(cls=Group, help="Cortex: a distributed runtime for LLM agents.",
                  no_args_is_help=True)


@app.callback()
def main() -> None:
    """Cortex: a distributed runtime for LLM agents that think and act at the same time."""


def _parse_estimates(values: list[str]) -> dict[str, float]:
    estimates: dict[str, float] = {}
    for item in values:
        ident, sep, seconds = item.partition("=")
        try:
            if not sep:
                raise ValueError
            estimates[ident.strip()] = float(seconds)
        except ValueError:
            raise typer.BadParameter(f"{item!r}: write ID=SECONDS, e.g. fetch=0.5") from None
    return estimates


@app.command(cls=Command)
def validate(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, readable=True,
                                         help="A protocol document.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the stable JSON report.")] = False,
    chunk: Annotated[int | None, typer.Option(min=1, help="Feed the parser N characters at a time.")] = None,
    estimate: Annotated[list[str] | None, typer.Option(
        metavar="ID=SECONDS", help="Expected seconds of an action for the critical path, as ID=SECONDS (repeatable; "
             "default 1 each).")] = None,
) -> None:
    """Parse a document; show its actions, waves and critical path. Exit 1 on errors.

    With the manifests of CORTEX_MANIFESTS it also checks the actions' targets (tools, agents,
    workflows, relics) as the API does when the document is submitted; without them it says
    that it did not."""
    doc = load_document(file.read_text(encoding="utf-8"), chunk=chunk)
    note = _check_targets(doc)
    if as_json:
        typer.echo(json.dumps(doc.to_json(), indent=2, ensure_ascii=False))
        stderr.print(note, highlight=False)  # stdout stays the JSON report
    else:
        _print_summary(doc, _parse_estimates(estimate or []), note)
    raise typer.Exit(0 if doc.ok else 1)


def _check_targets(doc: Document) -> str:
    """Add to `doc.errors` what the API's submit check (`check_document`) finds beyond the
    parse: unknown or ungranted targets, bad parameters, too many actions. Returns a line
    saying against which manifests, or that target names were not checked."""
    from cortex_worker.handles import get_registry
    from cortex_worker.jobs.lifecycle import document_report
    from cortex_worker.manifests.loader import ManifestError
    from cortex_worker.settings import get_settings

    directory = get_settings().manifests.expanduser()
    if not directory.exists():
        return (f"[yellow]target names not checked[/]: no manifests at {escape(str(directory))}"
                " (set CORTEX_MANIFESTS to check them as the API will)")
    try:
        registry = get_registry()
    except ManifestError as exc:
        stderr.print(f"[red]invalid manifests[/]: {escape(str(exc))}", highlight=False)
        raise typer.Exit(2) from None
    doc.errors[:] = document_report(doc)["errors"]
    return (f"targets checked against the manifests in {escape(str(directory))} "
            f"({len(registry.tools)} tools, {len(registry.agents)} agents)")


def _print_summary(doc: Document, estimates: dict[str, float], note: str) -> None:
    plan = doc.plan
    assert plan is not None
    table = Table(title=f"{len(plan.nodes)} actions", title_justify="left")
    for column in ("id", "type", "mode", "name", "waits for", "in thought"):
        table.add_column(column)
    for node in plan.nodes.values():
        a = node.action
        waits = ", ".join([*node.depends_on, *(f"{s} (sync)" for s in node.after)])
        table.add_row(a.id, a.type.value, a.mode.value, a.name, waits or "-",
                      "yes" if a.in_thought else "")
    console.print(table)
    for number, wave in enumerate(plan.waves(), 1):
        console.print(f"wave {number}: {', '.join(wave)}")
    path, total = plan.critical_path(estimates)
    if path:
        console.print(f"critical path: {' → '.join(path)} ({total:g} s estimated)")
    final = [r for r in doc.responses if r["final"]]
    console.print(f"responses: {len(doc.responses)} ({len(final)} final), thoughts: "
                  f"{len(doc.thoughts)}, feeds: {len(doc.feeds)}")
    for level, items, style in (("error", doc.errors, "red"), ("warning", doc.warnings, "yellow")):
        for item in items:
            console.print(f"[{style}]{level}[/] {item['line']}:{item['column']} "
                          f"{item['kind']}: {item['message']}", highlight=False)
    console.print(note, highlight=False)
    if doc.ok:
        console.print("[green]valid[/]")


def _check_manifests() -> None:
    """Load the manifests once at start-up: a broken one stops the process with its error."""
    from cortex_worker.handles import get_registry
    from cortex_worker.manifests.loader import ManifestError

    try:
        registry = get_registry()
    except ManifestError as exc:
        console.print(f"[red]invalid manifests[/]: {exc}", highlight=False)
        raise typer.Exit(2) from None
    console.print(f"manifests: {len(registry.tools)} tools, {len(registry.agents)} agents",
                  highlight=False)


THREADS_HELP = ", ".join(f"{p.name} ({p.concurrency})" for p in BY_NAME.values() if p.threaded)


@app.command(cls=Command)
def worker(
    pool: Annotated[str, typer.Option(help=f"The pool to serve: {', '.join(NAMES)}.")],
    concurrency: Annotated[int | None, typer.Option(
        min=1, help=f"Slots: processes (default: CPUs), or threads for {THREADS_HELP}.")] = None,
    loglevel: Annotated[str, typer.Option(help="Celery log level.")] = "INFO",
    hostname: Annotated[str | None, typer.Option(help="Worker node name (default pool@host).")] = None,
) -> None:
    """Start a worker of one pool; run several, on any machines, to scale it.

    Exits non-zero when it cannot go on (invalid settings: 2; Celery's "Unrecoverable error",
    such as a broker that is a read-only replica: 1), so that a supervisor restarts it."""
    from pydantic import ValidationError

    from cortex_worker.settings import get_settings

    if pool not in BY_NAME:
        raise typer.BadParameter(f"unknown pool {pool!r}; choose one of {', '.join(NAMES)}")
    try:
        get_settings()
    except ValidationError as exc:
        console.print(f"[red]invalid settings[/]: {exc}", highlight=False)
        raise typer.Exit(2) from None
    from cortex_worker.app import app as celery_app
    from cortex_worker.worker import signals

    _check_manifests()
    if pool == "tool":
        from cortex_worker.tools.sandboxed import describe_isolation

        ok, line = describe_isolation(get_settings())
        console.print(line if ok else f"[red]{line}[/]", highlight=False)
        if not ok:
            raise typer.Exit(2)
    argv = ["worker", "-Q", ",".join(lanes(pool)), "-n", hostname or f"{pool}@%h", f"--loglevel={loglevel}",
            "--without-gossip", "--without-mingle"]
    spec = BY_NAME[pool]
    if spec.threaded:
        argv.append("--pool=threads")
    if concurrency or spec.concurrency:
        argv.append(f"--concurrency={concurrency or spec.concurrency}")
    exit_code = signals.connect_exit_code()
    celery_app.worker_main(argv)
    if exit_code():
        raise typer.Exit(exit_code())


@app.command(cls=Command)
def api(
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    fd: Annotated[int | None, typer.Option(
        help="Serve on this listening socket, already bound by the parent process (cortex up "
             "binds it, so that nothing can take the port in between); --host and --port are "
             "then its own.")] = None,
    insecure_no_auth: Annotated[bool, typer.Option(
        "--insecure-no-auth", envvar="CORTEX_ALLOW_NO_AUTH",
        help="Serve a non-loopback host without API keys (only behind something that "
             "authenticates).")] = False,
) -> None:
    """Serve the REST API (jobs, events over SSE, validation, health).

    With no API keys configured it binds only loopback unless --insecure-no-auth."""
    from pydantic import ValidationError

    from cortex_api.auth import AuthConfigError
    from cortex_api.server import run
    from cortex_worker.settings import get_settings

    try:
        get_settings()
    except ValidationError as exc:
        console.print(f"[red]invalid settings[/]: {exc}", highlight=False)
        raise typer.Exit(2) from None
    _check_manifests()
    try:
        run(host=host, port=port, allow_no_auth=insecure_no_auth, fd=fd)
    except AuthConfigError as exc:
        console.print(f"[red]{exc}[/]", highlight=False)
        raise typer.Exit(2) from None


keys_app = typer.Typer(cls=Group, help="API keys: make one, or hash one for CORTEX_API_KEYS(_FILE).",
                       no_args_is_help=True)
app.add_typer(keys_app, name="keys")


@keys_app.command("hash", cls=Command)
def keys_hash(
    key: Annotated[str | None, typer.Argument(
        help="The key; omit it (or write -) to read it from stdin, out of shell history.")] = None,
    tenant: Annotated[str | None, typer.Option(help="Print a whole `tenant:sha256:<hex>` entry.")] = None,
) -> None:
    """Print a key's stored form, `sha256:<hex>`: configure that instead of the key."""
    import sys

    from cortex_api.auth import hash_key

    if key is None or key == "-":
        key = sys.stdin.readline().strip()
    if not key:
        raise typer.BadParameter("no key given")
    typer.echo(f"{tenant}:{hash_key(key)}" if tenant else hash_key(key))


@keys_app.command("new", cls=Command)
def keys_new(tenant: Annotated[str, typer.Argument(help="The tenant the key belongs to.")]) -> None:
    """Make a random key: give the key to the client, configure the hashed entry."""
    import secrets

    from cortex_api.auth import hash_key

    key = secrets.token_urlsafe(32)
    typer.echo(f"key (give it to the client; it is not stored): {key}")
    typer.echo(f"entry (CORTEX_API_KEYS): {tenant}:{hash_key(key)}")


def _submit_and_follow(url: str, api_key: str | None,
                       submit: Callable[[Client], JobCreated]) -> None:
    """Submit with `submit`, then follow the job live; exit 0 if it completed."""
    from cortex_api.client import APIError, Client, CortexClientError
    from cortex_api.follow import follow_job

    with Client(url, api_key=api_key) as client:
        try:
            job = submit(client)
        except APIError as exc:
            _print_rejection(f"rejected ({exc.status})", exc)
            raise typer.Exit(1) from None
        except CortexClientError as exc:
            console.print(f"[red]{escape(str(exc))}[/] (start it with `cortex api`)",
                          highlight=False)
            raise typer.Exit(2) from None
        console.print(f"job {job.id}")
        try:
            view = follow_job(client.base_url, job.id, console, client.headers)
        except CortexClientError as exc:
            console.print(f"[red]lost the job's events[/]: {escape(str(exc))}", highlight=False)
            raise typer.Exit(1) from None
    raise typer.Exit(0 if view.end and view.end["type"] == "job_completed" else 1)


def _print_rejection(title: str, error: APIError) -> None:
    """The API's message, then each problem it listed: a document's line and column, or
    where in the request body."""
    console.print(f"[red]{title}[/]: {escape(error.message)}", highlight=False)
    for item in error.errors:
        where = (f"{item['line']}:{item['column']} {item.get('kind', '')}" if "line" in item
                 else item.get("location", ""))
        console.print(Text(f"  {where}: {item.get('message', '')}"), highlight=False)


URL_OPTION = typer.Option(envvar="CORTEX_API_URL", help="The Cortex API.")
KEY_OPTION = typer.Option(envvar="CORTEX_API_KEY", help="API key.")


@app.command("exec", cls=Command)
def exec_(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, readable=True,
                                         help="A protocol document to run.")],
    url: Annotated[str, URL_OPTION] = "http://127.0.0.1:8000",
    api_key: Annotated[str | None, KEY_OPTION] = None,
    fail_fast: Annotated[bool, typer.Option(help="Cancel the job at the first failure.")] = False,
) -> None:
    """Submit a document and follow it live: thoughts, actions, and a closing summary."""
    from cortex_api.models import JobOptions

    protocol = file.read_text(encoding="utf-8")
    _submit_and_follow(url, api_key, lambda client: client.submit_document(
        protocol, options=JobOptions(fail_fast=fail_fast)))


@app.command(cls=Command)
def run(
    message: Annotated[str, typer.Argument(help="The task for the agent.")],
    agent: Annotated[str, typer.Option(help="The agent to run (see GET /v1/agents).")],
    url: Annotated[str, URL_OPTION] = "http://127.0.0.1:8000",
    api_key: Annotated[str | None, KEY_OPTION] = None,
) -> None:
    """Run an agent on a message and stream the job live in the terminal."""
    _submit_and_follow(url, api_key, lambda client: client.submit_agent(agent, message))


def _answer(url: str, api_key: str | None, job_id: str, action_id: str,
            reason: str | None, approve: bool) -> None:
    """Answer an approval request; exit 1 with the API's message if it cannot be."""
    from cortex_api.client import APIError, Client, CortexClientError

    with Client(url, api_key=api_key) as client:
        try:
            decision = (client.approve(job_id, action_id) if approve
                        else client.reject(job_id, action_id, reason=reason))
        except APIError as exc:
            _print_rejection(f"not {'approved' if approve else 'rejected'} ({exc.status})", exc)
            raise typer.Exit(1) from None
        except CortexClientError as exc:
            console.print(f"[red]{escape(str(exc))}[/]", highlight=False)
            raise typer.Exit(2) from None
    console.print(f"action {action_id} of job {job_id}: {decision.decision}", highlight=False)


JOB_ARGUMENT = typer.Argument(help="The job.")
ACTION_ARGUMENT = typer.Argument(help="The action awaiting approval (its id).")


@app.command(cls=Command)
def approve(
    job_id: Annotated[str, JOB_ARGUMENT],
    action_id: Annotated[str, ACTION_ARGUMENT],
    url: Annotated[str, URL_OPTION] = "http://127.0.0.1:8000",
    api_key: Annotated[str | None, KEY_OPTION] = None,
) -> None:
    """Approve an action that awaits approval: it runs."""
    _answer(url, api_key, job_id, action_id, None, approve=True)


@app.command(cls=Command)
def reject(
    job_id: Annotated[str, JOB_ARGUMENT],
    action_id: Annotated[str, ACTION_ARGUMENT],
    reason: Annotated[str | None, typer.Option(help="Why; the model reads it.")] = None,
    url: Annotated[str, URL_OPTION] = "http://127.0.0.1:8000",
    api_key: Annotated[str | None, KEY_OPTION] = None,
) -> None:
    """Reject an action that awaits approval: it fails with the reason."""
    _answer(url, api_key, job_id, action_id, reason, approve=False)


DEMO_QUESTION = ("What limits the speedup of parallel work, according to the notes in "
                 "examples/docs, and what do their formulas predict for a job that is 95% "
                 "parallel on 16 workers?")


def _redact(url: str) -> str:
    """`url` without its passwords: the user part's, and a query's `password=` and
    `sentinel_password=` (a Sentinel URL's), as every message of Cortex shows a URL."""
    from cortex_worker.store.connect import redact

    return redact(url)


@app.command(cls=Command)
def up(
    port: Annotated[int, typer.Option(help="API port.")] = 8000,
    pools: Annotated[str, typer.Option(help="Comma-separated pools to start.")] = ",".join(UP),
    log_dir: Annotated[Path, typer.Option(help="Where each process's log is kept.")] = Path(".cortex/logs"),
    broker: Annotated[str | None, typer.Option(
        help="Celery broker for every process (CORTEX_BROKER_URL), e.g. "
             "amqp://guest:guest@127.0.0.1:5672//; state, events and results stay in Redis.")] = None,
    flower: Annotated[bool, typer.Option(
        help="Also run Flower on CORTEX_FLOWER_PORT (basic auth: CORTEX_FLOWER_BASIC_AUTH).")] = True,
) -> None:
    """Run the whole stack in the foreground: Redis if none answers, the pools, the API, Flower.

    Ctrl-C, SIGTERM or SIGHUP stops everything and exits 0; exit 1 if a process fails."""
    import time

    from cortex_api.stack import Interrupted, Stack, StackError
    from cortex_worker.settings import get_settings

    colors = ["cyan", "magenta", "green", "yellow", "blue", "red"]
    names: dict[str, str] = {}

    def echo(name: str, line: str) -> None:
        color = names.setdefault(name, colors[len(names) % len(colors)])
        console.print(f"[{color}]{name:>13}[/] | {line}", markup=True, highlight=False, soft_wrap=True)

    stack = Stack(get_settings(), log_dir, echo=echo)
    try:
        settings = stack.settings
        stack.start([p.strip() for p in pools.split(",") if p.strip()], api_port=port,
                     broker=broker, flower=flower)
        console.print(f"[green]Cortex is up[/]: API {stack.api_url} (docs at {stack.api_url}/docs); "
                      "Ctrl-C (or SIGTERM, SIGHUP) stops everything")
        if flower:
            auth = ("basic auth" if settings.flower_basic_auth is not None
                    else "no auth: set CORTEX_FLOWER_BASIC_AUTH=user:password to enable its API")
            console.print(f"Flower {stack.flower_url} ({auth})", highlight=False)
        where = ("private: in memory, stopped with the stack" if stack.private_redis
                 else "CORTEX_REDIS_URL")
        console.print(f"Redis {_redact(stack.redis_url)} ({where}); for redis-cli and celery "
                      f"in another shell: export CORTEX_REDIS_URL={_redact(stack.redis_url)}",
                      highlight=False)
        if broker:
            console.print(f"broker: {_redact(broker)}", highlight=False)
        while (dead := stack.failed()) is None:
            time.sleep(0.5)
        console.print(f"[red]{dead.name} exited ({dead.popen.returncode})[/]; stopping")
        raise typer.Exit(1)
    except StackError as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from None
    except Interrupted:
        pass  # the way to stop it: a clean stop, exit 0
    finally:
        stack.stop()


@app.command(cls=Command)
def demo(
    question: Annotated[str, typer.Argument(help="What to ask the demo agent.")] = DEMO_QUESTION,
    agent: Annotated[str, typer.Option(help="The agent to run.")] = "demo",
    log_dir: Annotated[Path, typer.Option(help="Where each process's log is kept.")] = Path(".cortex/demo"),
) -> None:
    """Start a private stack, run one agent job live in the terminal, and stop everything.

    In a terminal the stack stays up after the job, so that its links answer, until Enter or
    Ctrl-C. Exit: the job's (0 if it completed, else 1), or 128+signal if stopped before it ended."""
    import sys

    from cortex_api.client import APIError, Client, CortexClientError
    from cortex_api.follow import follow_job
    from cortex_api.stack import Interrupted, Stack, StackError, free_port
    from cortex_worker.settings import get_settings

    waits = sys.stdin.isatty() and sys.stdout.isatty()  # someone is there to press Enter
    stack = Stack(get_settings().model_copy(update={"flower_port": free_port()}), log_dir)
    followed = False
    try:
        with console.status("starting Redis, the worker pools, the API and Flower…"):
            stack.start(flower=True, open_api=True)
        with Client(stack.api_url) as client:
            try:
                job_id = client.submit_agent(agent, question).id
            except APIError as exc:
                _print_rejection("the demo job was rejected", exc)
                raise typer.Exit(1) from None
            console.print(f"[bold]{agent}[/]: {question}\njob {job_id} — page: "
                          f"{stack.api_url}/jobs/{job_id}  ·  events: "
                          f"{stack.api_url}/v1/jobs/{job_id}/events  ·  Flower: {stack.flower_url}")
            view = follow_job(client.base_url, job_id, console, client.headers)
        followed = True
        code = 0 if view.end and view.end["type"] == "job_completed" else 1
        if waits:
            console.print(f"job page  {stack.api_url}/jobs/{job_id}\n"
                          f"JSON      {stack.api_url}/v1/jobs/{job_id}\n"
                          f"API docs  {stack.api_url}/docs\n"
                          f"Flower    {stack.flower_url}\n"
                          f"logs      {log_dir}\n"
                          "[bold]The stack stays up for these links: press Enter (or Ctrl-C) to "
                          "stop it.[/]", highlight=False, soft_wrap=True)
            with suppress(Interrupted):  # as good as Enter: the job is over, exit with its code
                sys.stdin.readline()
    except (StackError, CortexClientError) as exc:
        console.print(f"[red]{escape(str(exc))}[/]", highlight=False)
        code = 1
    except Interrupted as exc:
        console.print(f"interrupted ({exc}); stopping")
        code = 128 + exc.signum
    finally:
        try:
            with console.status("stopping everything…"):
                stack.stop()
        finally:
            stack.stop()  # a no-op, unless the first was broken off before it began: by a
            # terminal gone (EIO), or by the first signal landing just as the job ended
    if followed and not waits:
        console.print(f"the stack is stopped, so the links above no longer answer (in a terminal "
                      f"the demo keeps them up until Enter) · logs: {log_dir}")
    raise typer.Exit(code)
