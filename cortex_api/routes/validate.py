"""Check a protocol document without running it, as submitting it would."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from cortex_api.auth import require_key
from cortex_api.deps import SettingsDep
from cortex_api.errors import responses
from cortex_api.limits import check_document_size
from cortex_api.models import ValidateRequest
from cortex_worker.jobs.lifecycle import document_report
from cortex_worker.protocol.document import load_document

router = APIRouter(prefix="/v1", tags=["validate"], dependencies=[require_key])


@router.post("/validate", responses=responses(413))
def validate(body: ValidateRequest, settings: SettingsDep) -> dict[str, Any]:
    """The document's parse, plan and problems: the `cortex validate --json` report. Its
    `errors` are those `POST /v1/jobs` would reject it for: parse and plan errors, and targets
    this deployment's manifests do not declare or whose parameters they reject.

    200 even when the document has errors: they are in `errors` (and `warnings`).
    """
    check_document_size(body.protocol, settings)
    return document_report(load_document(body.protocol))
