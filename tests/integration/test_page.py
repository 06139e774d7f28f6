"""The pages: the job page `GET /jobs/{id}` and the jobs dashboard `GET /jobs`. Served as HTML,
404 for unknown jobs, and live in a real headless Chromium (Debian's, driven over the DevTools
protocol; see tests/browser.py): the generation row, Markdown that cannot inject anything,
action panels, the approve and cancel buttons, the dashboard's live filters, all with API keys.

`CORTEX_TEST_SCREENSHOTS=<dir>` keeps the screenshots the tests take."""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import harness
from tests.browser import BrowserUnavailable, Chromium, ensure_chromium
from tests.fake_llm import FakeLLM
from tests.harness import wait_until
from tests.integration.test_agents import act, final, turn, unique
from tests.integration.test_documents import action, follow, submit

SCREENSHOT_DIR_ENV = "CORTEX_TEST_SCREENSHOTS"
SCRIPTS = ("common.js", "markdown.js", "job.js", "jobs.js")
KEY = secrets.token_urlsafe(16)
FLOWER = "http://127.0.0.1:5555/"


@pytest.fixture
def api(workers: Any, api: Any) -> Any:
    return api


@pytest.fixture(scope="module")
def keyed_api(workers: Any, cortex_env: dict[str, str], harness_dir: Path) -> Iterator[harness.Process]:
    """An API of its own with a key (tenant `ops`) and a Flower URL; the session's has neither."""
    env = {**cortex_env, "CORTEX_API_KEYS": f"ops:{KEY}", "CORTEX_FLOWER_URL": FLOWER}
    with harness.api_running(env, log_dir=harness_dir, cwd=harness_dir) as proc:
        yield proc


@pytest.fixture
def ops(keyed_api: harness.Process) -> Iterator[httpx.Client]:
    """A client of `keyed_api` with the key."""
    with httpx.Client(base_url=keyed_api.url, headers={"X-API-Key": KEY}, timeout=30) as client:
        yield client


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
    assert json.loads(_config(page.text))["job_id"] == job_id
    for name in SCRIPTS:  # every string goes in as text: no HTML is ever parsed
        asset = httpx.get(f"{api.url}/page/{name}", timeout=10)
        assert asset.status_code == 200
        assert asset.headers["content-type"].startswith("text/javascript")
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
            assert sink not in asset.text, (name, sink)
    css = httpx.get(f"{api.url}/page/job.css", timeout=10)
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
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
window.__cx = {statuses: [], conns: [], runningBar: false, loadedAt: null, completedAt: null};
document.addEventListener('DOMContentLoaded', () => {
  window.__cx.loadedAt = performance.now();
  const check = () => {
    const badge = document.getElementById('job-status');
    const seen = window.__cx.statuses;
    if (badge && seen[seen.length - 1] !== badge.textContent) seen.push(badge.textContent);
    const conn = document.getElementById('conn');
    const conns = window.__cx.conns;
    if (conn && conns[conns.length - 1] !== conn.textContent) conns.push(conn.textContent);
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
        # the page followed the job live on one event stream, to its end: never dropped,
        # never reconnecting, never disconnected
        conns = page.evaluate("window.__cx.conns")
        assert conns[-1] == "ended" and not {"reconnecting…", "disconnected"} & set(conns), conns
        assert not [m for m in page.console if m.startswith("exception")], page.console
        shot = page.screenshot(tmp_path / "job-page.png")
        assert shot.stat().st_size > 10_000
        _keep(running_shot, shot)
    finally:
        page.close()


def _keep(*shots: Path) -> None:
    """Copy screenshots to `CORTEX_TEST_SCREENSHOTS`, when it is set."""
    value = os.environ.get(SCREENSHOT_DIR_ENV)
    if not value:
        return
    keep = Path(value)
    keep.mkdir(parents=True, exist_ok=True)
    for shot in shots:
        (keep / shot.name).write_bytes(shot.read_bytes())


# -- the Markdown of responses -------------------------------------------------------------

# What a response may carry that must neither run nor survive as markup: a script element, an
# event handler attribute, javascript: and data: links (one spelled with a tab, which browsers
# drop when they read a scheme), an image (the page loads nothing a response names).
HOSTILE = ("<script>window.__pwned = 'script'</script>\n"
           "<img src=x onerror=\"window.__pwned = 'onerror'\">\n\n"
           "[click me](javascript:window.__pwned='link') [tab](java\tscript:window.__pwned='tab') "
           "[data](data:text/html,<script>window.__pwned='data'</script>) ![pic](https://example.com/p.png)")
MARKDOWN = ("## Report\n\nAll **good**, *mostly*: `x < y` and [docs](https://example.com/docs).\n\n"
            "- one\n- two\n  - nested\n\n1. first\n2. second\n\n> quoted\n\n"
            "| a | b |\n|---|---|\n| 1 | 2 |\n\n```python\nprint('<b>hi</b>')\n```\n")

RENDER = """(() => {
  const box = document.createElement('div');
  box.appendChild(CortexMarkdown.render(%s));
  document.body.appendChild(box);
  const tags = [...box.querySelectorAll('*')].map(n => n.tagName.toLowerCase());
  const attrs = [...box.querySelectorAll('*')].flatMap(n => [...n.attributes].map(a => a.name + '=' + a.value));
  const out = {tags: tags, attrs: attrs, text: box.textContent};
  box.remove();
  return out;
})()"""


def test_markdown_renders_and_nothing_in_it_runs(api: Any, chromium: Chromium) -> None:
    job_id = submit(api, action("a", "echo", {"message": "hi"})).json()["id"]
    page = chromium.open(f"{api.url}/jobs/{job_id}")
    try:
        page.wait_for("window.CortexMarkdown !== undefined", timeout=10)
        good = page.evaluate(RENDER % json.dumps(MARKDOWN))
        for tag in ("h2", "strong", "em", "code", "a", "ul", "ol", "li", "blockquote", "table",
                    "th", "td", "pre"):
            assert tag in good["tags"], (tag, good["tags"])
        assert "href=https://example.com/docs" in good["attrs"]
        assert good["tags"].count("ul") == 2  # the nested list
        assert "print('<b>hi</b>')" in good["text"] and "b" not in good["tags"]

        bad = page.evaluate(RENDER % json.dumps(HOSTILE))
        assert set(bad["tags"]) <= {"p", "a"}, bad["tags"]
        assert [a for a in bad["attrs"] if a.startswith("href=")] == ["href=https://example.com/p.png"]
        assert not [a for a in bad["attrs"] if a.startswith("on") or a.startswith("src")]
        assert "<script>window.__pwned = 'script'</script>" in bad["text"]  # shown, as text
        assert "onerror=" in bad["text"] and "click me" in bad["text"]
        time.sleep(0.2)  # an image's onerror would have fired by now
        assert page.evaluate("window.__pwned === undefined")
    finally:
        page.close()
    follow(api, job_id)


# -- approving, cancelling (with an API key) -----------------------------------------------

def card(action_id: str, selector: str = "") -> str:
    """JS: the element `selector` in the panel of action `action_id` (or the panel)."""
    return f"document.querySelector('.card[data-id=\"{action_id}\"] {selector}'.trim())"


def test_an_agent_job_page_approves_and_shows_generation_and_markdown(
        keyed_api: harness.Process, ops: httpx.Client, chromium: Chromium, fake_llm: FakeLLM,
        tmp_path: Path) -> None:
    model = unique("page")
    fake_llm.script(model, [
        turn("<thought>Deploy web-1, then report how it went.</thought>\n"
             + act("d", "deploy", {"target": "web-1"}), tokens_per_second=80),
        turn(final("## Deployed\n\nAll **good**:\n\n- `web-1` is up\n"
                   "- see [the log](https://example.com/log)\n\n```\nstatus: ok\n```"),
             tokens_per_second=80),
    ])
    created = ops.post("/v1/jobs", json={"agent": "tester", "input": "Deploy web-1.",
                                         "options": {"model": model}})
    assert created.status_code == 202, created.text
    job_id = created.json()["id"]
    page = chromium.open(f"{keyed_api.url}/jobs/{job_id}?api_key={KEY}")
    try:
        page.wait_for(card("d", ".approval button.approve") + " !== null", timeout=20)
        assert json.loads(page.evaluate(card("d", "pre.params") + ".textContent")) == {"target": "web-1"}
        assert page.evaluate(card("d", ".note-inline") + ".textContent") == "after substitution"
        waiting = page.screenshot(tmp_path / "job-page-approval.png")
        page.evaluate("(() => { const box = " + card("d", ".approval") + "; "
                      "box.querySelector('input').value = 'go ahead'; "
                      "box.querySelector('button.approve').click(); })()")
        page.wait_for("document.getElementById('job-status').textContent === 'completed'",
                      timeout=20)
        page.wait_for(card("d") + ".dataset.status === 'ok'", timeout=5)
        assert page.evaluate(card("d", ".approval") + " === null")
        assert page.evaluate(card("d", "dd[data-field=approved]") + ".textContent") \
            == "by tenant ops: go ahead"
        assert page.evaluate(card("d", "dd[data-field=worker]") + ".textContent")
        assert "1 attempt" in page.evaluate(card("d", ".facts") + ".textContent")
        assert "web-1" in page.evaluate(card("d", "pre.result") + ".textContent")
        # the model's generation: a bar per turn, on its own lane above the actions'
        lanes = page.evaluate("[...document.querySelectorAll('#gantt .lane-label')].map(t => t.textContent)")
        assert lanes == ["model", "tool"]
        turns = page.evaluate("[...document.querySelectorAll('#gantt rect.bar.model')].map(r => r.dataset.id)")
        assert turns == ["turn 1", "turn 2"]
        # the final response, as Markdown
        rendered = "document.querySelector('#stream .response.rendered')"
        assert page.evaluate(rendered + ".querySelector('h2').textContent") == "Deployed"
        assert page.evaluate(rendered + ".querySelector('strong').textContent") == "good"
        assert page.evaluate(rendered + ".querySelector('a').getAttribute('href')") \
            == "https://example.com/log"
        assert page.evaluate(rendered + ".querySelector('pre').textContent") == "status: ok"
        assert not [m for m in page.console if m.startswith("exception")], page.console
        _keep(waiting, page.screenshot(tmp_path / "job-page-agent.png"))
    finally:
        page.close()


#: Runs before the page's scripts: its EventSource connects only when `releaseStreams()` is
#: called, so a test can let the job's view (GET) arrive first, as a slow stream does.
HELD_STREAMS = """(() => {
  const Real = window.EventSource, held = [];
  window.releaseStreams = () => { for (const open of held.splice(0)) open(); };
  class Held {
    constructor(url) {
      this.readyState = 0; this.listeners = [];
      held.push(() => {
        const real = this.real = new Real(url);
        for (const [type, fn] of this.listeners) real.addEventListener(type, fn);
        real.onmessage = this.onmessage; real.onopen = this.onopen; real.onerror = this.onerror;
      });
    }
    addEventListener(type, fn) { this.listeners.push([type, fn]); }
    close() { if (this.real) this.real.close(); }
  }
  Held.CLOSED = 2;
  window.EventSource = Held;
})();"""


def test_the_approve_button_waits_for_the_parameters_it_approves(
        keyed_api: harness.Process, ops: httpx.Client, chromium: Chromium, fake_llm: FakeLLM) -> None:
    model = unique("page")
    fake_llm.script(model, [turn(act("d", "deploy", {"target": "web-2"})),
                            turn(final("done"))])
    job_id = ops.post("/v1/jobs", json={"agent": "tester", "input": "Deploy web-2.",
                                        "options": {"model": model}}).json()["id"]
    wait_until(lambda: [a["status"] for a in ops.get(f"/v1/jobs/{job_id}").json()["actions"]]
               == ["awaiting_approval"], timeout=20)
    page = chromium.open(f"{keyed_api.url}/jobs/{job_id}?api_key={KEY}", init_script=HELD_STREAMS)
    try:
        # The job's view says "awaiting approval" but has no parameters: no button yet.
        page.wait_for(card("d") + "?.dataset.status === 'awaiting_approval'", timeout=10)
        assert page.evaluate(card("d", ".approval") + " === null")
        page.evaluate("releaseStreams()")
        page.wait_for(card("d", ".approval button.approve") + " !== null", timeout=10)
        assert json.loads(page.evaluate(card("d", "pre.params") + ".textContent")) == {"target": "web-2"}
        assert not [m for m in page.console if m.startswith("exception")], page.console
    finally:
        page.close()
        ops.post(f"/v1/jobs/{job_id}/cancel")


def test_the_cancel_button_cancels_a_running_job(keyed_api: harness.Process, ops: httpx.Client,
                                                 chromium: Chromium) -> None:
    job_id = ops.post("/v1/jobs", json={"protocol": action("nap", "sleep", {"seconds": 30})}).json()["id"]
    page = chromium.open(f"{keyed_api.url}/jobs/{job_id}?api_key={KEY}")
    try:
        page.wait_for(card("nap") + "?.dataset.status === 'running'", timeout=15)
        page.evaluate("document.getElementById('cancel').click()")
        assert page.evaluate("document.getElementById('cancel').textContent") == "Click again to cancel"
        assert ops.get(f"/v1/jobs/{job_id}").json()["status"] == "running"  # one click: nothing
        page.evaluate("document.getElementById('cancel').click()")
        page.wait_for("document.getElementById('job-status').textContent === 'cancelled'",
                      timeout=15)
        assert ops.get(f"/v1/jobs/{job_id}").json()["status"] == "cancelled"
        page.wait_for(card("nap") + ".dataset.status === 'cancelled'", timeout=5)
        assert page.evaluate("document.getElementById('cancel').hidden")
    finally:
        page.close()


# -- the jobs dashboard --------------------------------------------------------------------

def test_the_job_list_has_kind_agent_and_action_counts(api: Any) -> None:
    job_id = submit(api, action("a", "echo", {"message": 1}) + action("b", "fail", {})).json()["id"]
    follow(api, job_id)
    listed = httpx.get(f"{api.url}/v1/jobs?limit=200", timeout=10).json()["items"]
    mine = next(item for item in listed if item["id"] == job_id)
    assert (mine["kind"], mine["agent"], mine["status"]) == ("document", None, "failed")
    assert mine["counts"] == {"ok": 1, "error": 1, "total": 2}
    assert httpx.get(f"{api.url}/v1/jobs?agent=nobody", timeout=10).json()["items"] == []
    page = httpx.get(f"{api.url}/jobs", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert json.loads(_config(page.text)) == {"flower_url": None}  # no Flower link


ROWS = "[...document.querySelectorAll('#rows tr')].map(r => r.dataset.id + ' ' + r.dataset.status)"


def test_the_dashboard_lists_and_filters_jobs_live(keyed_api: harness.Process, ops: httpx.Client,
                                                   chromium: Chromium, fake_llm: FakeLLM,
                                                   tmp_path: Path) -> None:
    assert httpx.get(f"{keyed_api.url}/jobs", timeout=10).status_code == 401  # a key is needed
    model = unique("dashboard")
    fake_llm.script(model, [turn(act("e", "echo", {"message": "hi"})), turn(final("Done."))])
    agent_job = ops.post("/v1/jobs", json={"agent": "tester", "input": "Say hi.",
                                           "options": {"model": model}}).json()["id"]
    failing = ops.post("/v1/jobs", json={"protocol": action("f", "fail", {})}).json()["id"]
    page = chromium.open(f"{keyed_api.url}/jobs?api_key={KEY}")
    try:
        page.wait_for(f"{ROWS}.includes('{agent_job} completed')", timeout=15)
        assert page.evaluate("document.getElementById('flower').href") == FLOWER
        assert not page.evaluate("document.getElementById('flower').hidden")
        # a job submitted while the page is open shows up, and its status moves on, live
        napping = ops.post("/v1/jobs", json={"protocol": action("nap", "sleep", {"seconds": 3})
                                             + action("e", "echo", {"message": "x"})}).json()["id"]
        page.wait_for(f"{ROWS}.includes('{napping} running')", timeout=10)
        running = page.screenshot(tmp_path / "dashboard-running.png")
        page.wait_for(f"{ROWS}.includes('{napping} completed')", timeout=10)
        row = f"document.querySelector('#rows tr[data-id=\"{napping}\"]')"
        assert page.evaluate(row + ".querySelector('[data-field=kind]').textContent") == "document"
        assert page.evaluate(row + ".querySelector('[data-field=actions]').textContent") == "2 · 2 ok"
        assert page.evaluate(row + ".querySelector('a').getAttribute('href')") \
            == f"jobs/{napping}?api_key={KEY}"
        agent_row = f"document.querySelector('#rows tr[data-id=\"{agent_job}\"]')"
        assert page.evaluate(agent_row + ".querySelector('[data-field=agent]').textContent") == "tester"
        shot = page.screenshot(tmp_path / "dashboard.png")
        # filters: by agent, then by status (and in the URL, for a reload or a link)
        page.wait_for("[...document.getElementById('agent').options].some(o => o.value === 'tester')")
        choose(page, "agent", "tester")
        page.wait_for(f"{ROWS}.includes('{agent_job} completed')", timeout=5)
        agents = page.evaluate("[...document.querySelectorAll('#rows [data-field=agent]')].map(c => c.textContent)")
        assert set(agents) == {"tester"}
        choose(page, "agent", "")
        choose(page, "status", "failed")
        page.wait_for(f"{ROWS}.includes('{failing} failed')", timeout=5)
        assert all(r.endswith(" failed") for r in page.evaluate(ROWS))
        assert page.evaluate("location.search") == f"?api_key={KEY}&status=failed"
        assert not [m for m in page.console if m.startswith("exception")], page.console
        _keep(running, shot)
    finally:
        page.close()


def choose(page: Any, select: str, value: str) -> None:
    """Pick `value` in the dashboard's `select`, as a person would."""
    page.evaluate(f"(() => {{ const s = document.getElementById('{select}'); s.value = '{value}'; "
                  "s.dispatchEvent(new Event('change')); })()")


def _config(text: str) -> str:
    return text.split('<script type="application/json" id="cx-config">')[1].split("</script>")[0]
