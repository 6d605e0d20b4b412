"""The status page (GET /) in headless Chromium against a live orchestrator and simulated agents.

Reads need a token here, so the page first shows its sign-in box; after a viewer token is
entered it shows every node in its rack and NVLink domain. A PSU fault is injected for real (the
victim's agent restarted with ``--fault psu_imbalance@0``) and the page shows the node DEGRADED
with its reason within two refreshes of the orchestrator deciding it, and the victim's own page
(a click on its card) its GPUs and its history of transitions. A job runs on the victim and
its NVLink neighbour (stand-in ranks the agents launch, registered as the trainer library
registers, tests/fixtures/jobs/rank.py): before the fault its plan carries nobody, after it the
page shows the neighbour's rank carrying the victim's (the restarted agent re-attaches to its
rank, agent/launcher.py); the ranks report steps through the trainer library, and the job's row
shows a step rate and loss and MFU trends. A screenshot goes to the
test's folder (and to docs/status-page.png with ``PULSE_SCREENSHOT_TO_DOCS=1``: the one the
README shows). Then /docs, served offline, lists ``POST /v1/jobs``.

The grid is drawn from the nodes' summaries, two a request here (``PULSE_STATUS_PAGE_NODES=2``):
every refresh pages through ``GET /v1/nodes?fields=summary`` following each answer's ``next``, and
a node's hardware in full (``GET /v1/nodes/{name}``) is read only once its page is opened, for
that node alone.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis

from tests.browser import chromium, missing
from tests.stack import AUTH, Stack
from tests.support import REDIS_URL, REPO, http, stop, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]
T = TypeVar("T")

# Longer than the page may take to show a change: only the event stream, which wakes a refresh at
# once, gets it there in time (the timed refresh is what events do not carry: heartbeat ages).
REFRESH_S = 15.0
NODES_PAGE = 2  # PULSE_STATUS_PAGE_NODES: the grid of 4 nodes is two pages
# rack -> NVLink domain -> nodes
TOPOLOGY = {"rack-a": {"nvl-a0": ["sp-a0", "sp-a1"], "nvl-a1": ["sp-a2"]}, "rack-b": {"nvl-b0": ["sp-b0"]}}
NODES = sorted(n for doms in TOPOLOGY.values() for ns in doms.values() for n in ns)
VICTIM = "sp-a1"
NEIGHBOUR = "sp-a0"  # the victim's NVLink domain: the job's other node
RANK = str(REPO / "tests" / "fixtures" / "jobs" / "rank.py")
STEP_EVERY_S = 0.5  # the stand-in ranks report a step this often (trainer library's TrainerReporter)


def _labels(node: str) -> list[str]:
    for rack, doms in TOPOLOGY.items():
        for dom, nodes in doms.items():
            if node in nodes:
                return ["--label", f"rack={rack}", "--label", f"nvlink_domain={dom}", "--gpus", "4"]
    raise KeyError(node)


def _states(stack: Stack) -> dict[str, str]:
    r = http().get(f"{stack.api}/v1/nodes", headers=AUTH, timeout=5)
    r.raise_for_status()
    return {n["name"]: n["state"] for n in r.json()["data"]}


@pytest.fixture
def browser() -> Iterator[Any]:
    if (why := missing()) is not None:
        pytest.skip(why)
    with chromium() as driver:
        yield driver


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    r = redis.Redis.from_url(REDIS_URL)
    r.flushdb()
    s = Stack(
        tmp_path,
        PULSE_AUTH_READS="true",
        PULSE_STATUS_REFRESH_S=str(REFRESH_S),
        PULSE_RECOVER_AFTER="2",
        PULSE_STATUS_PAGE_NODES=str(NODES_PAGE),
        # the victim's agent is restarted with its fault: its start on a loaded machine is no silence
        PULSE_DEGRADED_AFTER_S="15",
    )
    try:
        s.orchestrator()
        for node in NODES:
            s.agent(node, *_labels(node))
        wait_for(lambda: _states(s) == dict.fromkeys(NODES, "HEALTHY"), timeout=60, what="every node HEALTHY")
        yield s
    finally:
        s.close()
        r.flushdb()
        r.close()


def _page_states(driver: Any) -> dict[str, str]:
    from selenium.webdriver.common.by import By

    return {
        e.get_attribute("data-node"): e.get_attribute("data-state")
        for e in driver.find_elements(By.CSS_SELECTOR, "[data-node]")
    }


def _stable(read: Callable[[], T]) -> T:
    """``read()`` of the page, again while an element it holds was replaced under it: every
    refresh re-renders the sections, and an event wakes one at any moment."""
    from selenium.common.exceptions import StaleElementReferenceException

    for _ in range(50):
        try:
            return read()
        except StaleElementReferenceException:
            time.sleep(0.05)
    return read()


def _node_reads(driver: Any) -> list[tuple[str, dict[str, list[str]]]]:
    """The path and query of every request the page made under /v1/nodes, in order."""
    from urllib.parse import parse_qs, urlsplit

    urls = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    parts = [urlsplit(u) for u in urls]
    return [(p.path, parse_qs(p.query)) for p in parts if p.path.startswith("/v1/nodes")]


def _plan(stack: Stack, job: str) -> dict[str, Any] | None:
    """The job's plan in force, or None while not every rank has registered (409)."""
    r = http().get(f"{stack.api}/v1/jobs/{job}/plan", headers=AUTH, timeout=5)
    if r.status_code == 409:
        return None
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


def _cell(driver: Any, job: str, cls: str) -> str:
    from selenium.webdriver.common.by import By

    cells = driver.find_elements(By.CSS_SELECTOR, f"[data-job='{job}'] .{cls}")
    return str(cells[0].text).strip() if cells else ""


def _spark_points(driver: Any, job: str, cls: str) -> int:
    from selenium.webdriver.common.by import By

    lines = driver.find_elements(By.CSS_SELECTOR, f"[data-job='{job}'] .{cls} svg.spark")
    return int(lines[0].get_attribute("data-points") or 0) if lines else 0


def test_status_page_signs_in_shows_the_grid_a_psu_fault_and_its_carrier(
    stack: Stack, browser: Any, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    viewer = stack.post("/v1/tokens", {"name": "page-viewer", "role": "viewer"})
    assert viewer.status_code == 201, viewer.text
    secret = viewer.json()["secret"]

    browser.get(f"{stack.api}/")
    browser.execute_script("performance.setResourceTimingBufferSize(100000)")  # every request of the test
    wait_for(lambda: browser.find_element(By.ID, "signin").is_displayed(), timeout=20, what="the sign-in box")
    assert not browser.find_element(By.ID, "content").is_displayed()
    browser.find_element(By.ID, "token").send_keys(secret)
    browser.find_element(By.ID, "signin-submit").click()
    wait_for(
        lambda: _page_states(browser) == dict.fromkeys(NODES, "HEALTHY"), timeout=20, what="every node on the page"
    )
    assert secret not in browser.current_url
    assert browser.execute_script("return sessionStorage.getItem('pulse-token')") == secret
    for rack, doms in TOPOLOGY.items():
        for dom, nodes in doms.items():
            cards = browser.find_elements(By.CSS_SELECTOR, f"[data-rack='{rack}'] [data-domain='{dom}'] [data-node]")
            assert sorted(c.get_attribute("data-node") for c in cards) == sorted(nodes), (rack, dom)
    # the grid came from summaries, two a request, each page after the one before: never in full
    reads = _node_reads(browser)
    summary = {"fields": ["summary"], "limit": [str(NODES_PAGE)]}
    assert reads and all(path == "/v1/nodes" for path, _ in reads), reads
    pages = [q for _, q in reads]
    assert summary in pages and {**summary, "after": [NODES[1]]} in pages, reads
    assert all(q in (summary, {**summary, "after": [NODES[1]]}) for q in pages), reads

    # a job on the victim and its neighbour; every rank registered: generation 1 carries nobody
    spec = {
        "name": "page-job", "nodes": 2, "gpus_per_node": 1, "selector": {"nvlink_domain": "nvl-a0"},
        "entrypoint": [RANK, "--seconds", "600", "--step-every", str(STEP_EVERY_S)],
    }  # fmt: skip
    created = stack.post("/v1/jobs", spec)
    assert created.status_code == 201, created.text
    job = created.json()["id"]
    assert sorted(created.json()["assigned_nodes"]) == [NEIGHBOUR, VICTIM]
    wait_for(lambda: _plan(stack, job), timeout=60, what=f"job {job}'s first plan")
    plan = _plan(stack, job)
    assert plan is not None and plan["proxies"] == {} and plan["excluded"] == [], plan
    ranks = {node: int(r) for r, node in plan["ranks"].items()}
    wait_for(
        lambda: "nobody carried" in _cell(browser, job, "job-plan"), timeout=REFRESH_S * 2, what="the plan on the page"
    )

    stop(stack.procs[VICTIM])  # the same node comes back with its PS2 sagging 12 A
    stack.agent(VICTIM, *_labels(VICTIM), "--fault", "psu_imbalance@0")
    wait_for(lambda: _states(stack)[VICTIM] == "DEGRADED", timeout=30, what=f"{VICTIM} DEGRADED in the API")
    decided = time.monotonic()
    # Woken by the stream: well before the next timed refresh (a busy 2-core machine included).
    wait_for(lambda: _page_states(browser)[VICTIM] == "DEGRADED", timeout=REFRESH_S / 2, what="DEGRADED on the page")
    shown_after = time.monotonic() - decided
    card = _stable(lambda: browser.find_element(By.CSS_SELECTOR, f"[data-node='{VICTIM}']").text)
    assert "PSU current imbalance" in card and "DEGRADED" in card, card
    assert {n: s for n, s in _stable(lambda: _page_states(browser)).items() if n != VICTIM} == dict.fromkeys(
        set(NODES) - {VICTIM}, "HEALTHY"
    )
    # the plan that follows: the neighbour's rank carries the victim's, and the page says so
    wait_for(lambda: (_plan(stack, job) or {}).get("proxies"), timeout=30, what="a plan with a carrier")
    carried = _plan(stack, job)
    assert carried is not None and carried["proxies"] == {str(ranks[VICTIM]): ranks[NEIGHBOUR]}, carried
    says = f"rank {ranks[NEIGHBOUR]} ({NEIGHBOUR}) carries rank {ranks[VICTIM]} ({VICTIM})"
    wait_for(lambda: says in _cell(browser, job, "job-plan"), timeout=REFRESH_S / 2, what=f"{says!r} on the page")
    assert f"generation {carried['generation']}" in _stable(lambda: _cell(browser, job, "job-plan"))
    # the job's figures: a step rate no faster than its ranks step, and loss and MFU trends
    wait_for(lambda: _cell(browser, job, "job-rate") not in ("", "-"), timeout=REFRESH_S * 2, what="a step rate")
    assert 0 < float(_stable(lambda: _cell(browser, job, "job-rate"))) <= 1.1 / STEP_EVERY_S
    wait_for(
        lambda: min(_spark_points(browser, job, f) for f in ("job-loss", "job-mfu")) >= 2,
        timeout=REFRESH_S * 2,
        what="loss and MFU trends of two samples or more",
    )
    browser.save_screenshot(str(tmp_path / "status-page.png"))
    if os.environ.get("PULSE_SCREENSHOT_TO_DOCS") == "1":
        shutil.copyfile(tmp_path / "status-page.png", REPO / "docs" / "status-page.png")

    # the victim's own page: its GPUs in full and its history of transitions, newest first
    assert {path for path, _ in _node_reads(browser)} == {"/v1/nodes"}  # no node's detail before it is opened
    browser.find_element(By.CSS_SELECTOR, f"[data-node='{VICTIM}'] a.node-name").click()
    wait_for(
        lambda: browser.find_elements(By.CSS_SELECTOR, "#node-history [data-transition]"),
        timeout=REFRESH_S / 2,
        what=f"{VICTIM}'s history",
    )
    assert not browser.find_element(By.ID, "overview").is_displayed()
    assert _stable(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#node-page [data-gpu]"))) == 4
    states = {e.get_attribute("data-state") for e in browser.find_elements(By.CSS_SELECTOR, "#node-page [data-gpu]")}
    assert states == {"HEALTHY"}, states  # the PSU fault is the node's: no GPU has one of its own
    history = _stable(
        lambda: [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#node-history [data-transition]")]
    )
    r = http().get(f"{stack.api}/v1/events", params={"node": VICTIM}, headers=AUTH, timeout=5)
    api = [e for e in r.json()["data"] if e["to_state"]]
    assert len(history) == len(api) and "→ DEGRADED" in history[0] and "PSU current imbalance" in history[0], history
    browser.save_screenshot(str(tmp_path / "node-page.png"))
    details = {path for path, _ in _node_reads(browser)} - {"/v1/nodes"}
    assert details == {f"/v1/nodes/{VICTIM}"}, details  # the opened node's detail, and no other's
    browser.find_element(By.LINK_TEXT, "← all nodes").click()
    wait_for(lambda: browser.find_element(By.ID, "overview").is_displayed(), timeout=REFRESH_S / 2, what="the grid")
    print(f"DEGRADED on the page {shown_after:.2f}s after the orchestrator decided it")

    browser.get(f"{stack.api}/docs")
    wait_for(
        lambda: any(
            e.text.strip() == "/v1/jobs"
            for e in browser.find_elements(By.CSS_SELECTOR, ".opblock-post .opblock-summary-path")
        ),
        timeout=30,
        what="POST /v1/jobs listed on /docs",
    )
