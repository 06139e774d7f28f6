"""`kind: MCPServer` manifests: an MCP server whose tools become Cortex tools `<server>.<tool>`.

Nothing here imports the MCP SDK: the API lists (and validates) MCP tools from this module and
the tool lists that `cortex_worker.services.mcp.client.list_tools` fetched when the manifests loaded.

- `MCPServerSpec`: the manifest (a stdio `command` or a streamable-HTTP `url`);
- `needs_listing`: whether loading the manifests must ask the server for its tools (it need
  not when `tools:` pins every tool with its `parameters`);
- `tool_specs`: the `ToolSpec`s (`runtime: mcp`) of a server, from its pins and/or its listing.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from cortex_worker.services.relics.spec import fill
from cortex_worker.tools.errors import ToolError
from cortex_worker.tools.spec import (
    NAME,
    ToolSpec,
    check_env_names,
    check_name,
    check_object_schema,
    check_schema,
    placeholders,
)

log = logging.getLogger(__name__)

COMMAND_PLACEHOLDERS = ("python", "manifest_dir")
"""What `{...}` may name in a stdio server's command: the worker's Python, the manifest's
directory (absolute)."""

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class MCPToolPin(BaseModel):
    """One entry of `tools:`: a tool of the server to expose, and optionally its schema."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=128, description="the tool's name on the server")
    description: str | None = Field(default=None, description="default: the server's")
    parameters: dict[str, Any] | None = Field(
        default=None, description="its input JSON Schema; with it, the server need not be asked")
    returns: dict[str, Any] | None = Field(default=None, description="documentation only")
    timeout: float | None = Field(default=None, gt=0, description="seconds; default: the server's")

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if schema is None else check_object_schema(schema, "parameters")

    @field_validator("returns")
    @classmethod
    def _returns(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is not None:
            check_schema(schema)
        return schema


class MCPHealth(BaseModel):
    """How often a running server is pinged (MCP `ping`) before a call, and for how long."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    interval_s: float = Field(default=10.0, gt=0,
                              description="ping again before a call if the last is older")
    timeout_s: float = Field(default=5.0, gt=0, description="one ping's time limit")


class MCPServerSpec(BaseModel):
    """An MCP server (`kind: MCPServer`): its tools are tools named `<name>.<tool>`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["MCPServer"] = "MCPServer"
    name: str = Field(description="letters, digits, _ -; at most 64; no dots")
    description: str = ""
    command: list[str] | None = Field(
        default=None, min_length=1,
        description="stdio: the argv that starts it; {python} and {manifest_dir} are filled in")
    url: str | None = Field(default=None, description="streamable HTTP: the MCP endpoint")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="stdio: extra environment variables; `${VAR}` is read from the worker's")
    cwd: str | None = Field(
        default=None, description="stdio: working directory, relative to the manifest "
        "(default: the manifest's directory)")
    headers: dict[str, str] = Field(
        default_factory=dict,
        description="http: extra request headers; `${VAR}` is read from the environment")
    tools: list[MCPToolPin] | None = Field(
        default=None, description="the tools to expose (default: every tool the server lists)")
    timeout: float | None = Field(default=None, gt=0,
                                  description="seconds; caps each call (the action's timeout)")
    startup_timeout_s: float = Field(default=30.0, gt=0,
                                     description="to start, initialize and list its tools")
    idle_timeout_s: float = Field(default=300.0, gt=0,
                                  description="a stdio server unused this long is stopped")
    health: MCPHealth = Field(default_factory=MCPHealth)

    _base_dir: Path | None = PrivateAttr(default=None)

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        return check_name(name, "MCP server", dots=False)

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        return check_env_names(env)

    @field_validator("url")
    @classmethod
    def _url(cls, url: str | None) -> str | None:
        if url is not None and not re.match(r"^https?://[^/\s]+", url):
            raise ValueError(f"must be an http:// or https:// URL, got {url!r}")
        return url

    @model_validator(mode="after")
    def _transport(self) -> MCPServerSpec:
        if (self.command is None) == (self.url is None):
            raise ValueError("give either command (a stdio server: the argv that starts it) or "
                             "url (a streamable-HTTP server), not both or neither")
        if self.url is not None:
            for field in ("env", "cwd"):
                if getattr(self, field):
                    raise ValueError(f"{field}: only for a stdio server (with command); "
                                     "remove it or use headers")
        if self.command is not None:
            if self.headers:
                raise ValueError("headers: only for an HTTP server (with url); use env")
            for index, arg in enumerate(self.command):
                for name in placeholders(arg, where=f"command[{index}]"):
                    if name not in COMMAND_PLACEHOLDERS:
                        raise ValueError(
                            f"command[{index}]: unknown placeholder {{{name}}} in {arg!r} "
                            f"(known: {', '.join('{' + p + '}' for p in COMMAND_PLACEHOLDERS)})")
        seen: set[str] = set()
        for index, pin in enumerate(self.tools or ()):
            if pin.name in seen:
                raise ValueError(f"tools[{index}]: {pin.name!r} is listed twice")
            seen.add(pin.name)
            qualified = f"{self.name}.{pin.name}"
            if not NAME.match(qualified):
                raise ValueError(f"tools[{index}]: {qualified!r} is not a valid tool name "
                                 "(letters, digits, '_', '.' or '-', at most 64 characters)")
        return self

    @property
    def transport(self) -> Literal["stdio", "http"]:
        return "stdio" if self.command is not None else "http"

    @property
    def base_dir(self) -> Path | None:
        """The directory of the manifest that declared it."""
        return self._base_dir

    @property
    def workdir(self) -> Path:
        """Where a stdio server runs: `cwd` relative to the manifest's directory."""
        base = self._base_dir or Path.cwd()
        return (base / self.cwd).resolve() if self.cwd else base


def link_mcp_server(spec: MCPServerSpec, path: Path) -> MCPServerSpec:
    """The spec remembering its manifest's directory (`cwd`, `{manifest_dir}`)."""
    linked = spec.model_copy()
    linked._base_dir = path.parent.resolve()
    return linked


def config_key(spec: MCPServerSpec) -> str:
    """What a server's tool listing depends on, as one string (the key of a kept listing)."""
    return json.dumps([spec.command, str(spec.workdir) if spec.command else None, spec.env,
                       spec.url, spec.headers, spec.startup_timeout_s], sort_keys=True)


def needs_listing(spec: MCPServerSpec) -> bool:
    """Whether the server must be asked for its tools: unless every pin has `parameters`."""
    return spec.tools is None or any(pin.parameters is None for pin in spec.tools)


# ---------------------------------------------------------------- running one


def expand(value: str, where: str, environ: Mapping[str, str] | None = None) -> str:
    """`value` with each `${VAR}` read from the environment; ToolError if one is unset."""
    environ = os.environ if environ is None else environ

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in environ:
            raise ToolError(f"{where}: environment variable {name!r} is not set")
        return environ[name]

    return _ENV_REF.sub(one, value)


def command_argv(spec: MCPServerSpec, python: str) -> list[str]:
    """The argv of a stdio server, its placeholders filled in."""
    base = spec.base_dir or Path.cwd()
    values = {"python": python, "manifest_dir": str(base)}
    return [fill(arg, values) for arg in spec.command or ()]


def server_env(spec: MCPServerSpec) -> dict[str, str]:
    """The manifest's `env`, `${VAR}`s expanded."""
    return {name: expand(value, f"MCP server {spec.name!r}: env.{name}")
            for name, value in spec.env.items()}


def server_headers(spec: MCPServerSpec) -> dict[str, str]:
    """The manifest's `headers`, `${VAR}`s expanded."""
    return {name: expand(value, f"MCP server {spec.name!r}: headers.{name}")
            for name, value in spec.headers.items()}


# ---------------------------------------------------------------- its tools


def tool_name(spec: ToolSpec) -> str:
    """The name of an MCP tool on its server: what follows `<server>.`."""
    return spec.name.split(".", 1)[1]


def tool_specs(server: MCPServerSpec,
               listed: Sequence[Mapping[str, Any]] | None) -> list[ToolSpec]:
    """The server's tools as `ToolSpec`s (`runtime: mcp`, named `<server>.<tool>`).

    `listed` is what the server answered to `tools/list` (`name`, `description`,
    `inputSchema`, `outputSchema`), or None when the pins say everything. Without pins every
    listed tool is kept, but a tool whose name or input schema Cortex cannot take is left out
    with a warning (the rest of the server stays usable). ValueError names a pinned tool the
    server does not have, or one that cannot be taken.
    """
    found = {str(tool["name"]): tool for tool in listed or ()}
    specs = []
    if server.tools is None:
        for name, tool in found.items():
            try:
                specs.append(_tool_spec(server, name, tool, None))
            except ValueError as exc:
                log.warning("MCP server %s: tool %r is left out: %s", server.name, name, exc)
        return specs
    for index, pin in enumerate(server.tools):
        tool = found.get(pin.name)
        if tool is None and pin.parameters is None:
            known = ", ".join(sorted(found)) or "none"
            raise ValueError(f"tools[{index}]: the server has no tool {pin.name!r} "
                             f"(it lists: {known})")
        try:
            specs.append(_tool_spec(server, pin.name, tool or {}, pin))
        except ValueError as exc:
            raise ValueError(f"tools[{index}] {pin.name!r}: {exc}") from None
    return specs


def _tool_spec(server: MCPServerSpec, name: str, tool: Mapping[str, Any],
               pin: MCPToolPin | None) -> ToolSpec:
    parameters = pin.parameters if pin is not None and pin.parameters is not None else \
        tool.get("inputSchema") or {"type": "object"}
    description = pin.description if pin is not None and pin.description is not None else \
        str(tool.get("description") or "")
    returns = pin.returns if pin is not None and pin.returns is not None else \
        tool.get("outputSchema")
    try:
        if returns is not None:
            check_schema(returns)
    except ValueError:
        returns = None  # documentation only: a bad one is dropped, not fatal
    timeout = pin.timeout if pin is not None and pin.timeout is not None else server.timeout
    qualified = f"{server.name}.{name}"
    if not NAME.match(qualified):
        raise ValueError(f"{qualified!r} is not a valid Cortex tool name (letters, digits, '_', "
                         "'.' or '-', at most 64 characters)")
    try:
        spec = ToolSpec(name=qualified, description=description, runtime="mcp",
                        server=server.name, parameters=dict(parameters), returns=returns,
                        timeout=timeout)
    except ValidationError as exc:  # the input schema, mostly
        problems = (f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}"
                    for e in exc.errors(include_url=False))
        raise ValueError("; ".join(problems)) from None
    spec._mcp_server = server
    return spec
