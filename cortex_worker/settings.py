"""Settings for every Cortex process: `CORTEX_*` environment variables, a `.env` file, or a
settings file (TOML or YAML) named by `CORTEX_SETTINGS_FILE`.

Precedence, highest first: values passed to `Settings(...)`, the environment, `.env`, the
settings file, the defaults. The file's keys are the field names without the prefix
(`redis_url = "redis://..."`); an unknown key in it is an error, not silently ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

from cortex_worker.llm.config import ModelField
from cortex_worker.store.connect import is_redis_url, parse_url

#: Environment variable naming the settings file (`.toml`, `.yaml` or `.yml`).
SETTINGS_FILE_ENV = "CORTEX_SETTINGS_FILE"


#: Threads of the agent pool (`cortex worker --pool agent`) by default: each running turn holds
#: one, asleep while the process's reader thread reads its stream.
AGENT_THREADS = 200


class Quota(BaseModel):
    """A tenant's token budget (prompt and completion tokens of every model request of its
    jobs), per UTC day and per month, and its caps on jobs and on actions running at once;
    None: no limit."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens_per_day: int | None = Field(default=None, gt=0)
    tokens_per_month: int | None = Field(default=None, gt=0)
    max_running_jobs: int | None = Field(
        default=None, gt=0, description="jobs of the tenant running at once (child jobs of "
        "its running jobs not counted); the others wait `queued`, in order")
    max_actions_in_flight: int | None = Field(
        default=None, gt=0, description="actions of the tenant's jobs running at once, on "
        "every pool together; the others wait `queued` for a slot, in order")


class Settings(BaseSettings):
    """One place for every knob; each field is `CORTEX_<NAME>` in the environment."""

    # hide_input_in_errors: a rejected CORTEX_API_KEYS must not print the keys it holds.
    model_config = SettingsConfigDict(env_prefix="CORTEX_", env_file=".env", extra="ignore",
                                      hide_input_in_errors=True)

    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0", description="job state, events, results: "
        "redis://, rediss://, unix:// or redis+sentinel://[:password@]HOST:PORT,HOST:PORT,.../"
        "MASTER_NAME/DB (see docs/operations.md#redis-sentinel)")
    broker_url: str | None = Field(default=None, description="Celery broker; defaults to redis_url")
    redis_replica_acks: int = Field(
        default=1, ge=0, description="replicas each write of job state waits for (WAIT), at "
        "most those connected: a failover then loses no result, attempt count or event that "
        "was acknowledged (docs/operations.md#redis-sentinel); 0: writes do not wait")
    redis_replica_wait_ms: int = Field(
        default=1000, gt=0, description="the most a write waits for its replicas; past it the "
        "write goes on, counted in cortex_unreplicated_writes")
    manifests: Path = Path("examples/manifests")
    workspace_root: Path = Path("/tmp/cortex-workspaces")
    sandbox_isolation: Literal["auto", "required", "off"] = Field(
        default="auto", description="namespaces around python/shell tools: 'auto' uses them "
        "where the kernel allows, 'required' refuses to run tools without them")
    sandbox_user: str | None = Field(
        default="nobody", description="user that tool code runs as when the worker is root; "
        "empty: the worker's user, without capabilities")

    event_retention_s: int = Field(default=7 * 24 * 3600, gt=0)
    max_parallel_actions: int = Field(default=64, gt=0, description="running actions per job")
    max_actions_per_job: int = Field(default=5000, gt=0)
    max_output_bytes: int = Field(default=256 * 1024, gt=0, description="stored per action")
    max_document_bytes: int = Field(default=1024 * 1024, gt=0)
    default_action_timeout_s: float = Field(default=300.0, gt=0)
    visibility_timeout_s: int = Field(
        default=6 * 3600, gt=0, description="the broker's redelivery of an unacknowledged task: "
        "a backstop only (the reconciler recovers work within seconds); keep it longer than "
        "the longest action, or a long action on a healthy worker is delivered twice")
    heartbeat_s: float = Field(default=2.0, gt=0, description="how often a worker process "
                               "says it is alive")
    liveness_ttl_s: float = Field(default=10.0, gt=0, description="a worker process that has "
                                  "not said so for this long is dead: its work is sent again")
    reconcile_every_s: float = Field(default=5.0, gt=0, description="how often one worker "
                                     "process (any) looks for lost work")
    turn_wait_s: float = Field(default=10.0, ge=0, description="how long an agent turn whose "
                               "actions still run waits for them in its thread (at most half "
                               "of an agent worker's threads wait), so that the next turn starts "
                               "without a trip through the queue; 0: never")
    redrive_grace_s: float = Field(default=10.0, gt=0, description="how long a start, turn or "
                                   "queued action may sit untouched before it is sent again "
                                   "(doubling each time)")
    max_redrives: int = Field(default=3, ge=0, description="times an action whose worker died "
                              "is run again before it fails")
    canvas: bool = Field(default=True, description="compile series-parallel plans to canvas")
    approval_timeout_s: float = Field(default=3600.0, gt=0, description="an action waiting "
                                      "for approval is rejected after this long unanswered "
                                      "(an agent's `approval.timeout_s` overrides it)")

    document_model: Annotated[ModelField | None, NoDecode] = Field(
        default=None, description="the model of `type=\"llm\"` actions in documents: JSON, as "
        "an agent manifest's `model`, or the name of a `kind: Model` (checked when the manifests "
        "load); without it documents cannot hold llm actions")

    mcp_listing_ttl_s: float = Field(
        default=600.0, ge=0, description="how long an MCP server's tool listing is shared "
        "through Redis by the processes that load the manifests (one listing for the cluster; "
        "docs/manifests.md#kind-mcpserver); 0: each process asks the servers itself")

    http_allow_hosts: list[str] = Field(default_factory=list, description="http_get allow-list")
    tool_modules: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(), description="Python modules whose `@tool` functions are tools "
        "(comma-separated; importable from the manifests directory, or installed)")
    docker_host: str | None = Field(
        default=None,
        description="Docker daemon for docker tools (unix:///path.sock); None: DOCKER_HOST or "
        "the SDK's default",
    )

    flower_port: int = Field(default=5555, gt=0, lt=65536, description="`cortex up`'s Flower")
    flower_url: str | None = Field(default=None, pattern=r"^https?://", description="where the "
                                   "jobs dashboard links to Flower (`cortex up` sets it when it "
                                   "runs Flower); no link without it")
    flower_basic_auth: SecretStr | None = Field(
        default=None, description="Flower's basic auth, user:password (several: comma-separated)")

    api_keys: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(), description="API keys and their tenants: `tenant:key,tenant:sha256:<hex>` or "
        "JSON; held only as `tenant:sha256:<hex>` (see docs/security.md)")
    api_keys_file: Path | None = Field(
        default=None, description="YAML/JSON list of {tenant, key_sha256} (or {tenant, key})")
    quotas: dict[str, Quota] = Field(
        default_factory=dict, description="token budgets by tenant, as JSON: "
        '`{"acme": {"tokens_per_day": 1000000, "tokens_per_month": 20000000}}`; a job '
        "submitted over budget is refused (HTTP 429), one that runs out ends failed "
        "(quota_exceeded)")
    allow_no_auth: bool = Field(
        default=False, description="let `cortex api` bind a non-loopback host without API keys")
    metrics_public: bool = Field(default=False, description="/metrics answers without a key")
    cors_origins: list[str] = Field(
        default_factory=list, description="browser origins allowed to call the API (CORS), as "
        'JSON: `["https://app.example.com"]`, or `["*"]` for any; none by default')

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        """A URL Cortex cannot connect with stops the process at start, naming what is wrong."""
        parse_url(value)
        return value

    @field_validator("broker_url")
    @classmethod
    def _broker_url(cls, value: str | None) -> str | None:
        if value is not None and is_redis_url(value):
            parse_url(value)
        return value

    @field_validator("tool_modules", mode="before")
    @classmethod
    def _split_modules(cls, value: Any) -> tuple[str, ...]:
        if isinstance(value, str):
            return tuple(m.strip() for m in value.split(",") if m.strip())
        return tuple(value or ())

    @field_validator("document_model", mode="before")
    @classmethod
    def _model_json(cls, value: Any) -> Any:
        """The environment gives a block as JSON text; other text is a Model's name."""
        if isinstance(value, str) and value.lstrip().startswith("{"):
            try:
                return json.loads(value)
            except ValueError as exc:
                raise ValueError(f"a model block must be a JSON object: {exc}") from None
        return value

    @field_validator("api_keys", mode="before")
    @classmethod
    def _hash_api_keys(cls, value: Any) -> tuple[str, ...]:
        return hashed_key_entries(value)

    @field_validator("flower_basic_auth")
    @classmethod
    def _user_password(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not all(
                ":" in pair and pair.split(":", 1)[0] for pair in value.get_secret_value().split(",")):
            raise ValueError("write user:password (several: comma-separated)")
        return value

    @property
    def broker(self) -> str:
        return self.broker_url or self.redis_url

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """init > environment > `.env` > settings file > secrets dir > defaults."""
        sources = [init_settings, env_settings, dotenv_settings]
        path = os.environ.get(SETTINGS_FILE_ENV)
        if path:
            sources.append(settings_file_source(settings_cls, Path(path)))
        sources.append(file_secret_settings)
        return tuple(sources)


def settings_file_source(settings_cls: type[BaseSettings], path: Path) -> PydanticBaseSettingsSource:
    """The TOML or YAML source for `path`; errors name the file (missing, wrong suffix, a key
    that is no setting)."""
    if not path.is_file():
        raise ValueError(f"{SETTINGS_FILE_ENV}={path}: no such file")
    suffix = path.suffix.lower()
    source: PydanticBaseSettingsSource
    if suffix == ".toml":
        source = TomlConfigSettingsSource(settings_cls, toml_file=path)
    elif suffix in (".yaml", ".yml"):
        source = YamlConfigSettingsSource(settings_cls, yaml_file=path)
    else:
        raise ValueError(f"{SETTINGS_FILE_ENV}={path}: write a .toml, .yaml or .yml file")
    unknown = sorted(set(source()) - set(settings_cls.model_fields))
    if unknown:
        raise ValueError(f"{path}: unknown setting(s) {', '.join(unknown)}; the keys are the "
                         f"field names without the CORTEX_ prefix, e.g. redis_url")
    return source


TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
SHA256_RE = re.compile(r"[0-9a-f]{64}")
MIN_KEY_LENGTH = 16


def hashed_key_entries(value: Any, where: str = "api_keys") -> tuple[str, ...]:
    """API key entries as `tenant:sha256:<hex>`, plaintext keys hashed on the way in.

    Takes `tenant:key` / `tenant:sha256:<hex>` strings (comma- or newline-separated), JSON of
    the same, a mapping tenant -> key(s), or a list of those strings and of
    `{tenant, key}` / `{tenant, key_sha256}` objects. Errors never quote a key."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        text = value.strip()
        if text[:1] in ("{", "["):
            try:
                return hashed_key_entries(json.loads(text), where)
            except json.JSONDecodeError:
                raise ValueError(f"{where}: not valid JSON") from None
        return hashed_key_entries([s for s in re.split(r"[,\s]+", text) if s], where)
    pairs: list[tuple[Any, Any, bool]] = []  # (tenant, key or hash, is_hash)
    if isinstance(value, dict):
        for tenant, keys in value.items():
            for key in keys if isinstance(keys, list | tuple) else [keys]:
                hashed = isinstance(key, str) and key.startswith("sha256:")
                pairs.append((tenant, key[7:] if hashed else key, hashed))
    elif isinstance(value, list | tuple):
        for n, item in enumerate(value, 1):
            if isinstance(item, str):
                tenant, sep, key = item.partition(":")
                if not sep:
                    raise ValueError(f"{where}: entry {n} is not tenant:key or tenant:sha256:<hex>")
                hashed = key.startswith("sha256:")
                pairs.append((tenant, key[7:] if hashed else key, hashed))
            elif isinstance(item, dict) and set(item) in ({"tenant", "key"}, {"tenant", "key_sha256"}):
                hashed = "key_sha256" in item
                key = item.get("key_sha256") if hashed else item.get("key")
                if hashed and isinstance(key, str) and key.startswith("sha256:"):
                    key = key[7:]
                pairs.append((item["tenant"], key, hashed))
            else:
                raise ValueError(f"{where}: entry {n} is neither tenant:key nor an object with "
                                 "exactly `tenant` and `key` (or `key_sha256`)")
    else:
        raise ValueError(f"{where}: write tenant:key entries, a mapping or a list")
    out: dict[str, str] = {}  # hash -> tenant
    for tenant, key, hashed in pairs:
        if not isinstance(tenant, str) or not TENANT_RE.fullmatch(tenant):
            raise ValueError(f"{where}: tenant names are 1-64 of A-Z a-z 0-9 _ . - "
                             f"(got {str(tenant)[:64]!r})")
        if not isinstance(key, str):
            raise ValueError(f"{where}: tenant {tenant!r}: the key must be a string")
        if hashed:
            digest = key.lower()
            if not SHA256_RE.fullmatch(digest):
                raise ValueError(f"{where}: tenant {tenant!r}: a hashed key is 64 hex digits "
                                 "(`cortex keys hash KEY` prints it)")
        else:
            if len(key) < MIN_KEY_LENGTH:
                raise ValueError(f"{where}: tenant {tenant!r}: a key of {len(key)} characters is "
                                 f"too short; use at least {MIN_KEY_LENGTH} random ones "
                                 "(`cortex keys new` makes one)")
            digest = hashlib.sha256(key.encode()).hexdigest()
        if out.setdefault(digest, tenant) != tenant:
            raise ValueError(f"{where}: the same key is given to tenants {out[digest]!r} and "
                             f"{tenant!r}")
    return tuple(f"{tenant}:sha256:{digest}" for digest, tenant in out.items())


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (read once)."""
    return Settings()
