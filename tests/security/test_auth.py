"""API keys and tenants, end to end: an API started with keys (env and a hashed keys file),
the session's workers (which do no auth) and Redis."""

from __future__ import annotations

import hashlib
import json
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from cortex_api.auth import AuthConfigError, KeyRing, check_binding
from cortex_worker.settings import Settings
from tests import harness

KEY_A = "alpha-" + secrets.token_urlsafe(24)  # plaintext in CORTEX_API_KEYS
KEY_B = "beta-" + secrets.token_urlsafe(24)  # given hashed in CORTEX_API_KEYS
KEY_C = "gamma-" + secrets.token_urlsafe(24)  # hashed, in the keys file
KEY_D = "delta-" + secrets.token_urlsafe(24)  # plaintext, in the keys file
ALL_KEYS = (KEY_A, KEY_B, KEY_C, KEY_D)
A, B, C = ({"Authorization": f"Bearer {KEY_A}"}, {"X-API-Key": KEY_B},
           {"Authorization": f"Bearer {KEY_C}"})


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    path.write_text(f"- tenant: gamma\n  key_sha256: {sha(KEY_C)}\n"
                    f"- tenant: delta\n  key: {KEY_D}\n")
    return path


@pytest.fixture(scope="module")
def keyed_env(cortex_env: dict[str, str], keys_file: Path) -> dict[str, str]:
    return {**cortex_env, "CORTEX_API_KEYS": f"alpha:{KEY_A},beta:sha256:{sha(KEY_B)}",
            "CORTEX_API_KEYS_FILE": str(keys_file)}


@pytest.fixture(scope="module")
def api(keyed_env: dict[str, str], harness_dir: Path) -> Iterator[harness.Process]:
    proc = harness.start_api(keyed_env, log_dir=harness_dir, cwd=harness_dir)
    try:
        yield proc
    finally:
        proc.stop()


def submit(api: Any, headers: dict[str, str], protocol: str) -> str:
    response = httpx.post(f"{api.url}/v1/jobs", json={"protocol": protocol}, headers=headers,
                          timeout=30)
    assert response.status_code == 202, response.text
    return response.json()["id"]


def events(api: Any, job_id: str, headers: dict[str, str] | None = None,
           params: dict[str, str] | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    with httpx.stream("GET", f"{api.url}/v1/jobs/{job_id}/events", headers=headers or {},
                      params=params, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data:"):
                out.append(json.loads(line[5:]))
                if limit is not None and len(out) >= limit:
                    break
    return out


def action(ident: str, name: str, params: dict[str, Any]) -> str:
    return (f'<action type="tool" mode="async" id="{ident}">'
            f'{json.dumps({"name": name, "parameters": params})}</action>\n')


def listed(api: Any, headers: dict[str, str]) -> list[str]:
    response = httpx.get(f"{api.url}/v1/jobs", params={"limit": 200}, headers=headers)
    assert response.status_code == 200, response.text
    return [item["id"] for item in response.json()["items"]]


# -- authentication -----------------------------------------------------------------------
def test_missing_or_wrong_key_is_401(api: Any) -> None:
    assert httpx.get(f"{api.url}/healthz").status_code == 200
    assert httpx.get(f"{api.url}/readyz", timeout=10).status_code in (200, 503)  # open, not 401
    for method, path in [("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", "/v1/jobs/x"),
                         ("POST", "/v1/jobs/x/cancel"), ("GET", "/v1/jobs/x/events"),
                         ("POST", "/v1/sessions"), ("GET", "/v1/sessions/x"),
                         ("GET", "/v1/agents"), ("GET", "/v1/tools"), ("GET", "/v1/workflows"),
                         ("POST", "/v1/validate"), ("GET", "/metrics")]:
        body = {"protocol": "<response>hi</response>"} if method == "POST" else None
        missing = httpx.request(method, api.url + path, json=body)
        assert missing.status_code == 401, (path, missing.text)
        assert missing.headers["WWW-Authenticate"].startswith("Bearer"), path
        assert "Authorization: Bearer" in missing.json()["detail"]["message"]
        for wrong in ({"Authorization": f"Bearer {KEY_A}x"}, {"X-API-Key": "not-a-key"},
                      {"Authorization": f"Bearer {sha(KEY_A)}"}):  # the digest is no key
            response = httpx.request(method, api.url + path, json=body, headers=wrong)
            assert response.status_code == 401, (path, wrong, response.text)
            assert response.json()["detail"]["message"] == "invalid API key"
            assert 'error="invalid_token"' in response.headers["WWW-Authenticate"]
    # the query parameter is for the event stream only
    assert httpx.get(f"{api.url}/v1/jobs", params={"api_key": KEY_A}).status_code == 401
    for headers in (A, B, C, {"X-API-Key": KEY_D}):
        assert httpx.get(f"{api.url}/v1/agents", headers=headers).status_code == 200
    validated = httpx.post(f"{api.url}/v1/validate", headers=A,
                           json={"protocol": "<response>hi</response>"})
    assert validated.status_code == 200, validated.text
    assert httpx.get(f"{api.url}/metrics", headers=B).status_code == 200


def test_metrics_can_be_public(cortex_env: dict[str, str]) -> None:
    from fastapi.testclient import TestClient

    from cortex_api.app import create_app

    settings = Settings(redis_url=cortex_env["CORTEX_REDIS_URL"],
                        manifests=Path(cortex_env["CORTEX_MANIFESTS"]),
                        api_keys=f"alpha:sha256:{sha(KEY_A)}", metrics_public=True)
    with TestClient(create_app(settings)) as client:
        assert client.get("/metrics").status_code == 200
        assert client.get("/v1/agents").status_code == 401
        assert client.get("/v1/agents", headers=A).status_code == 200


# -- tenants ------------------------------------------------------------------------------
def test_another_tenants_job_is_404_everywhere(api: Any) -> None:
    job_id = submit(api, A, action("nap", "sleep", {"seconds": 30}))
    unknown = "0" * 32
    assert job_id in listed(api, A) and job_id not in listed(api, B)
    assert httpx.get(f"{api.url}/v1/jobs/{job_id}", headers=A).status_code == 200
    for path, method in [("", "GET"), ("/cancel", "POST"), ("/events", "GET")]:
        theirs = httpx.request(method, f"{api.url}/v1/jobs/{job_id}{path}", headers=B)
        nothing = httpx.request(method, f"{api.url}/v1/jobs/{unknown}{path}", headers=B)
        assert theirs.status_code == nothing.status_code == 404, (path, theirs.text)
        # the same answer as for a job that does not exist: existence is not revealed
        assert (theirs.json()["detail"]["message"].replace(job_id, "ID")
                == nothing.json()["detail"]["message"].replace(unknown, "ID"))
    by_query = httpx.get(f"{api.url}/v1/jobs/{job_id}/events", params={"api_key": KEY_B})
    assert by_query.status_code == 404
    # the owner's stream works with the query parameter (EventSource cannot send headers)
    first = events(api, job_id, params={"api_key": KEY_A}, limit=1)
    assert first[0]["type"] == "job_queued"
    status = httpx.get(f"{api.url}/v1/jobs/{job_id}", headers=A).json()["status"]
    assert status in ("queued", "running")  # beta's cancel did nothing
    assert httpx.post(f"{api.url}/v1/jobs/{job_id}/cancel", headers=A).status_code == 200


def test_sessions_are_per_tenant(api: Any) -> None:
    created = httpx.post(f"{api.url}/v1/sessions", headers=A, json={"agent": "tester"})
    assert created.status_code == 201, created.text
    session_id = created.json()["id"]
    assert httpx.get(f"{api.url}/v1/sessions/{session_id}", headers=A).status_code == 200
    assert httpx.get(f"{api.url}/v1/sessions/{session_id}", headers=B).status_code == 404
    posted = httpx.post(f"{api.url}/v1/sessions/{session_id}/messages", headers=B,
                        json={"content": "let me in"})
    assert posted.status_code == 404, posted.text
    assert httpx.get(f"{api.url}/v1/sessions/{session_id}", headers=A).json()["messages"] == []
    posted = httpx.post(f"{api.url}/v1/sessions/{session_id}/messages", headers=A,
                        json={"content": "hello"})
    assert posted.status_code == 202, posted.text
    job_id = posted.json()["id"]  # the session's job is the session's tenant's
    assert httpx.get(f"{api.url}/v1/jobs/{job_id}", headers=A).status_code == 200
    assert httpx.get(f"{api.url}/v1/jobs/{job_id}", headers=B).status_code == 404
    assert job_id in listed(api, A) and job_id not in listed(api, B)
    httpx.post(f"{api.url}/v1/jobs/{job_id}/cancel", headers=A)


def test_hashed_keys_from_a_file_work(api: Any) -> None:
    job_id = submit(api, C, "<response>gamma's</response>")
    assert job_id in listed(api, C)
    assert job_id not in listed(api, A)
    assert httpx.get(f"{api.url}/v1/jobs/{job_id}", headers=C).status_code == 200
    assert httpx.get(f"{api.url}/v1/jobs/{job_id}", headers={"X-API-Key": KEY_D}).status_code == 404


def test_child_jobs_inherit_the_tenant(api: Any, workers: Any) -> None:
    response = httpx.post(f"{api.url}/v1/jobs", headers=A,
                          json={"workflow": "nested", "inputs": {"n": 2}})
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    log = events(api, job_id, headers=A)
    assert log[-1]["type"] == "job_completed", log[-1]
    children = [e["data"]["job_id"] for e in log if e["type"] == "child_job"]
    assert children, [e["type"] for e in log]
    for child in children:
        assert httpx.get(f"{api.url}/v1/jobs/{child}", headers=A).status_code == 200
        assert httpx.get(f"{api.url}/v1/jobs/{child}", headers=B).status_code == 404
        assert child in listed(api, A) and child not in listed(api, B)


def test_references_never_cross_jobs(api: Any, workers: Any) -> None:
    secret = "TOPSECRET-" + secrets.token_hex(8)
    a_job = submit(api, A, action("vault", "echo", {"message": secret})
                   + "<response>alpha: $vault</response>")
    a_log = events(api, a_job, headers=A)
    assert a_log[-1]["type"] == "job_completed"
    assert any(secret in e["data"].get("text", "") for e in a_log if e["type"] == "response_end")
    # beta names alpha's action: a warning (names nothing known), left as written
    doc = (action("probe", "echo", {"message": "got $vault"})
           + "<response>beta: $vault ${vault}</response>")
    b_job = submit(api, B, doc)
    b_log = events(api, b_job, headers=B)
    assert b_log[-1]["type"] in ("job_completed", "job_failed")
    assert secret not in json.dumps(b_log)
    texts = [e["data"]["text"] for e in b_log if e["type"] == "response_end"]
    assert texts == ["beta: $vault ${vault}"]
    assert secret not in httpx.get(f"{api.url}/v1/jobs/{b_job}", headers=B).text


# -- keys are held hashed -----------------------------------------------------------------
def test_keys_are_held_hashed(keys_file: Path, api: Any, redis_client: redis.Redis,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORTEX_API_KEYS", f"alpha:{KEY_A},beta:sha256:{sha(KEY_B)}")
    settings = Settings(api_keys_file=keys_file)
    ring = KeyRing.from_settings(settings)
    for text in (repr(settings), str(settings), settings.model_dump_json(), repr(ring)):
        assert not any(key in text for key in ALL_KEYS)
    assert f"alpha:sha256:{sha(KEY_A)}" in settings.api_keys
    assert [ring.authenticate(k) for k in ALL_KEYS] == ["alpha", "beta", "gamma", "delta"]
    assert ring.authenticate("alpha-wrong") is None
    with pytest.raises(ValueError) as info:  # errors name the problem, never the keys
        Settings(api_keys=f"alpha:{KEY_A},beta:short")
    assert KEY_A not in str(info.value) and "too short" in str(info.value)
    # Redis holds no key: dump every value the API and workers wrote
    submit(api, A, "<response>one more</response>")
    keys = list(redis_client.scan_iter(count=1000))
    assert keys
    for key in keys:
        text = key + repr(dump(redis_client, key))
        assert not any(k in text for k in ALL_KEYS), key


def dump(client: redis.Redis, key: str) -> Any:
    kind = client.type(key)
    if kind == "string":
        return client.get(key)
    if kind == "hash":
        return client.hgetall(key)
    if kind == "list":
        return client.lrange(key, 0, -1)
    if kind == "set":
        return client.smembers(key)
    if kind == "zset":
        return client.zrange(key, 0, -1)
    if kind == "stream":
        return client.xrange(key)
    return ""


# -- binding without keys -----------------------------------------------------------------
def test_no_keys_refuses_a_public_host(cortex_env: dict[str, str], tmp_path: Path) -> None:
    port = harness.free_port()
    done = subprocess.run([*harness.cortex_command(), "api", "--host", "0.0.0.0",
                           "--port", str(port)], env=cortex_env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    out = " ".join((done.stdout + done.stderr).split())
    assert "refusing to serve the API on 0.0.0.0 without API keys" in out
    assert "--insecure-no-auth" in out
    empty = KeyRing()
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        check_binding(host, empty, allow_no_auth=False)
    check_binding("0.0.0.0", empty, allow_no_auth=True)  # --insecure-no-auth / CORTEX_ALLOW_NO_AUTH
    check_binding("0.0.0.0", KeyRing([f"alpha:sha256:{sha(KEY_A)}"]), allow_no_auth=False)
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.com"):
        with pytest.raises(AuthConfigError):
            check_binding(host, empty, allow_no_auth=False)
    assert Settings(allow_no_auth="1").allow_no_auth  # type: ignore[arg-type]


def test_without_keys_everything_is_tenant_default(cortex_env: dict[str, str],
                                                   harness_dir: Path) -> None:
    with harness.start_api(cortex_env, log_dir=harness_dir, cwd=harness_dir) as open_api:
        job_id = submit(open_api, {}, "<response>open</response>")
        assert httpx.get(f"{open_api.url}/v1/jobs/{job_id}").status_code == 200
        assert job_id in listed(open_api, {})
        assert httpx.get(f"{open_api.url}/v1/agents").status_code == 200
    client = redis.Redis.from_url(cortex_env["CORTEX_REDIS_URL"], decode_responses=True)
    try:
        assert client.hget(f"cx:{{{job_id}}}:job", "tenant") == "default"
        assert client.zscore("cx:jobs:default", job_id) is not None
    finally:
        client.close()


def test_event_stream_key_is_not_logged(api: Any) -> None:
    job_id = submit(api, A, "<response>logged?</response>")
    events(api, job_id, params={"api_key": KEY_A}, limit=1)
    time.sleep(0.2)
    assert job_id in api.log_text() and KEY_A not in api.log_text()
