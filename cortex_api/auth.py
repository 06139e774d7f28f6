"""API keys and tenants.

A key maps to a tenant; keys are held only as sha256 digests (`tenant:sha256:<hex>`, see
`cortex_worker.settings.hashed_key_entries`), from `CORTEX_API_KEYS` and/or the file named by
`CORTEX_API_KEYS_FILE`. A request names its key in `Authorization: Bearer <key>` or
`X-API-Key: <key>`; the event stream (and the job page) also take `?api_key=`, since a browser's
EventSource cannot set headers. With no key configured there is one tenant, `default`, nothing is
checked, and `cortex api` binds only a loopback address unless told otherwise
(`check_binding`). See docs/security.md.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import yaml
from fastapi import Depends, HTTPException, Request
from fastapi.security import APIKeyHeader, APIKeyQuery, HTTPAuthorizationCredentials, HTTPBearer

from cortex_worker.errors import CortexError
from cortex_worker.jobs.record import DEFAULT_TENANT
from cortex_worker.settings import Settings, hashed_key_entries

QUERY_PARAM = "api_key"


class AuthConfigError(CortexError, ValueError):
    """Keys that cannot be loaded, or a binding that would expose an API without keys."""


def hash_key(key: str) -> str:
    """The stored form of a key: `sha256:<hex>` (keys are random, so no salt or HMAC)."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def load_keys_file(path: Path) -> tuple[str, ...]:
    """Entries of a keys file: a YAML or JSON list of `{tenant, key_sha256}` (or `{tenant,
    key}`) objects or `tenant:sha256:<hex>` strings, or a mapping tenant -> key(s)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise AuthConfigError(f"CORTEX_API_KEYS_FILE={path}: {exc.strerror or exc}") from None
    except yaml.YAMLError:
        raise AuthConfigError(f"CORTEX_API_KEYS_FILE={path}: not valid YAML or JSON") from None
    if isinstance(data, dict) and set(data) == {"keys"}:
        data = data["keys"]
    try:
        return hashed_key_entries(data, where=str(path))
    except ValueError as exc:
        raise AuthConfigError(str(exc)) from None


class KeyRing:
    """sha256 digests of the valid keys and their tenants; never a plaintext key."""

    def __init__(self, entries: Iterable[str] = ()) -> None:
        self._entries: list[tuple[bytes, str]] = []
        owners: dict[str, str] = {}
        for entry in entries:
            tenant, _, digest = entry.rpartition(":sha256:")
            if owners.setdefault(digest, tenant) != tenant:
                raise AuthConfigError(f"the same key is given to tenants {owners[digest]!r} "
                                      f"and {tenant!r}")
            self._entries.append((bytes.fromhex(digest), tenant))

    @classmethod
    def from_settings(cls, settings: Settings) -> KeyRing:
        """The keys of `settings.api_keys` and of `settings.api_keys_file`."""
        entries = list(settings.api_keys)
        if settings.api_keys_file is not None:
            entries += load_keys_file(settings.api_keys_file)
        return cls(dict.fromkeys(entries))

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tenants(self) -> list[str]:
        return sorted({tenant for _, tenant in self._entries})

    def authenticate(self, key: str) -> str | None:
        """The key's tenant, or None. Compares digests in constant time, against every entry."""
        digest = hashlib.sha256(key.encode()).digest()
        found = None
        for known, tenant in self._entries:
            if hmac.compare_digest(digest, known):
                found = tenant
        return found

    def __repr__(self) -> str:
        return f"KeyRing({len(self)} keys, tenants={self.tenants})"


# -- binding ------------------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    if host.strip("[]").lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_binding(host: str, keyring: KeyRing, allow_no_auth: bool) -> None:
    """Refuse to serve without keys on anything but loopback, unless explicitly allowed."""
    if keyring or allow_no_auth or is_loopback(host):
        return
    raise AuthConfigError(
        f"refusing to serve the API on {host} without API keys: anyone who can reach it could "
        "run and read every job. Configure keys (CORTEX_API_KEYS or CORTEX_API_KEYS_FILE; "
        "`cortex keys new TENANT` makes one), bind 127.0.0.1, or pass --insecure-no-auth "
        "(CORTEX_ALLOW_NO_AUTH=1) if something in front of it already authenticates.")


class RedactQueryKey:
    """A logging filter: `api_key=<key>` in uvicorn's access log lines becomes `api_key=***`."""

    pattern = re.compile(rf"([?&]{QUERY_PARAM}=)[^&\s\"]*")

    def filter(self, record: Any) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(self.pattern.sub(r"\1***", a) if isinstance(a, str) else a
                                for a in record.args)
        return True


# -- request dependencies -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Caller:
    """Who is asking. `enforced` is False when no keys are configured: then everything
    belongs to the one tenant, `default`, and the global job index is listed."""

    tenant: str
    enforced: bool

    def owns(self, tenant: str | None) -> bool:
        """May the caller see a job or session whose `tenant` field is this?"""
        return not self.enforced or (tenant or DEFAULT_TENANT) == self.tenant

    @property
    def index(self) -> str | None:
        """The tenant whose job index to list; None: every job (no keys configured)."""
        return self.tenant if self.enforced else None


_bearer = HTTPBearer(auto_error=False, description="`Authorization: Bearer <API key>`")
_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="the API key")
_query = APIKeyQuery(name=QUERY_PARAM, auto_error=False,
                     description="the API key, for EventSource (which cannot set headers); "
                                 "prefer a header: URLs end up in logs and browser history")


def unauthorized(message: str, invalid: bool) -> HTTPException:
    challenge = 'Bearer realm="cortex"' + (', error="invalid_token"' if invalid else "")
    return HTTPException(401, detail={"message": message},
                         headers={"WWW-Authenticate": challenge})


def _resolve(request: Request, key: str | None) -> Caller:
    keyring: KeyRing = request.app.state.keyring
    if not keyring:
        return Caller(DEFAULT_TENANT, enforced=False)
    if not key:
        raise unauthorized("an API key is required: send `Authorization: Bearer <key>` or "
                           "`X-API-Key: <key>`", invalid=False)
    tenant = keyring.authenticate(key)
    if tenant is None:
        raise unauthorized("invalid API key", invalid=True)
    return Caller(tenant, enforced=True)


async def caller(
    request: Request,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    header: Annotated[str | None, Depends(_header)],
) -> Caller:
    """The caller of a request that names its key in a header; 401 if keys are configured
    and it names none, or an unknown one."""
    return _resolve(request, bearer.credentials if bearer else header)


async def stream_caller(
    request: Request,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    header: Annotated[str | None, Depends(_header)],
    query: Annotated[str | None, Depends(_query)],
) -> Caller:
    """`caller`, also accepting `?api_key=`: only for the event stream and the job page."""
    return _resolve(request, bearer.credentials if bearer else header or query)


async def metrics_guard(request: Request,
                        bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
                        header: Annotated[str | None, Depends(_header)]) -> None:
    """For `/metrics`: a key is required when keys are configured, unless `metrics_public`."""
    if not request.app.state.settings.metrics_public:
        _resolve(request, bearer.credentials if bearer else header)


CallerDep = Annotated[Caller, Depends(caller)]
StreamCallerDep = Annotated[Caller, Depends(stream_caller)]
#: For routers whose endpoints need a key but not the tenant (registry, validate).
require_key = Depends(caller)
