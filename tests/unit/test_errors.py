"""One tree of errors (`cortex_worker.errors.CortexError`), and the API's one mapping to HTTP.

The error classes are found by importing every module of `cortex_worker` and `cortex_api`, so
a new error class is checked without being listed here.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

import cortex_api
import cortex_worker
from cortex_api import errors as api_errors
from cortex_api.app import create_app
from cortex_api.deps import get_store
from cortex_api.routes import sessions
from cortex_worker.errors import ActionFailed, CortexError, QuotaExceededError, SubmitError
from cortex_worker.jobs import lifecycle as jobs
from cortex_worker.llm.stream import ModelError
from cortex_worker.manifests.loader import (
    ManifestError,
    UnknownAgentError,
    UnknownWorkflowError,
    load_registry,
)
from cortex_worker.settings import Settings
from cortex_worker.store.state import SessionBusy
from cortex_worker.tools.errors import ToolError, ToolTimeout
from tests.manifest_helpers import TEST_MANIFESTS

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]

NOT_IN_THE_TREE = {
    "cortex_worker.actions.call.Deferred": "control flow: a child job records the outcome",
    "cortex_worker.llm.limits.ModelBusy": "control flow: the turn hands its thread back and "
                                          "is sent again for when a model slot is due",
    "cortex_api.limits.BodyTooLarge": "an HTTPException: it is already a 413 response",
}
"""Exception classes that are not errors of the tree, on purpose, and why."""

API_STATUS: dict[type[CortexError], int] = {
    SubmitError: 422,
    UnknownAgentError: 422,
    UnknownWorkflowError: 422,
    SessionBusy: 409,
    QuotaExceededError: 429,
}
"""What the API answers for these errors (they name what the request asked for); every other
error of the tree is a 500."""

SAMPLE_ARGUMENTS: dict[str, Any] = {
    "message": "something went wrong",
    "errors": [{"kind": "invalid", "message": "a field is invalid", "line": 2, "column": 3}],
    "kind": "invalid",
    "reason": "no field 'y'",
    "index": 1,
    "path": ["x", "y"],
    "status": 500,
    "detail": {},
    "job_id": "0123abcd",
    "write": "turn end",
    "holder": "turn fence 3",
}
"""A value for each required constructor argument of the error classes, by name."""


def _modules() -> Iterator[Any]:
    for package in (cortex_worker, cortex_api):
        yield package
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.rpartition(".")[2] != "__main__":  # runs the CLI when imported
                yield importlib.import_module(info.name)


def _exception_classes() -> list[type[Exception]]:
    """Every public Exception subclass defined in the project's modules."""
    found: dict[str, type[Exception]] = {}
    for module in _modules():
        for name, value in vars(module).items():
            if (inspect.isclass(value) and issubclass(value, Exception)
                    and value.__module__ == module.__name__ and not name.startswith("_")):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return [found[name] for name in sorted(found)]


ERROR_CLASSES = [cls for cls in _exception_classes()
                 if f"{cls.__module__}.{cls.__qualname__}" not in NOT_IN_THE_TREE]


def _id(cls: type) -> str:
    return cls.__qualname__


def sample(cls: type[CortexError]) -> CortexError:
    """An instance of `cls`, its required arguments taken from SAMPLE_ARGUMENTS by name."""
    arguments: dict[str, Any] = {}
    for parameter in inspect.signature(cls).parameters.values():
        if parameter.default is not inspect.Parameter.empty or parameter.kind in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        assert parameter.name in SAMPLE_ARGUMENTS, (
            f"{cls.__qualname__}({parameter.name}=...): add a sample value to SAMPLE_ARGUMENTS")
        arguments[parameter.name] = SAMPLE_ARGUMENTS[parameter.name]
    return cls(**arguments)


# ---------------------------------------------------------------- the tree


def test_the_walk_finds_the_errors_of_every_layer() -> None:
    names = {cls.__qualname__ for cls in ERROR_CLASSES}
    assert {"SubmitError", "ToolError", "ToolTimeout", "RelicCallError", "ModelError",
            "ManifestError", "UnknownAgentError", "SandboxError", "FeedError", "ActionError",
            "PathError", "JSONBodyError", "AuthConfigError", "StackError"} <= names
    every = {f"{cls.__module__}.{cls.__qualname__}" for cls in _exception_classes()}
    assert set(NOT_IN_THE_TREE) <= every, "an exemption names a class that no longer exists"


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=_id)
def test_every_error_derives_from_cortex_error(cls: type[Exception]) -> None:
    assert issubclass(cls, CortexError), (
        f"{cls.__module__}.{cls.__qualname__} is not a CortexError: derive it from "
        "cortex_worker.errors.CortexError (keep a second base such as ValueError if callers "
        "catch it by that), or explain in NOT_IN_THE_TREE why it is not an error")


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=_id)
def test_every_error_has_its_message(cls: type[CortexError]) -> None:
    error = sample(cls)
    assert isinstance(error.message, str) and error.message
    assert error.message in str(error)


def test_action_failures_share_a_root_and_keep_their_names() -> None:
    assert issubclass(ToolError, ActionFailed) and issubclass(ModelError, ActionFailed)
    assert not issubclass(ModelError, ToolError) and not issubclass(ToolError, ModelError)
    assert issubclass(ToolTimeout, ToolError)
    error = ToolError("exit status 2", detail="stderr")
    assert (error.message, error.detail, str(error)) == ("exit status 2", "stderr", "exit status 2")
    model = ModelError("HTTP 503", retryable=True, status=503)
    assert (model.message, model.retryable, model.status) == ("HTTP 503", True, 503)


def test_second_bases_are_kept_for_callers_that_catch_them() -> None:
    from cortex_api.auth import AuthConfigError
    from cortex_api.stack import StackError
    from cortex_worker.jobs.feeds import FeedError
    from cortex_worker.protocol.actions import ActionError
    from cortex_worker.protocol.lenient_json import JSONBodyError
    from cortex_worker.protocol.variables import PathError
    from cortex_worker.sandbox.process import SandboxError

    for cls in (SubmitError, ManifestError, FeedError, ActionError, PathError, JSONBodyError,
                AuthConfigError):
        assert issubclass(cls, ValueError), cls
    for cls in (UnknownAgentError, UnknownWorkflowError):
        assert issubclass(cls, LookupError), cls
    for cls in (SandboxError, StackError):
        assert issubclass(cls, RuntimeError), cls


def test_the_root_module_imports_nothing_from_cortex() -> None:
    import ast

    tree = ast.parse((REPO_ROOT / "cortex_worker" / "errors.py").read_text())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names]
    imported += [node.module or "." for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)]
    assert not [name for name in imported if name.startswith(("cortex", "."))], imported


# ---------------------------------------------------------------- the API's mapping


@pytest.fixture
def app() -> Any:
    """The real app, without its lifespan (so no Redis), on the test manifests."""
    return create_app(Settings(manifests=TEST_MANIFESTS))


SERVER_ERRORS = [cls for cls in ERROR_CLASSES if not cls.__module__.startswith("cortex_api.client")]
"""The errors code behind the API may raise (the client's are raised by its callers' side)."""


@pytest.mark.parametrize("cls", SERVER_ERRORS, ids=_id)
def test_the_api_maps_every_error_to_its_status(app: Any, cls: type[CortexError]) -> None:
    error = sample(cls)

    def fail() -> None:
        raise error

    app.add_api_route("/test/fail", fail)
    response = TestClient(app).get("/test/fail")
    expected = next((API_STATUS[c] for c in cls.__mro__ if c in API_STATUS), 500)
    assert response.status_code == expected, response.text
    assert api_errors.status_of(cls) == expected
    detail = response.json()["detail"]
    if isinstance(error, SubmitError):
        assert detail == {"message": "the document was rejected: line 2, column 3: "
                                     "a field is invalid", "errors": error.errors}
    else:
        assert detail == {"message": error.message}


@pytest.fixture
def client(app: Any, monkeypatch: pytest.MonkeyPatch) -> TestClient:
    """POST /v1/jobs and /v1/sessions up to the point where a job would be stored."""
    registry = load_registry(TEST_MANIFESTS)
    monkeypatch.setattr(jobs, "get_registry", lambda: registry)
    monkeypatch.setattr(sessions, "get_registry", lambda: registry)
    app.dependency_overrides[get_store] = lambda: None  # every request here fails before
    return TestClient(app)


def test_an_unknown_agent_is_422(client: TestClient) -> None:
    for path, body in (("/v1/jobs", {"agent": "nobody", "input": "hi"}),
                       ("/v1/sessions", {"agent": "nobody"})):
        response = client.post(path, json=body)
        assert response.status_code == 422, response.text
        message = response.json()["detail"]["message"]
        assert message.startswith("unknown agent 'nobody'; known agents: analyzer, blocked, ")
        assert response.json() == {"detail": {"message": message}}


def test_a_rejected_workflow_is_422_with_its_errors(client: TestClient) -> None:
    response = client.post("/v1/jobs", json={"workflow": "diamond", "inputs": {"x": "three"}})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert detail["message"] == ("the workflow was rejected: workflow 'diamond': inputs.x: "
                                 "'three' is not of type 'integer'")
    assert [(e["kind"], e["path"]) for e in detail["errors"]] == [("invalid_inputs", "inputs.x")]
    response = client.post("/v1/jobs", json={"workflow": "ghost", "inputs": {}})
    assert response.status_code == 422
    assert response.json()["detail"]["message"].startswith(
        "the workflow was rejected: no workflow named 'ghost' (registered: diamond, ")


def test_a_rejected_document_is_422_with_the_first_error_and_its_position(
        client: TestClient) -> None:
    one = '<action id="a">{"name": "ghost", "parameters": {}}</action>'
    response = client.post("/v1/jobs", json={"protocol": one})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    (error,) = detail["errors"]
    assert detail["message"] == (f"the document was rejected: line {error['line']}, column "
                                 f"{error['column']}: {error['message']}")
    two = one + '\n<action id="b">{"name": "ghost", "parameters": {}}</action>'
    detail = client.post("/v1/jobs", json={"protocol": two}).json()["detail"]
    assert len(detail["errors"]) == 2 and detail["message"].endswith(" (and 1 more)")
    assert list(detail) == ["message", "errors"]


def test_a_broken_manifest_is_a_500_in_the_same_shape(client: TestClient,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> Any:
        raise ManifestError("m/agents.yaml: agents[0]: name: Field required")

    monkeypatch.setattr(sessions, "get_registry", broken)
    response = client.post("/v1/sessions", json={"agent": "tester"})
    assert response.status_code == 500
    assert response.json() == {
        "detail": {"message": "m/agents.yaml: agents[0]: name: Field required"}}
