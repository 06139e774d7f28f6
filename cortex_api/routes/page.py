"""The pages: the jobs dashboard `GET /jobs` and the job page `GET /jobs/{id}` (plain HTML, JS
and CSS from cortex_api/page/, no build step, nothing fetched from elsewhere).

The dashboard polls `GET /v1/jobs` (jobs.js). The job page reads `GET /v1/jobs/{id}` once and
follows `GET /v1/jobs/{id}/events` (job.js). The dashboard links to Flower when
`CORTEX_FLOWER_URL` (the setting `flower_url`) names it.
"""

from __future__ import annotations

import html
import json
import logging
from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

from cortex_api.auth import StreamCallerDep
from cortex_api.deps import SettingsDep, StoreDep
from cortex_worker.handles import get_registry
from cortex_worker.protocol.events import ACTION_TERMINAL, JOB_TERMINAL, EventType

log = logging.getLogger("cortex.api.page")

router = APIRouter(tags=["page"], include_in_schema=False)

#: The words job.js reads a job's events and statuses by (protocol.events), in its config.
VOCABULARY = {"event_types": list(EventType), "terminal_jobs": sorted(JOB_TERMINAL),
              "terminal_actions": sorted(ACTION_TERMINAL)}
JS = "text/javascript; charset=utf-8"
ASSETS = {"job.js": JS, "jobs.js": JS, "common.js": JS, "markdown.js": JS,
          "job.css": "text/css; charset=utf-8"}


@cache
def _asset(name: str) -> str:
    return (resources.files("cortex_api") / "page" / name).read_text(encoding="utf-8")


def _docker_tools() -> list[str]:
    """Tools that run on the docker pool (the page draws them on that lane)."""
    try:
        return sorted(name for name, spec in get_registry().tools.items() if spec.runtime == "docker")
    except Exception as exc:  # the page still works, with docker tools on the tool lane
        log.warning("job page: cannot read the registry: %s", exc)
        return []


def _json_for_script(value: object) -> str:
    """JSON safe inside <script> (no `</script>`, no `<!--`)."""
    return json.dumps(value).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


@router.get("/jobs", response_class=HTMLResponse)
def jobs_dashboard(caller: StreamCallerDep, settings: SettingsDep) -> HTMLResponse:
    """The caller's jobs, live: status, kind, agent, times and action counts, filtered by
    status and agent; each links to its job page."""
    config = _json_for_script({"flower_url": settings.flower_url})
    return HTMLResponse(_asset("jobs.html").replace("{{CONFIG}}", config),
                        headers={"Cache-Control": "no-store"})


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(job_id: str, store: StoreDep, caller: StreamCallerDep) -> HTMLResponse:
    """One job, live: header, thoughts and responses, the action DAG and a timeline.

    Another tenant's job is "not found", like a job that does not exist."""
    job = store.peek(job_id, "tenant")
    if job is None or not caller.owns(job.tenant):
        return HTMLResponse(_not_found(job_id), status_code=404)
    text = _asset("job.html")
    config = _json_for_script({"job_id": job_id, "docker_tools": _docker_tools(), **VOCABULARY})
    text = text.replace("{{CONFIG}}", config).replace("{{JOB_ID}}", html.escape(job_id))
    return HTMLResponse(text, headers={"Cache-Control": "no-store"})


@router.get("/page/{name}")
def page_asset(name: str) -> Response:
    if name not in ASSETS:
        return Response("not found", status_code=404, media_type="text/plain")
    return Response(_asset(name), media_type=ASSETS[name],
                    headers={"Cache-Control": "public, max-age=300"})


def _not_found(job_id: str) -> str:
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<title>Cortex · job not found</title>"
            "<link rel=\"stylesheet\" href=\"../page/job.css\"></head><body><header>"
            "<div class=\"title\"><span class=\"brand\">Cortex</span><h1>Job not found</h1></div>"
            f"<p>No job <code>{html.escape(job_id)}</code>: it is unknown, or it expired after "
            "its retention period.</p></header></body></html>\n")
