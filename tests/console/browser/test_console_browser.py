"""The console in a real browser (ADR 0020): Debian's chromium driven by Playwright against a
real ``ql3 console``, a real ``ql3 serve`` node and a real worker on PostgreSQL, seeded by really
running work. The gate test closes the dispatch gate and so runs last."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from axe_playwright_python.sync_playwright import Axe
from playwright.sync_api import Browser, BrowserContext, Page, expect

from ql3.domain.policy import RetryPolicy, Safety
from tests.console.browser.conftest import PASSWORDS, PREFIX, SCREENSHOTS, ConsoleProcess
from tests.e2e.conftest import Cluster, wait_for

pytestmark = pytest.mark.postgres

IDEMPOTENT = RetryPolicy(retry_on_lost=True, max_attempts=1, safety=Safety.IDEMPOTENT)
XSS = "<script>alert(1)</script>"
# A task no worker of this module takes: its runs stay queued.
IDLE_TASK = "held.double"
SERIOUS = {"serious", "critical"}


@pytest.fixture
def viewer(browser: Browser) -> Iterator[BrowserContext]:
    context = browser.new_context(
        viewport={"width": 1280, "height": 900},
        http_credentials={"username": "vera", "password": PASSWORDS["vera"]},
    )
    try:
        yield context
    finally:
        context.close()


def _finished(cluster: Cluster, run_id: str) -> None:
    cluster.wait_status([run_id], {"succeeded", "failed", "cancelled"}, timeout=30)


def test_find_a_failed_run_by_filter_and_read_its_traceback(
    page: Page, console: ConsoleProcess, cluster: Cluster
) -> None:
    failed = cluster.submit(f"{PREFIX}.fail", {"message": "the disk is full"})
    cluster.submit(f"{PREFIX}.double", {"n": 2})
    _finished(cluster, failed)
    page.goto(console.url + "/runs")
    page.get_by_label("failed").check()
    page.get_by_label("Task").fill(f"{PREFIX}.fail")
    page.get_by_role("button", name="Filter", exact=True).click()
    expect(page).to_have_url(re.compile(r"status=failed"))
    page.get_by_role("link", name=failed).click()
    expect(page.locator('[data-status="failed"]')).to_be_visible()
    error = page.locator('[data-field="error"]')
    expect(error).to_contain_text("RuntimeError")
    expect(error).to_contain_text("the disk is full")
    expect(error).to_contain_text("Traceback (most recent call last)")
    expect(error).to_contain_text('raise RuntimeError(payload.get("message", "boom"))')


def test_cancel_a_queued_run(page: Page, console: ConsoleProcess, cluster: Cluster) -> None:
    queued = cluster.submit(IDLE_TASK, {"n": 1})
    page.goto(f"{console.url}/runs/{queued}")
    expect(page.locator('[data-status="queued"]')).to_be_visible()
    page.get_by_role("button", name="Cancel run").click()
    expect(page.locator(".done")).to_have_text(f"cancelled run {queued} (was queued)")
    assert cluster.status(queued) == "cancelled"
    assert cluster.show(queued)["error"] == "[console: otto] cancelled by operator"


def test_bulk_cancel_by_filter_after_its_preview(
    page: Page, console: ConsoleProcess, cluster: Cluster
) -> None:
    queued = [cluster.submit("bulk.double", {"n": n}) for n in range(3)]
    page.goto(console.url + "/runs?task=bulk.double&status=queued")
    expect(page.locator(".count")).to_have_text("3 run(s) match.")
    page.get_by_role("button", name="Preview for everything the filter matches").click()
    expect(page.locator(".preview")).to_have_attribute("data-count", "3")
    assert {cluster.status(run_id) for run_id in queued} == {"queued"}
    page.get_by_role("button", name="Cancel them").click()
    expect(page.locator('.progress[data-state="finished"]')).to_contain_text(
        "3 done, 0 skipped, 0 failed of 3 previewed", timeout=20_000
    )
    assert {cluster.status(run_id) for run_id in queued} == {"cancelled"}
    page.goto(console.url + "/bulk")
    expect(page.locator("main table")).to_contain_text("otto")


def test_run_a_failed_idempotent_run_again_and_see_both_linked(
    page: Page, console: ConsoleProcess, cluster: Cluster
) -> None:
    old = cluster.submit(f"{PREFIX}.flaky", {"failures": 1}, IDEMPOTENT)
    _finished(cluster, old)
    assert cluster.status(old) == "failed"
    page.goto(f"{console.url}/runs/{old}")
    page.get_by_label("Input of the new run (JSON)").fill('{"failures": 0}')
    page.get_by_role("button", name="Run again").click()
    expect(page.locator(".done")).to_contain_text(f"run {old} runs again as")
    page.locator("a.next").click()
    expect(page.locator("a.again-of")).to_have_text(old)
    new = page.url.rsplit("/", 1)[1]
    _finished(cluster, new)
    assert cluster.status(new) == "succeeded"
    page.goto(f"{console.url}/runs/{old}")
    expect(page.locator("a.again")).to_have_text(new)


def test_a_run_finishing_while_its_page_is_open_updates_live(
    page: Page, console: ConsoleProcess, cluster: Cluster
) -> None:
    run_id = cluster.submit(f"{PREFIX}.sleep", {"seconds": 3})
    cluster.wait_status([run_id], {"running"}, timeout=20)
    page.goto(f"{console.url}/runs/{run_id}")
    expect(page.locator('[data-status="running"]')).to_be_visible()
    expect(page.locator("body")).to_have_attribute("data-live", "connected")
    # No reload: the event stream says the store changed, and the region refreshes itself.
    expect(page.locator('[data-status="succeeded"]')).to_be_visible(timeout=15_000)


def test_a_viewer_sees_no_buttons(
    viewer: BrowserContext, console: ConsoleProcess, cluster: Cluster
) -> None:
    queued = cluster.submit(IDLE_TASK, {"n": 2})
    page = viewer.new_page()
    for path in ["/", "/runs", f"/runs/{queued}", "/tasks", "/workers"]:
        page.goto(console.url + path)
        expect(page.locator("form[method=post]")).to_have_count(0)
        expect(
            page.get_by_role("button", name=re.compile("Cancel|Quarantine|Run again"))
        ).to_have_count(0)
    expect(page.locator(".who")).to_have_text("vera (viewer)")


def test_a_script_in_an_input_shows_as_text_and_runs_nothing(
    page: Page, console: ConsoleProcess, cluster: Cluster
) -> None:
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    run_id = cluster.submit(IDLE_TASK, {"note": XSS})
    for path in [f"/runs/{run_id}", "/runs"]:
        page.goto(console.url + path)
    page.goto(f"{console.url}/runs/{run_id}")
    expect(page.locator('[data-field="input"]')).to_contain_text(XSS)
    page.wait_for_timeout(500)
    assert dialogs == []
    assert page.evaluate("document.querySelectorAll('main script').length") == 0


def _pages(cluster: Cluster, console: ConsoleProcess) -> list[str]:
    workflow = cluster.container.core.workflows().submit(
        {
            "name": "nightly-report",
            "steps": [
                {"id": "extract", "task": f"{PREFIX}.double", "input": {"n": 1}},
                {
                    "id": "transform",
                    "task": f"{PREFIX}.double",
                    "input": {"n": 2},
                    "after": ["extract"],
                },
                {
                    "id": "audit",
                    "task": f"{PREFIX}.double",
                    "input": {"n": 3},
                    "after": ["extract"],
                },
                {
                    "id": "load",
                    "task": f"{PREFIX}.double",
                    "input": {"n": 4},
                    "after": ["transform", "audit"],
                },
            ],
        }
    )
    _finished(cluster, workflow)
    # A trigger for the triggers page (the second call finds it there already).
    cluster.ql3("triggers", "add", "nightly", "--task", f"{PREFIX}.double", "--cron", "0 3 * * *")
    failed = cluster.submit(f"{PREFIX}.fail", {"message": "no route to host"})
    _finished(cluster, failed)
    paths = [
        "/",
        "/runs",
        f"/runs/{failed}",
        f"/runs/{workflow}",
        "/tasks",
        "/workers",
        "/triggers",
        "/workflows",
        "/doctor",
        "/runs?status=failed",
        "/bulk",
    ]
    return [console.url + path for path in paths]


def test_every_page_passes_axe_and_is_usable_at_390_px(
    page: Page, console: ConsoleProcess, cluster: Cluster
) -> None:
    axe = Axe()
    urls = _pages(cluster, console)
    for url in urls:
        page.set_viewport_size({"width": 1280, "height": 900})
        page.goto(url)
        results: Any = axe.run(page)
        serious = [
            (v["id"], v["impact"], [n["target"] for n in v["nodes"]][:3])
            for v in results.response["violations"]
            if v["impact"] in SERIOUS
        ]
        assert serious == [], url
        page.set_viewport_size({"width": 390, "height": 844})
        page.goto(url)
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, (url, width)
        # The navigation stays reachable: every link of it is on screen.
        for link in page.locator("nav[aria-label=Console] a").all():
            box = link.bounding_box()
            assert box is not None and box["x"] + box["width"] <= 390, url


def test_screenshots_of_the_overview_a_run_and_a_workflow(
    page: Page, console: ConsoleProcess, cluster: Cluster
) -> None:
    urls = _pages(cluster, console)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.set_viewport_size({"width": 1280, "height": 900})
    for url, name in ((urls[0], "overview"), (urls[2], "run"), (urls[3], "workflow")):
        page.goto(url)
        page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)
        assert (SCREENSHOTS / f"{name}.png").stat().st_size > 10_000
    page.goto(urls[3])
    expect(page.locator("figure.graph svg g.step")).to_have_count(4)


def test_quarantine_the_run_that_holds_the_gate_shut_and_watch_it_open(
    page: Page, console: ConsoleProcess, cluster: Cluster
) -> None:
    """Runs last: while the gate is shut no claim is granted."""
    from tests.console.browser.gate import broken_head_candidate

    with broken_head_candidate(cluster) as head:
        page.goto(console.url + "/")
        expect(page.locator('[data-gate="closed"]')).to_be_visible(timeout=20_000)
        expect(page.locator("main")).to_contain_text(f"fails on run {head}")
        page.get_by_role("link", name=head).first.click()
        page.get_by_label("Reason").last.fill("its events are refused")
        page.get_by_role("button", name="Quarantine").click()
        expect(page.locator(".done")).to_contain_text(f"quarantined run {head}")
        page.goto(console.url + "/")
        # The node's next cycle skips the quarantined run; the page follows without a reload.
        expect(page.locator('[data-gate="open"]')).to_be_visible(timeout=20_000)
        expect(page.locator("main")).to_contain_text("its events are refused")
    wait_for(lambda: cluster.container.store().dispatch_gate().open, 20, "the gate to open")
