"""What an action type declares (`ActionType`), and what its checks read (`Target`).

A type is one row: how an action of that type is checked before a job runs, which pool queue
runs it and which function (named as `module:function`, imported by the worker that first runs
one, so the API process never imports tool, sandbox or model code), what an agent's manifest
must list to use it, what the agent's prompt and grammar say of it, and whether it can be a
context feed's source or a workflow's step.

The checks serve two askers: `jobs.lifecycle.check_document` before a document runs, and
`workflows.link.link_workflow` once every manifest has loaded (a workflow's steps are actions
too). `Target.wording` says which one asks, so the same problem reads as a document error
(`no tool named 'x' (registered: …)`) or as a manifest error (`unknown tool 'x'; declare it
with kind: Tool (known tools: …)`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from cortex_worker.protocol.variables import find_references

if TYPE_CHECKING:
    from cortex_worker.llm.config import ModelConfig
    from cortex_worker.services.relics.spec import RelicSpec
    from cortex_worker.settings import Settings
    from cortex_worker.tools.spec import ToolSpec

#: A problem found by a check: (kind, message); the message starts with the action's label.
Problem = tuple[str, str]


class Policy(Protocol):
    """An agent's internal-action policy (`agents.spec.InternalActionPolicy`)."""

    def permits(self, name: str) -> bool: ...


class Agent(Protocol):
    """What the types read of an agent (`agents.spec.Agent` is one). Named here, not
    imported: the agent's manifest model reads the table (its feed sources)."""

    @property
    def name(self) -> str: ...

    @property
    def model(self) -> ModelConfig: ...

    @property
    def description(self) -> str: ...

    @property
    def tools(self) -> list[str]: ...

    @property
    def agents(self) -> list[str]: ...

    @property
    def relics(self) -> list[str]: ...

    @property
    def workflows(self) -> list[str]: ...

    @property
    def context_feeds(self) -> Sequence[Any]: ...
    """Its `agents.spec.FeedSpec`s."""

    @property
    def internal_actions(self) -> Policy: ...


class Workflow(Protocol):
    """What the types read of a workflow (`workflows.spec.WorkflowSpec` is one). Named here,
    not imported: the workflow's manifest model reads the table (its step types)."""

    @property
    def inputs(self) -> dict[str, Any]: ...

    def input_errors(self, inputs: Any) -> list[tuple[str, str]]: ...

    def prepare_inputs(self, inputs: Mapping[str, Any]) -> dict[str, Any]: ...


class RemoteAgent(Protocol):
    """What the types read of a remote agent (`manifests.loader.RemoteAgentSpec` is one).
    Named here, not imported: the manifests read the table."""

    @property
    def description(self) -> str: ...

    @property
    def timeout_s(self) -> float | None: ...


class Tables(Protocol):
    """What the types read of the manifests: `manifests.loader.Registry` is one, also while it
    loads. Named here, not imported, so that the manifests can check workflows through the
    table."""

    @property
    def tools(self) -> Mapping[str, ToolSpec]: ...

    @property
    def agents(self) -> Mapping[str, Agent]: ...

    @property
    def workflows(self) -> Mapping[str, Workflow]: ...

    @property
    def relics(self) -> Mapping[str, RelicSpec]: ...

    @property
    def remote_agents(self) -> Mapping[str, RemoteAgent]: ...
    """Agents served elsewhere over A2A: `type="agent"` targets too (`types.agent`)."""


@dataclass(frozen=True, slots=True)
class Wording:
    """How the checks word their problems for one asker (`str.format` templates).

    Fields: `label` (the action's), `name` (its target's), `what` (`tool`, `agent`,
    `workflow`), `kind` (`Tool`, …: the manifest kind that declares one), `known` (the names
    there are, sorted) and `detail` (what the validator said). A relic's problems are worded by
    the relic (`relics.spec.check_relic_action`) and read the same for both askers.
    """

    unknown: str
    unknown_internal: str
    tool_parameters: str
    workflow_inputs: str
    no_model: str


DOCUMENT = Wording(
    unknown="{label}: no {what} named {name!r} (registered: {known})",
    unknown_internal="{label}: no internal action {name!r} (one of: {known})",
    tool_parameters="{label} ({name}): {detail}",
    workflow_inputs="{label} (workflow {name}): {detail}",
    no_model="{label}: llm actions in documents need a model: set CORTEX_DOCUMENT_MODEL "
             "(llm {name!r} cannot run)",
)
"""A document's action, checked before the document runs (`jobs.lifecycle.check_document`)."""

MANIFEST = Wording(
    unknown="{label}: unknown {what} {name!r}; declare it with kind: {kind} "
            "(known {what}s: {known})",
    unknown_internal="{label}: unknown internal action {name!r} (one of: {known})",
    tool_parameters="{label}: tool {name!r}: {detail}",
    workflow_inputs="{label}: workflow {name!r}: {detail}",
    no_model="{label}: llm steps run on the workflow's model; give the workflow a `model`",
)
"""A workflow manifest's step, checked once every manifest has loaded (`link_workflow`)."""


@dataclass(frozen=True, slots=True)
class Target:
    """What a check looks at: the action (by its label), its target's name and parameters."""

    label: str  # e.g. "action 'fetch'", "steps[0] 'fetch'"
    name: str
    parameters: Any
    registry: Tables
    settings: Settings | None = None
    """A document's: its llm actions run on `document_model`."""
    wording: Wording = DOCUMENT
    """Who asks: how the problems read."""
    model: ModelConfig | None = None
    """The model of the job's llm actions when the job has its own (a workflow's `model`)."""

    @property
    def literal(self) -> bool:
        """The parameters hold no `$reference`, so they can be validated before the run."""
        return not find_references(self.parameters)

    @property
    def llm_model(self) -> ModelConfig | str | None:
        """The model an llm action would run on: the job's own, else the documents' one (a
        string: the `kind: Model` it names, checked when the manifests load)."""
        if self.model is not None:
            return self.model
        return self.settings.document_model if self.settings is not None else None

    def word(self, template: str, **fields: Any) -> str:
        """A template of `wording` filled in with this action's label and name."""
        return template.format(label=self.label, name=self.name, **fields)

    def unknown(self, what: str, known: Mapping[str, Any]) -> list[Problem]:
        """The problem of a name that no manifest of kind `what` declares."""
        names = ", ".join(sorted(known)) or "none"
        return [(f"unknown_{what}", self.word(self.wording.unknown, what=what,
                                              kind=what.capitalize(), known=names))]


#: A callable an agent may name, for its grammar: (name, parameter schema).
Callee = tuple[str, Mapping[str, Any]]


class ClientTool(Protocol):
    """A tool a job's client runs itself (`jobs.options.ClientTool` is one): a `type="tool"`
    target of that job only. Named here, not imported: the prompt and the grammar list them
    next to the agent's own tools."""

    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str: ...

    @property
    def parameters(self) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class ActionType:
    """One row of the table: everything that differs between action types."""

    name: str
    check: Callable[[Target], list[Problem]]
    """Problems that stop a job (or a workflow manifest) before it runs."""
    runner: str
    """`module:function` taking a `Call`: imported by the worker that first runs one."""
    queue: Callable[[Tables, str], str]
    """The pool queue that runs an action on a target name."""
    grant: Callable[[Agent, str], str | None] = lambda agent, name: None
    """Why an agent may not use a target of this type (what its manifest must list), or None."""
    prompt: Callable[[Agent, Tables], str | None] = lambda agent, registry: None
    """The section of an agent's system prompt that lists what it may call (None: none)."""
    callees: Callable[[Agent, Tables], Iterable[Callee]] = lambda agent, registry: ()
    """What an agent may name in actions of this type, for its grammar (raises `LookupError`
    naming what its manifest lists but no manifest declares)."""
    timeout: Callable[[Tables, str], float | None] = lambda registry, name: None
    """The target's own time limit (None: the action's or the default)."""
    concurrency: Callable[[Tables, str], int | None] = lambda registry, name: None
    """How many actions on the target may run at once across the cluster (None: no limit)."""
    approval: Callable[[Tables, str], bool] = lambda registry, name: False
    """The target itself requires a person's approval of every call (its agent may too)."""
    keyed: bool = False
    """The body may name the target under the type's own key (`{"tool": "search"}`)."""
    feed_source: bool = False
    """A context feed may take its values from it (`source: {type, name, params}`)."""
    workflow_step: bool = False
    """A workflow's step may be one."""
    needs_model: bool = False
    """The action runs on the job's model: its spec carries it."""
    child_job: bool = False
    """The action runs as a child job, whose end completes it."""
    in_turn: bool = False
    """A ready action runs in the turn that parsed it, not on a pool (it changes the turn's own
    job: internal actions)."""
    client_prompt: Callable[[Agent, Tables, Sequence[ClientTool]], str] | None = None
    """The type's targets include a job's client tools (`JobOptions.client_tools`): its prompt
    section with them listed (None: the type takes none). The grammar and the native
    functions list them with the type's own targets."""
    client_target: Callable[[Tables, str], bool] = lambda registry, name: False
    """Whether a name may be one of a job's client tools (no manifest declares it): a call of
    one is held for the client's answer (`jobs.approvals`), never sent to a pool."""


def listing(heading: str, names: Sequence[str]) -> str | None:
    """A prompt section that names what the agent may call (None if nothing)."""
    return "\n".join([heading, "", *(f"- {name}" for name in names)]) if names else None


def on(queue: str) -> Callable[[Tables, str], str]:
    """A type whose actions all run on one pool."""
    return lambda registry, name: queue
