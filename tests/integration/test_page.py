"""The job page, `GET /jobs/{id}`: served as HTML, 404 for unknown jobs, and live in a real
headless Chromium (Debian's, driven over the DevTools protocol; see tests/browser.py)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.browser import BrowserUnavailable, Chromium, ensure_chromium
from tests.harness import wait_until
from tests.integration.test_documents import action, follow, submit

SCREENSHOT_DIR_ENV = "CORTEX_TEST_SCREENSHOTS"


@pytest.fixture
def api(workers: Any, api: Any) -> Any:
    return api


@pytest.fixture(scope="module")
def chromium(harness_dir: Path) -> Iterator[Chromium]:
    try:
        executable = ensure_chromium()
    except BrowserUnavailable as exc:
        pytest.skip(f"no headless Chromium: {exc}")
    with Chromium(executable, log_dir=harness_dir) as browser:
        yield browser


def test_page_is_html_and_assets_are_served(api: Any) -> None:
    response = submit(api, action("a", "echo", {"message": "hi"}))
    job_id = response.json()["id"]
    page = httpx.get(f"{api.url}/jobs/{job_id}", timeout=10)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert f"<code id=\"job-id\">{job_id}</code>" in page.text
    config = page.text.split('<script type="application/json" id="cx-config">')[1].split("</script>")[0]
    assert json.loads(config)["job_id"] == job_id
    for name, kind in (("job.js", "text/javascript"), ("job.css", "text/css")):
        asset = httpx.get(f"{api.url}/page/{name}", timeout=10)
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
    assert "innerHTML" not in httpx.get(f"{api.url}/page/job.js", timeout=10).text
    assert httpx.get(f"{api.url}/page/nope.js", timeout=10).status_code == 404
    follow(api, job_id)


def test_unknown_job_is_a_404_page(api: Any) -> None:
    response = httpx.get(f"{api.url}/jobs/<img src=x>", timeout=10)
    assert response.status_code == 404
    assert response.headers["content-type"].startswith("text/html")
    assert "Job not found" in response.text
    assert "<img" not in response.text and "&lt;img src=x&gt;" in response.text


# ~3.5 s: `a` and `c` sleep; `c` is a sync barrier (so `d` waits for it: a dashed edge) and
# depends on `a`; `b` echoes markup that must show as text.
LIVE_DOC = (
    "<thought>Plan: sleep, echo, then report.</thought>\n"
    + action("nap_a", "sleep", {"seconds": 1.5})
    + action("echo_b", "echo", {"message": "<b>not bold</b>"})
    + action("nap_c", "sleep", {"seconds": 1.5}, mode="sync", depends_on=["nap_a"])
    + action("echo_d", "echo", {"message": "after the barrier"})
    + '<response final="true">b said: $echo_b</response>\n'
)

# Records, inside the page, every status the badge shows and whether a bar was seen running
# (the test polls over DevTools, which could miss a short state on a busy machine).
RECORDER = """
window.__cx = {statuses: [], runningBar: false, loadedAt: null, completedAt: null};
document.addEventListener('DOMContentLoaded', () => {
  window.__cx.loadedAt = performance.now();
  const check = () => {
    const badge = document.getElementById('job-status');
    const seen = window.__cx.statuses;
    if (badge && seen[seen.length - 1] !== badge.textContent) seen.push(badge.textContent);
    if (badge && badge.textContent === 'completed' && window.__cx.completedAt === null)
      window.__cx.completedAt = performance.now();
    if (document.querySelector('#gantt rect.bar.s-running')) window.__cx.runningBar = true;
  };
  new MutationObserver(check).observe(document.body, {subtree: true, childList: true,
                                                      characterData: true, attributes: true});
  check();
});
"""


def test_live_page_in_chromium(api: Any, chromium: Chromium, tmp_path: Path) -> None:
    response = submit(api, LIVE_DOC)
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    wait_until(lambda: httpx.get(f"{api.url}/v1/jobs/{job_id}", timeout=5).json()["status"]
               == "running", timeout=10)
    started = time.monotonic()
    page = chromium.open(f"{api.url}/jobs/{job_id}", init_script=RECORDER)
    try:
        page.wait_for("document.readyState === 'complete'", timeout=10)
        # the DAG shows every action by name, wave by wave
        names = page.wait_for("""(() => {
            const ids = [...document.querySelectorAll('#dag g.node')].map(g => g.dataset.id);
            return ids.length === 4 ? ids : null; })()""", timeout=10)
        assert sorted(names) == ["echo_b", "echo_d", "nap_a", "nap_c"]
        dag_text = page.evaluate("document.getElementById('dag').textContent")
        assert "sleep" in dag_text and "echo" in dag_text
        page.wait_for("document.querySelector('#gantt rect.bar') !== null", timeout=10)
        running_shot = page.screenshot(tmp_path / "job-page-running.png")
        # live: the page showed a bar growing, then the job completed
        page.wait_for("window.__cx.completedAt !== null", timeout=15)
        recorded = page.evaluate("window.__cx")
        assert recorded["statuses"][-1] == "completed", recorded
        live_for = (recorded["completedAt"] - recorded["loadedAt"]) / 1000
        if live_for > 2.0:  # a sleep was running for a while after the page loaded
            assert recorded["runningBar"], recorded
        else:  # a very busy machine: the page loaded when the job was nearly done
            print(f"the job completed {live_for:.1f}s after the page loaded: too soon to "
                  "require a running bar")
        # the final state
        page.wait_for("document.getElementById('job-status').textContent === 'completed'",
                      timeout=15)
        elapsed = time.monotonic() - started
        page.wait_for("document.querySelectorAll('#gantt rect.bar').length === 4", timeout=5)
        bars = page.evaluate("""[...document.querySelectorAll('#gantt rect.bar')].map(r => ({
            id: r.dataset.id, status: r.dataset.status, x: +r.getAttribute('x'),
            w: +r.getAttribute('width')}))""")
        assert {b["status"] for b in bars} == {"ok"}
        by_id = {b["id"]: b for b in bars}
        assert by_id["nap_c"]["x"] >= by_id["nap_a"]["x"] + by_id["nap_a"]["w"] - 1  # c after a
        lanes = page.evaluate("[...document.querySelectorAll('#gantt .lane-label')].map(t => t.textContent)")
        assert lanes == ["tool"]
        edges = page.evaluate("""({solid: document.querySelectorAll('#dag path.edge:not(.after)').length,
                                   dashed: document.querySelectorAll('#dag path.edge.after').length})""")
        assert edges["solid"] >= 1 and edges["dashed"] >= 1, edges
        # thoughts and the rendered response, as text (the markup was not interpreted)
        stream = page.evaluate("document.getElementById('stream').textContent")
        assert "Plan: sleep, echo, then report." in stream
        assert "b said: <b>not bold</b>" in stream
        assert page.evaluate("document.querySelector('#stream b') === null")
        assert page.evaluate("document.getElementById('conn').textContent") == "ended"
        assert not [m for m in page.console if m.startswith("exception")], page.console
        shot = page.screenshot(tmp_path / "job-page.png")
        assert shot.stat().st_size > 10_000
        keep = _screenshot_dir()
        if keep is not None:
            for path in (running_shot, shot):
                (keep / path.name).write_bytes(path.read_bytes())
        assert elapsed < 20
    finally:
        page.close()


def _screenshot_dir() -> Path | None:
    value = os.environ.get(SCREENSHOT_DIR_ENV)
    if not value:
        return None
    path = Path(value)
    path.mkdir(parents=True, exist_ok=True)
    return path
