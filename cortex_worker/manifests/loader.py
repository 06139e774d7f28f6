"""The manifest loader: every `*.yaml` / `*.yml` under a directory into one `Registry`.

A file holds one or more YAML documents (`---`). A document is either one object with a
`kind` (`kind: Tool`, …) or a collection without `kind` whose keys are section names, each
a list of objects of that kind:

    kind: Tool                      # one tool
    name: word_count
    runtime: shell
    command: ["wc", "-w", "{path}"]
    ---
    tools:                          # several (kind may be omitted in a section)
      - name: slugify
        runtime: python
        entrypoint: exampletools:slugify

Every problem is reported naming the file and the field, e.g.
`examples/manifests/tools.yaml: tools[2] 'grep2': runtime: Input should be ...`. Loading goes
on past a broken object or file, and one `ManifestError` lists every problem found.

Adding a kind (Relic, Workflow, RemoteAgent): a model with `kind: Literal[...]` and `name`, a `dict`
field on `Registry`, and one `Kind` entry in `KINDS`. A kind's `check` sees one object alone;
its `link` runs after every file has loaded, so it may look up other objects in the registry
(in any file, in any order) and read files relative to the manifest.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from cortex_worker.actions.types.internal import INTERNAL_ACTIONS
from cortex_worker.agents import output
from cortex_worker.agents.spec import AgentSpec
from cortex_worker.errors import CortexError
from cortex_worker.llm.config import ModelConfig, ModelSpec
from cortex_worker.services.mcp.listing import Lister, list_here
from cortex_worker.services.mcp.spec import (
    MCPServerSpec,
    link_mcp_server,
    needs_listing,
    tool_specs,
)
from cortex_worker.services.relics.spec import RelicSpec, builtin_relics, check_relic, link_relic
from cortex_worker.tools.errors import ToolError
from cortex_worker.tools.function import discover
from cortex_worker.tools.spec import BUILTIN_TOOLS, ToolSpec
from cortex_worker.workflows.link import link_workflow
from cortex_worker.workflows.spec import WorkflowSpec, check_workflow

BUILTIN_SOURCE = "<built-in>"


class ManifestError(CortexError, ValueError):
    """Manifests that cannot be loaded. `problems`: each one, naming its file and field; the
    message is the one problem, or all of them, one a line (a user fixes them in one go)."""

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems = list(problems) or [message]

    @classmethod
    def of(cls, problems: Sequence[str]) -> ManifestError:
        """One error for all of `problems`."""
        if len(problems) == 1:
            return cls(problems[0])
        return cls(f"{len(problems)} problems:\n" + "\n".join(f"  {p}" for p in problems),
                   problems)


class UnknownAgentError(CortexError, LookupError):
    """`Registry.agent` was asked for an agent no manifest declares."""


class UnknownWorkflowError(CortexError, LookupError):
    """`Registry.workflow` was asked for a workflow no manifest declares."""


class UnknownModelError(CortexError, LookupError):
    """A `model:` names a `kind: Model` no manifest declares."""


@dataclass
class Registry:
    """Everything the manifests declare, by kind and name (built-in tools included)."""

    tools: dict[str, ToolSpec] = field(default_factory=dict)
    agents: dict[str, AgentSpec] = field(default_factory=dict)
    workflows: dict[str, WorkflowSpec] = field(default_factory=dict)
    relics: dict[str, RelicSpec] = field(default_factory=dict)
    models: dict[str, ModelSpec] = field(default_factory=dict)
    """Named model endpoints (`kind: Model`), which `model: NAME` refers to."""
    tool_modules: dict[str, ToolModuleSpec] = field(default_factory=dict)
    """Python modules whose `@tool` functions are tools (see `tools.function`)."""
    mcp_servers: dict[str, MCPServerSpec] = field(default_factory=dict)
    """MCP servers whose tools are tools named `<server>.<tool>` (see `cortex_worker.services.mcp`)."""
    remote_agents: dict[str, RemoteAgentSpec] = field(default_factory=dict)
    """Agents served elsewhere over A2A (`kind: RemoteAgent`), called as `type="agent"`."""
    sources: dict[tuple[str, str], str] = field(default_factory=dict)
    """(kind, name) → the file that declared it, or "<built-in>"."""
    directory: Path | None = None
    module_paths: list[Path] = field(default_factory=list)
    """Directories put on PYTHONPATH of python-runtime tools (the manifests directory)."""

    def tool(self, name: str) -> ToolSpec:
        """The tool called `name`; ToolError lists the known ones otherwise."""
        try:
            return self.tools[name]
        except KeyError:
            known = ", ".join(sorted(self.tools)) or "none"
            raise ToolError(f"unknown tool {name!r}; known tools: {known}") from None

    def agent(self, name: str) -> AgentSpec:
        """The agent called `name`; UnknownAgentError lists the known ones otherwise."""
        try:
            return self.agents[name]
        except KeyError:
            known = ", ".join(sorted(self.agents)) or "none"
            raise UnknownAgentError(f"unknown agent {name!r}; known agents: {known}") from None

    def workflow(self, name: str) -> WorkflowSpec:
        """The workflow called `name`; UnknownWorkflowError lists the known ones otherwise."""
        try:
            return self.workflows[name]
        except KeyError:
            known = ", ".join(sorted(self.workflows)) or "none"
            raise UnknownWorkflowError(
                f"unknown workflow {name!r}; known workflows: {known}") from None

    def relic(self, name: str) -> RelicSpec:
        """The relic called `name` (built-ins included); ToolError lists the known ones."""
        try:
            return self.relics[name]
        except KeyError:
            known = ", ".join(sorted(self.relics)) or "none"
            raise ToolError(f"unknown relic {name!r}; known relics: {known}") from None

    def model(self, model: ModelConfig | str) -> ModelConfig:
        """The endpoint a `model:` value is: an inline block itself, else the `kind: Model` it
        names (as a `ModelConfig` carrying the name); UnknownModelError lists the known ones."""
        if isinstance(model, ModelConfig):
            return model
        spec = self.models.get(model)
        if spec is None:
            known = ", ".join(sorted(self.models)) or "none"
            raise UnknownModelError(
                f"unknown model {model!r}; declare it with kind: Model (known models: {known}), "
                f"or give the provider's model name in a block: `model: {{model: {model}}}`")
        return spec.config()

    def source(self, kind: str, name: str) -> str | None:
        return self.sources.get((kind, name))


@dataclass(frozen=True)
class Kind:
    """How one `kind:` is loaded: its model, its `Registry` attribute / section key."""

    name: str
    section: str
    model: type[BaseModel]
    check: Callable[[Any], str | None] | None = None
    """Extra rule for user manifests: returns an error message (field path first) or None."""
    link: Callable[[Any, Registry, Path], Any] | None = None
    """Cross-reference rule, run once all files have loaded: `link(spec, registry, file)`
    returns the spec to keep (possibly updated) or raises ValueError (field path first)."""

    @property
    def label(self) -> str:
        return self.name.lower()


def _check_tool(spec: ToolSpec) -> str | None:
    if spec.runtime == "builtin":
        return (
            "runtime: 'builtin' is reserved for the tools built into the worker; "
            "use python, shell or docker"
        )
    if spec.runtime == "mcp":
        return (
            "runtime: 'mcp' tools come from MCP servers: declare the server with kind: MCPServer "
            "and its tools are added as <server>.<tool>"
        )
    return None


def _check_agent(spec: AgentSpec) -> str | None:
    if spec.system_prompt and spec.system_prompt_file:
        return (
            "system_prompt_file: give the instructions either inline (system_prompt) or in a "
            "file (system_prompt_file), not both"
        )
    for section in ("tools", "agents", "relics", "workflows"):
        seen: set[str] = set()
        for index, name in enumerate(getattr(spec, section)):
            if name in seen:
                return f"{section}[{index}]: {name!r} is listed twice"
            seen.add(name)
    policy = spec.internal_actions
    for section in ("allowed", "blocked"):
        for index, name in enumerate(getattr(policy, section)):
            if name not in INTERNAL_ACTIONS:
                return (
                    f"internal_actions.{section}[{index}]: unknown internal action {name!r} "
                    f"(expected one of: {', '.join(INTERNAL_ACTIONS)})"
                )
    ids: set[str] = set()
    for index, feed in enumerate(spec.context_feeds):
        if feed.id in ids:
            return f"context_feeds[{index}].id: feed {feed.id!r} is declared twice"
        ids.add(feed.id)
        if feed.type == "periodic" and feed.interval is None:
            return f"context_feeds[{index}].interval: required when type is 'periodic' (seconds)"
    return None


def _linked_model(model: ModelConfig | str, registry: Registry) -> ModelConfig:
    """A `model:` value with the `kind: Model` it names in its place (ValueError: none)."""
    try:
        return registry.model(model)
    except UnknownModelError as exc:
        raise ValueError(f"model: {exc}") from None


def _link_agent(spec: AgentSpec, registry: Registry, path: Path) -> AgentSpec:
    """Check what an agent names against the registry, put the `kind: Model` its `model:`
    names in its place, and read its `system_prompt_file`."""
    if isinstance(spec.model, str):
        spec = spec.model_copy(update={"model": _linked_model(spec.model, registry)})
    forced = spec.model.forced_tool if spec.model is not None else None
    if forced is not None and forced not in spec.tools:
        raise ValueError(f"model.tool_choice: {forced!r} is not one of the agent's tools (its "
                         f"tools: {', '.join(spec.tools) or 'none'}); or use auto, required or "
                         "none")
    for index, name in enumerate(spec.tools):
        if name not in registry.tools:
            known = ", ".join(sorted(registry.tools)) or "none"
            raise ValueError(
                f"tools[{index}]: unknown tool {name!r}; declare it with kind: Tool or remove it "
                f"(known tools: {known})"
            )
    for index, name in enumerate(spec.agents):
        if name == spec.name:
            raise ValueError(
                f"agents[{index}]: an agent cannot list itself; nest other agents instead"
            )
        if name not in registry.agents and name not in registry.remote_agents:
            known = ", ".join(sorted([*registry.agents, *registry.remote_agents])) or "none"
            raise ValueError(
                f"agents[{index}]: unknown agent {name!r}; declare it with kind: Agent or remove "
                f"it (known agents: {known})"
            )
    for index, feed in enumerate(spec.context_feeds):
        if feed.source.type == "tool" and feed.source.name not in registry.tools:
            raise ValueError(
                f"context_feeds[{index}].source.name: unknown tool {feed.source.name!r}"
            )
    for section, known_names in (("relics", registry.relics), ("workflows", registry.workflows)):
        for index, name in enumerate(getattr(spec, section)):
            if name not in known_names:
                known = ", ".join(sorted(known_names)) or "none"
                raise ValueError(f"{section}[{index}]: unknown {section[:-1]} {name!r} "
                                 f"(known: {known})")
    for index, feed in enumerate(spec.context_feeds):
        source = feed.source
        known_names = {"relic": registry.relics, "workflow": registry.workflows}.get(source.type)
        target = source.name.split(".", 1)[0] if source.type == "relic" else source.name
        if known_names is not None and target not in known_names:
            raise ValueError(f"context_feeds[{index}].source.name: unknown {source.type} "
                             f"{source.name!r}")
    if isinstance(spec.output_schema, str):
        spec = spec.model_copy(update={"output_schema": _model_schema(spec.output_schema,
                                                                      registry)})
    if spec.system_prompt_file is None:
        return spec
    prompt_path = path.parent / Path(spec.system_prompt_file).expanduser()
    try:
        text = prompt_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(
            f"system_prompt_file: cannot read {spec.system_prompt_file!r} "
            f"({_show(prompt_path)}, relative to the manifest): {reason}"
        ) from None
    return spec.model_copy(update={"system_prompt": text})


def _model_schema(name: str, registry: Registry) -> dict[str, Any]:
    """The JSON Schema of the pydantic model `name` (module:Class), its module imported as
    the agents' tool modules are (the manifests directory on the path)."""
    added = [str(p) for p in registry.module_paths if str(p) not in sys.path]
    sys.path[:0] = added
    try:
        return output.resolve(name)
    except output.OutputSchemaError as exc:
        raise ValueError(str(exc)) from None
    finally:
        for entry in added:
            sys.path.remove(entry)


def _link_workflow(spec: WorkflowSpec, registry: Registry, path: Path) -> WorkflowSpec:
    """What the steps name must exist: each step is checked through the action-type table;
    the `kind: Model` its `model:` names is put in its place."""
    if isinstance(spec.model, str):
        spec = spec.model_copy(update={"model": _linked_model(spec.model, registry)})
    forced = spec.model.forced_tool if spec.model is not None else None
    if forced is not None and forced not in spec.tools:
        raise ValueError(f"model.tool_choice: {forced!r} is not one of the agent's tools (its "
                         f"tools: {', '.join(spec.tools) or 'none'}); or use auto, required or "
                         "none")
    link_workflow(spec, registry)
    return spec


def _link_relic(spec: RelicSpec, registry: Registry, path: Path) -> RelicSpec:
    """An http relic's command runs in its manifest's directory."""
    return link_relic(spec, path)


class ToolModuleSpec(BaseModel):
    """`kind: ToolModule`: a Python module (importable from the manifests directory, or
    installed) whose `@tool` functions become tools."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["ToolModule"] = "ToolModule"
    name: str = Field(description="the module, e.g. `my_tools` or `pkg.tools`",
                      pattern=r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class RemoteAgentSpec(BaseModel):
    """`kind: RemoteAgent`: an agent served elsewhere over A2A 1.0, which agents and documents
    call as `<action type="agent">` like a local one (`agents.remote` runs the calls)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["RemoteAgent"] = "RemoteAgent"
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_\-]*$")
    description: str = Field(default="", description="what it does, for the prompts of the "
                             "agents that list it")
    card_url: str = Field(description="the URL of its Agent Card, e.g. `https://host/"
                          ".well-known/agent-card.json`; `${VAR}` is read from the environment "
                          "when it is called")
    auth_env: str | None = Field(default=None, description="environment variable holding a "
                                 "token, sent as `Authorization: Bearer <token>`")
    timeout_s: float | None = Field(default=None, gt=0, description="how long a call may take, "
                                    "waiting for the remote task included (default: the "
                                    "action's, else default_action_timeout_s)")

    @field_validator("card_url")
    @classmethod
    def _card_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://", "${")):  # `${VAR}` may hold the scheme
            raise ValueError(f"{url!r} is not an http(s) URL")
        return url


def _link_remote_agent(spec: RemoteAgentSpec, registry: Registry,
                       path: Path) -> RemoteAgentSpec:
    """One name, one agent: a `type="agent"` action looks local agents up first."""
    if spec.name in registry.agents:
        raise ValueError(f"name: agent {spec.name!r} is also declared with kind: Agent "
                         f"(in {registry.source('Agent', spec.name)}); choose another name")
    return spec


KINDS: dict[str, Kind] = {
    "Tool": Kind("Tool", "tools", ToolSpec, _check_tool),
    "ToolModule": Kind("ToolModule", "tool_modules", ToolModuleSpec),
    "Agent": Kind("Agent", "agents", AgentSpec, _check_agent, _link_agent),
    "Workflow": Kind("Workflow", "workflows", WorkflowSpec, check_workflow, _link_workflow),
    "Relic": Kind("Relic", "relics", RelicSpec, check_relic, _link_relic),
    "MCPServer": Kind("MCPServer", "mcp_servers", MCPServerSpec),
    "Model": Kind("Model", "models", ModelSpec),
    "RemoteAgent": Kind("RemoteAgent", "remote_agents", RemoteAgentSpec,
                        link=_link_remote_agent),
}
SECTIONS: dict[str, Kind] = {kind.section: kind for kind in KINDS.values()}


def load_registry(directory: Path | None, tool_modules: Sequence[str] = (),
                  list_mcp_tools: Lister | None = None) -> Registry:
    """Built-in tools plus every manifest under `directory` (None or missing: built-ins only),
    plus the `@tool` functions of `tool_modules` and of `kind: ToolModule` manifests.

    `list_mcp_tools` lists the tools of the MCP servers whose tools are not all pinned
    (default: ask them from this process; `handles.get_registry` shares the listings through
    Redis)."""
    registry = Registry()
    for name, spec in BUILTIN_TOOLS.items():
        registry.tools[name] = spec
        registry.sources[("Tool", name)] = BUILTIN_SOURCE
    for name, relic in builtin_relics().items():
        registry.relics[name] = relic
        registry.sources[("Relic", name)] = BUILTIN_SOURCE
    if directory is None or not Path(directory).expanduser().exists():
        _add_function_tools(registry, tool_modules, "CORTEX_TOOL_MODULES")
        return registry
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise ManifestError(f"{_show(directory)}: not a directory; give the manifests directory")
    registry.directory = directory.resolve()
    registry.module_paths = [registry.directory]
    loaded: list[tuple[Kind, Path, str, BaseModel]] = []
    problems: list[str] = []
    for path in manifest_files(directory):
        with _noting(problems):
            for kind, where, spec in load_file(path):
                with _noting(problems):
                    _add(registry, kind, spec, _show(path), where)
                    loaded.append((kind, path, where, spec))
    with _noting(problems):
        _add_function_tools(registry, tool_modules, "CORTEX_TOOL_MODULES")
    for kind, path, _, spec in loaded:  # before the links: agents name these tools
        if kind.name == "ToolModule":
            with _noting(problems):
                _add_function_tools(registry, [spec.name], _show(path))  # type: ignore[attr-defined]
    with _noting(problems):
        _add_mcp_tools(registry, [(path, where, spec) for kind, path, where, spec in loaded
                                  if isinstance(spec, MCPServerSpec)],
                       list_mcp_tools or list_here)
    for kind, path, where, spec in loaded:  # cross-references: every file is loaded now
        if kind.link is None:
            continue
        try:
            linked = kind.link(spec, registry, path)
        except ValueError as exc:
            problems.append(f"{_show(path)}: {where}: {exc}")
            continue
        getattr(registry, kind.section)[linked.name] = linked
    if problems:
        raise ManifestError.of(problems)
    return registry


@contextmanager
def _noting(problems: list[str]) -> Iterator[None]:
    """Note a ManifestError's problems in `problems` and go on loading."""
    try:
        yield
    except ManifestError as exc:
        problems.extend(exc.problems)


def _add_function_tools(registry: Registry, modules: Sequence[str], shown: str) -> None:
    """Add the `@tool` functions of each module (imported with the manifests directory on
    the path, as the sandbox will import it)."""
    for module in modules:
        added = [str(p) for p in registry.module_paths if str(p) not in sys.path]
        sys.path[:0] = added
        try:
            specs = discover(module)
        except Exception as exc:  # an import error of the user's module: say which and why
            raise ManifestError(f"{shown}: tool module {module!r} cannot be loaded: "
                                f"{type(exc).__name__}: {exc}") from None
        finally:
            for path in added:
                sys.path.remove(path)
        for spec in specs:
            _add(registry, KINDS["Tool"], spec, f"{shown} (module {module})", spec.name)


def _add_mcp_tools(registry: Registry, servers: Sequence[tuple[Path, str, MCPServerSpec]],
                   list_mcp_tools: Lister) -> None:
    """Add the tools of each MCP server, named `<server>.<tool>`: from its `tools:` pins, and
    from what it answers to `tools/list` unless the pins give every tool's parameters (the
    servers to ask are asked at once; a stdio one is started for that and stopped)."""
    linked = [(path, where, link_mcp_server(spec, path)) for path, where, spec in servers]
    for _, _, spec in linked:
        registry.mcp_servers[spec.name] = spec
    to_list = [spec for _, _, spec in linked if needs_listing(spec)]
    listed: dict[str, Any] = {}
    if to_list:
        try:
            listed = list_mcp_tools(to_list)
        except ImportError as exc:
            path, where, _ = next(item for item in linked if needs_listing(item[2]))
            raise ManifestError(
                f"{_show(path)}: {where}: listing an MCP server's tools needs the MCP SDK "
                f"({exc}): pip install 'cortex[mcp]', or pin every tool with its parameters "
                "under tools:") from None
    for path, where, spec in linked:
        answer = listed.get(spec.name)
        if isinstance(answer, Exception):
            raise ManifestError(
                f"{_show(path)}: {where}: cannot list the tools of MCP server {spec.name!r}: "
                f"{answer} (pin them under tools:, with their parameters, to load the manifests "
                "without asking the server)")
        try:
            specs = tool_specs(spec, answer)
        except ValueError as exc:
            raise ManifestError(f"{_show(path)}: {where}: {exc}") from None
        for tool in specs:
            _add(registry, KINDS["Tool"], tool, f"{_show(path)} (MCP server {spec.name})",
                 tool.name)


def manifest_files(directory: Path) -> list[Path]:
    """`*.yaml` and `*.yml` under `directory`, recursively, sorted; hidden entries skipped."""
    found = []
    for path in directory.rglob("*"):
        relative = path.relative_to(directory)
        if any(part.startswith(".") for part in relative.parts):
            continue
        if path.suffix in (".yaml", ".yml") and path.is_file():
            found.append(path)
    return sorted(found)


def load_file(path: Path) -> Iterator[tuple[Kind, str, BaseModel]]:
    """(kind, where in the file, validated model) for every object in one manifest file."""
    shown = _show(path)
    try:
        text = path.read_text(encoding="utf-8")
        documents = [doc for doc in yaml.safe_load_all(text)]
    except yaml.YAMLError as exc:
        raise ManifestError(f"{shown}: invalid YAML: {_yaml_problem(exc)}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{shown}: cannot read: {exc}") from None
    present = [(i, doc) for i, doc in enumerate(documents, start=1) if doc is not None]
    many = len(present) > 1
    problems: list[str] = []
    for number, doc in present:
        prefix = f"document {number}: " if many else ""
        with _noting(problems):
            yield from _load_document(doc, shown, prefix, problems)
    if problems:  # raised once the file's good objects are given: a caller may go on
        raise ManifestError.of(problems)


def _load_document(doc: Any, shown: str, prefix: str,
                   problems: list[str]) -> Iterator[tuple[Kind, str, BaseModel]]:
    """The objects of one YAML document; a broken object's problem goes to `problems`, one
    that breaks the whole document is raised."""
    if not isinstance(doc, dict):
        raise ManifestError(
            f"{shown}: {prefix}a manifest must be a mapping with 'kind', got {type(doc).__name__}"
        )
    if "kind" in doc:
        kind = _kind(doc["kind"], shown, prefix)
        where = (
            f"{prefix}{kind.name} {doc.get('name')!r}"
            if doc.get("name")
            else f"{prefix}{kind.name}"
        )
        yield kind, where, _validate(kind, doc, shown, where)
        return
    unknown = [key for key in doc if key not in SECTIONS]
    if unknown or not doc:
        expected = ", ".join(f"kind: {k}" for k in KINDS)
        sections = ", ".join(f"'{s}:'" for s in SECTIONS)
        raise ManifestError(
            f"{shown}: {prefix}missing 'kind' (expected {expected}, or a list under {sections})"
            + (f"; unexpected key(s): {', '.join(map(repr, unknown))}" if unknown else "")
        )
    for section, items in doc.items():
        kind = SECTIONS[section]
        if not isinstance(items, list):
            problems.append(f"{shown}: {prefix}{section}: must be a list of {kind.label}s")
            continue
        for index, item in enumerate(items):
            where = f"{prefix}{section}[{index}]"
            if isinstance(item, dict) and item.get("name"):
                where += f" {item['name']!r}"
            if not isinstance(item, dict):
                problems.append(f"{shown}: {where}: must be a mapping, got {type(item).__name__}")
                continue
            if item.get("kind", kind.name) != kind.name:
                problems.append(f"{shown}: {where}: kind: {item['kind']!r} in '{section}' (it "
                                f"holds {kind.name}s)")
                continue
            with _noting(problems):
                model = _validate(kind, {"kind": kind.name, **item}, shown, where)
                yield kind, where, model


def _kind(value: Any, shown: str, prefix: str) -> Kind:
    if value not in KINDS:
        raise ManifestError(
            f"{shown}: {prefix}kind: unknown kind {value!r} (expected one of: {', '.join(KINDS)})"
        )
    return KINDS[value]


def _validate(kind: Kind, data: dict[str, Any], shown: str, where: str) -> BaseModel:
    try:
        model = kind.model.model_validate(data)
    except ValidationError as exc:
        raise ManifestError(f"{shown}: {where}: {format_errors(exc)}") from None
    problem = kind.check(model) if kind.check else None
    if problem:
        raise ManifestError(f"{shown}: {where}: {problem}")
    return model


def _add(registry: Registry, kind: Kind, spec: BaseModel, shown: str, where: str) -> None:
    name: str = spec.name  # type: ignore[attr-defined]
    table: dict[str, Any] = getattr(registry, kind.section)
    previous = registry.sources.get((kind.name, name))
    if previous == BUILTIN_SOURCE:
        raise ManifestError(
            f"{shown}: {where}: {kind.label} {name!r} in {shown} conflicts with the built-in "
            f"{kind.label}; choose another name"
        )
    if previous is not None:
        raise ManifestError(
            f"{shown}: {where}: {kind.label} {name!r} is already defined in {previous}"
        )
    table[name] = spec
    registry.sources[(kind.name, name)] = shown


def format_errors(exc: ValidationError) -> str:
    """Pydantic errors as "field.path[0]: message; other: message"."""
    parts = []
    for error in exc.errors(include_url=False):
        loc = _loc(error["loc"])
        message = str(error["msg"]).removeprefix("Value error, ")
        parts.append(f"{loc}: {message}" if loc else message)
    return "; ".join(parts)


def _loc(loc: tuple[int | str, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    if mark is not None:
        return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
    return problem


def _show(path: Path) -> str:
    """The path as the user wrote it: relative to the current directory when inside it."""
    try:
        return (
            os.path.relpath(path) if Path(path).resolve().is_relative_to(Path.cwd()) else str(path)
        )
    except ValueError:
        return str(path)
