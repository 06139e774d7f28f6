"""Which model an agent talks to, and how."""

from __future__ import annotations

import hashlib
import logging
import os
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationInfo,
    field_validator,
    model_validator,
)

from cortex_worker.tools.spec import check_name

log = logging.getLogger(__name__)

INLINE_PREFIX = "inline-"
"""How the endpoint of an inline `model:` block is named (`ModelConfig.endpoint`); no
`kind: Model` may take a name that starts with it."""

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")

PROVIDER_DEFAULTS: dict[str, dict[str, str]] = {
    "anthropic": {"base_url": "https://api.anthropic.com/v1", "model": "claude-sonnet-4-6",
                  "api_key_env": "ANTHROPIC_API_KEY", "continuation": "prefill"},
}
"""Defaults that differ by provider (the field defaults are OpenAI's)."""


ToolChoice = Literal["auto", "required", "none"] | str
"""`auto`, `required`, `none`, or the name of one of the agent's tools (it must call it)."""
CHOICES = frozenset({"auto", "required", "none"})

_NOT_FUNCTION_NAME = re.compile(r"[^A-Za-z0-9_-]")


def function_name(tool: str) -> str:
    """The name a tool has as a native function: providers accept only letters, digits, `_`
    and `-`, so `time.get_current_time` (an MCP tool) is offered as `time__get_current_time`."""
    return _NOT_FUNCTION_NAME.sub("__", tool)


class ModelLimits(BaseModel):
    """What the provider allows this endpoint, shared by every worker of the cluster (held in
    Redis, `cortex_worker.llm.limits`): a request waits for a slot within all three."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    requests_per_minute: int | None = Field(default=None, gt=0)
    tokens_per_minute: int | None = Field(
        default=None, gt=0, description="prompt (estimated before sending, then corrected with "
        "the reported usage) plus completion tokens")
    max_concurrent: int | None = Field(default=None, gt=0, description="requests in flight")


class ModelConfig(BaseModel):
    """An OpenAI-compatible chat endpoint, Anthropic's Messages API (`provider: anthropic`), or
    a replayed transcript (`provider: replay`).

    For `anthropic`, `base_url`, `model` and `api_key_env` default to
    `PROVIDER_DEFAULTS["anthropic"]` when not given, and `temperature` may not exceed 1.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    provider: Literal["openai", "anthropic", "replay"] = "openai"
    base_url: str = Field(default="https://api.openai.com/v1",
                          description="`${VAR}` is read from the environment when used")
    model: str = "gpt-4o-mini"
    api_key_env: str | None = Field(default="OPENAI_API_KEY",
                                    description="environment variable holding the API key")
    temperature: float | None = Field(default=None, ge=0, le=2)
    max_tokens: int | None = Field(
        default=None, gt=0,
        description="sent when set; anthropic requires it: 8192 when unset")
    seed: int | None = Field(
        default=None, ge=0, le=2**31 - 1,
        description="sent when set, with every request: the sampling seed (OpenAI, vLLM, "
        "SGLang, llama.cpp's server), so a request samples the same way whatever the engine "
        "served before it; anthropic has none")
    timeout_s: float = Field(default=120.0, gt=0, description="per request, between bytes")
    max_retries: int = Field(default=3, ge=0, le=10)
    native_tools: bool = Field(default=False,
                               description="also offer the tools as native function calls")
    grammar: Literal["gbnf", "lark", "ebnf", "structural_tag"] | None = Field(
        default=None,
        description="constrain decoding to the protocol with a grammar generated from the "
                    "agent's manifest (cortex_worker.llm.grammar): gbnf for llama.cpp, lark or "
                    "ebnf for vLLM / SGLang, structural_tag for XGrammar; off by default")
    tool_choice: ToolChoice = Field(
        default="auto", min_length=1,
        description="whether the model must act (OpenAI's meanings): auto (it may), required "
        "(each turn acts, until the job has run an action: then auto, so the model can "
        "answer), none (it may not), or a tool's name (the agent's: it must call that tool, "
        "until the job has run an action); sent as the provider's parameter with native "
        "tools, and built into the grammar with `grammar` (required or a name: an action, of "
        "that tool, before any response)")
    continuation: Literal["prefill", "continue_final_message"] | None = Field(
        default=None,
        description="how the endpoint continues a partial answer, so a turn taken over from a "
        "coordinator that stopped goes on from the text already streamed instead of starting "
        "again: prefill (a last assistant message is continued: Anthropic, the default there; "
        "llama.cpp's server), continue_final_message (vLLM, SGLang); None: generated again. "
        "Protocol turns only (not native tool calls, not with a grammar)")
    limits: ModelLimits | None = Field(
        default=None, description="the provider's limits, shared by the cluster; without them "
        "a 429's reset still pauses every worker's requests to the endpoint")
    name: str | None = Field(default=None, description="the `kind: Model` manifest it came "
                             "from (set by the loader); None for an inline `model:` block")
    transcript: str | None = Field(default=None, description="replay: a transcript file")
    tokens_per_second: float = Field(default=50.0, gt=0, description="replay speed")

    @model_validator(mode="before")
    @classmethod
    def _provider_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("provider") in PROVIDER_DEFAULTS:
            data = {**PROVIDER_DEFAULTS[data["provider"]], **data}
        return data

    @field_validator("grammar")
    @classmethod
    def _grammar_engine(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("provider") == "anthropic":
            raise ValueError("provider anthropic cannot constrain decoding with a grammar; "
                             "grammars are for OpenAI-compatible engines (llama.cpp, vLLM, "
                             "SGLang)")
        return value

    @field_validator("seed")
    @classmethod
    def _seed_sent(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("provider") == "anthropic":
            raise ValueError("provider anthropic takes no seed (the Messages API has none)")
        return value

    @field_validator("temperature")
    @classmethod
    def _temperature_range(cls, value: float | None, info: ValidationInfo) -> float | None:
        if info.data.get("provider") == "anthropic" and value is not None and value > 1:
            raise ValueError("provider anthropic accepts a temperature from 0 to 1")
        return value

    def url(self) -> str:
        """`base_url` with `${VAR}` expanded (an unset variable is an error)."""
        def expand(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in os.environ:
                raise ValueError(f"model base_url needs environment variable {name}, which is not set")
            return os.environ[name]
        return _ENV.sub(expand, self.base_url).rstrip("/")

    @property
    def forced_tool(self) -> str | None:
        """The tool `tool_choice` names, if it names one."""
        return None if self.tool_choice in CHOICES else self.tool_choice

    def wire(self) -> dict[str, Any]:
        """As written into a job record or an action's spec for another process: the fields
        set away from their defaults only, so a worker of the version before (a rolling
        upgrade) reads it unless a new field is used."""
        return self.model_dump(mode="json", exclude_defaults=True)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> ModelConfig:
        """Read `wire()`'s output, ignoring fields this version does not know (written by a
        newer worker, in a rolling upgrade): a manifest's unknown field is still an error."""
        known = {k: v for k, v in data.items() if k in cls.model_fields}
        if len(known) < len(data):
            log.warning("model fields from a newer version ignored: %s",
                        sorted(set(data) - set(known)))
        return cls.model_validate(known)

    def named(self, model: str | None) -> ModelConfig:
        """This endpoint with another model name (the job option `model`); itself if None.
        Another model is another endpoint: it keeps no manifest name."""
        if not model or model == self.model:
            return self
        return self.model_copy(update={"model": model, "name": None})

    def endpoint(self) -> str:
        """The name its shared limits and pauses are kept under: the `kind: Model` name, else
        `inline-<hash>` of what identifies the provider's account and model (two agents with
        the same inline block share it)."""
        if self.name:
            return self.name
        what = "\0".join([self.provider, self.base_url.rstrip("/"), self.model,
                           self.api_key_env or ""])
        return INLINE_PREFIX + hashlib.sha256(what.encode()).hexdigest()[:12]

    def api_key(self) -> str | None:
        """The key in the variable `api_key_env` names (None: it names none). A named variable
        unset or empty is an error: without it the endpoint refuses the request or, when out
        of reach, is tried again and again, and neither says the key is missing."""
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ValueError(f"the model's API key is missing: environment variable "
                             f"{self.api_key_env} (api_key_env) is not set; set it, or set "
                             "api_key_env: null for an endpoint that needs no key")
        return key


class ModelSpec(ModelConfig):
    """`kind: Model`: a named endpoint, every field of a `model:` block plus a name. Agents,
    workflows and `CORTEX_DOCUMENT_MODEL` refer to it by name (`model: NAME`); the loader puts
    `config()` in their place, so its limits are kept under its name."""

    kind: Literal["Model"] = "Model"
    name: str = Field(description="letters, digits, _ . -; at most 64; not `inline-...`")
    description: str = ""

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        check_name(name, "model")
        if name.startswith(INLINE_PREFIX):
            raise ValueError(f"{name!r}: names starting with {INLINE_PREFIX!r} are kept for "
                             "the endpoints of inline model blocks; choose another name")
        return name

    def config(self) -> ModelConfig:
        """The endpoint as a `model:` block that carries this name."""
        fields = self.model_dump(include=set(ModelConfig.model_fields))
        return ModelConfig.model_validate(fields)


def model_or_name(value: Any) -> ModelConfig | str:
    """A `model:` value as written in a manifest or a setting: an inline block (validated as a
    `ModelConfig`) or the name of a `kind: Model` (looked up when the manifests are linked).
    An inline block may not carry `name`: that is how a Model is referred to."""
    if isinstance(value, ModelConfig):
        return value
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("give a model block or the name of a kind: Model, not an empty "
                             "string")
        return value.strip()
    if isinstance(value, dict):
        if "name" in value:
            raise ValueError("an inline model block has no `name`; to use a kind: Model, "
                             f"write `model: {value['name']}` instead of a block")
        return ModelConfig.model_validate(value)
    raise ValueError("give a model block (a mapping) or the name of a kind: Model, got "
                     f"{type(value).__name__}")


ModelField = Annotated[ModelConfig | str, PlainValidator(
    model_or_name, json_schema_input_type=ModelConfig | str)]
"""A `model:` field of a manifest: an inline block, or the name of a `kind: Model` (a string
until the loader's link step puts the Model's `ModelConfig` in its place)."""
