"""The console's routes without a browser, on SQLite and PostgreSQL (ADR 0020): every page
answers, values from runs are escaped, a viewer sees no action and is refused one, every
state-changing request must come from the console's own origin, the actions go through the
application's commands and name the operator, and a client's mistake is never a 5xx."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ql3.application.admission import Admission, AdmissionRequest
from ql3.application.identities import RandomIdentities
from ql3.application.queries import RunQueries
from ql3.domain.model import RunStatus
from ql3.domain.policy import RetryPolicy, Safety
from tests.console.conftest import ORIGIN, basic
from tests.contract.builders import given_lost, given_session, given_started

PAGES = ["/", "/runs", "/tasks", "/workers", "/triggers", "/workflows", "/doctor"]
XSS = "<script>alert(1)</script>"
IDEMPOTENT = RetryPolicy(retry_on_lost=True, max_attempts=3, safety=Safety.IDEMPOTENT)


def _submit(store: Any, task: str = "mail", **fields: Any) -> str:
    admission = Admission(store.unit_of_work, RandomIdentities())
    return admission.submit_many([AdmissionRequest(task=task, **fields)])[0]


def _status(store: Any, run_id: str) -> RunStatus:
    view = RunQueries(store.unit_of_work).show(run_id)
    assert view is not None
    return view.run.status


def test_every_page_answers_with_a_strict_policy(viewer: TestClient, store: Any) -> None:
    _submit(store, input={"n": 1})
    for page in PAGES:
        response = viewer.get(page)
        assert response.status_code == 200, page
        policy = response.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "unsafe-inline" not in policy
        assert response.headers["x-frame-options"] == "DENY"
        assert "<script>" not in response.text  # only <script src=...> of the package
    static = viewer.get("/static/htmx.min.js")
    assert static.status_code == 200 and "htmx" in static.text[:200]
    assert viewer.get("/static/htmx-LICENSE.txt").status_code == 200


def test_nobody_signed_in_is_asked_to_sign_in(console: Any) -> None:
    client = TestClient(console.app)
    for page in ["/", "/runs", "/events"]:
        response = client.get(page)
        assert response.status_code == 401
        assert response.headers["www-authenticate"].startswith("Basic")
    wrong = TestClient(console.app, headers=basic("otto", "not-the-password"))
    assert wrong.get("/").status_code == 401
    assert (
        TestClient(console.app, headers={"Authorization": "Basic !!"}).get("/").status_code == 401
    )


def test_values_from_a_run_are_escaped_wherever_shown(viewer: TestClient, store: Any) -> None:
    run_id = _submit(store, task=f"t{XSS}", input={"to": XSS}, unique_key=XSS)
    Admission(store.unit_of_work, RandomIdentities()).cancel(run_id, f"because {XSS}")
    for page in ["/", f"/runs/{run_id}", "/runs", "/tasks", f"/runs?task=t{XSS}"]:
        text = viewer.get(page).text
        assert XSS not in text, page
    detail = viewer.get(f"/runs/{run_id}").text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in detail


def test_a_viewer_sees_no_action_and_is_refused_each(viewer: TestClient, store: Any) -> None:
    run_id = _submit(store)
    page = viewer.get(f"/runs/{run_id}").text
    assert '<form method="post"' not in page and "Cancel run" not in page
    assert '<form method="post"' not in viewer.get("/tasks").text
    for path, form in [
        (f"/runs/{run_id}/cancel", {"reason": "x"}),
        (f"/runs/{run_id}/quarantine", {"reason": "x"}),
        (f"/runs/{run_id}/unquarantine", {}),
        (f"/runs/{run_id}/again", {"input": "null"}),
        ("/attempts/a1/attest-stopped", {"reason": "x"}),
        ("/tasks/limit", {"task": "mail", "max_running": "1"}),
        ("/credentials/c1/revoke", {"reason": "x"}),
    ]:
        assert viewer.post(path, data=form).status_code == 403, path
    assert _status(store, run_id) is RunStatus.QUEUED


def test_an_action_from_another_origin_is_refused(console: Any, store: Any) -> None:
    run_id = _submit(store)
    for headers in [
        {},
        {"Origin": "http://evil.example"},
        {"Referer": "http://evil.example/runs"},
        {"Origin": ORIGIN, "Sec-Fetch-Site": "cross-site"},
        {"Origin": "null"},
    ]:
        client = TestClient(console.app, headers={**basic("otto"), **headers})
        response = client.post(f"/runs/{run_id}/cancel", data={"reason": "x"})
        assert response.status_code == 403, headers
    assert _status(store, run_id) is RunStatus.QUEUED
    same = TestClient(console.app, headers={**basic("otto"), "Sec-Fetch-Site": "same-origin"})
    assert same.post(f"/runs/{run_id}/cancel", data={"reason": "x"}).status_code == 200


def test_cancel_names_the_operator_and_says_what_changed(operator: TestClient, store: Any) -> None:
    run_id = _submit(store)
    page = operator.get(f"/runs/{run_id}").text
    assert "Cancel run" in page
    response = operator.post(f"/runs/{run_id}/cancel", data={"reason": "not needed"})
    assert response.status_code == 200
    assert f"cancelled run {run_id} (was queued)" in response.text
    view = RunQueries(store.unit_of_work).show(run_id)
    assert view is not None and view.run.status is RunStatus.CANCELLED
    assert view.run.error == "[console: otto] not needed"
    again = operator.post(f"/runs/{run_id}/cancel", data={"reason": "twice"})
    assert again.status_code == 409 and "cannot" in again.text
    assert operator.post("/runs/nope/cancel", data={"reason": "x"}).status_code == 404


def test_quarantine_and_attestation_are_audited(operator: TestClient, store: Any) -> None:
    given_session(store, "s1", "w-1")
    given_lost(store, "r-lost", "s1")
    response = operator.post("/runs/r-lost/quarantine", data={"reason": "broken"})
    assert response.status_code == 200 and "quarantined run r-lost" in response.text
    assert "r-lost" in operator.get("/").text
    assert operator.post("/runs/r-lost/quarantine", data={"reason": "again"}).status_code == 409
    assert operator.post("/runs/r-lost/quarantine", data={"reason": " "}).status_code == 400
    lifted = operator.post("/runs/r-lost/unquarantine", data={"reason": "fixed"})
    assert lifted.status_code == 200
    view = RunQueries(store.unit_of_work).show("r-lost")
    assert view is not None
    reasons = [data.get("reason") for _s, kind, _a, _i, data in view.events if "quarantine" in kind]
    assert reasons == ["[console: otto] broken", "[console: otto] fixed"]
    started = given_started(store, "r-running", "s1")
    attest = operator.post(f"/attempts/{started}/attest-stopped", data={"reason": "host off"})
    assert attest.status_code == 200 and "is not running" in attest.text
    assert operator.post("/attempts/nope/attest-stopped", data={"reason": "x"}).status_code == 404
    view = RunQueries(store.unit_of_work).show("r-running")
    assert view is not None
    evidence = [data for _s, kind, _a, _i, data in view.events if kind == "evidence_recorded"]
    assert "[console: otto] host off" in json.dumps(evidence)


def test_task_limits_are_set_and_cleared(operator: TestClient, store: Any) -> None:
    _submit(store, task="resize")
    done = operator.post("/tasks/limit", data={"task": "resize", "max_running": "3"})
    assert done.status_code == 200 and "at most 3 running at once" in done.text
    row = re.search(r'<tr data-task="resize">.*?</tr>', operator.get("/tasks").text, re.S)
    assert row is not None and '<td class="limit">3</td>' in row.group(0)
    cleared = operator.post("/tasks/limit", data={"task": "resize", "clear": "1"})
    assert cleared.status_code == 200 and "resize: no limit" in cleared.text
    for bad in (
        {"task": "resize", "max_running": "x"},
        {"task": "", "max_running": "1"},
        {"task": "resize", "max_running": "-1"},
    ):
        assert operator.post("/tasks/limit", data=bad).status_code == 400, bad


def test_run_again_links_both_runs(operator: TestClient, store: Any) -> None:
    run_id = _submit(store, input={"n": 1}, policy=IDEMPOTENT, priority=3)
    assert operator.post(f"/runs/{run_id}/again", data={"input": "{}"}).status_code == 409
    Admission(store.unit_of_work, RandomIdentities()).cancel(run_id, "stop")
    response = operator.post(f"/runs/{run_id}/again", data={"input": '{"n": 2}'})
    assert response.status_code == 200
    new_id = re.search(r"runs again as (\w+)", response.text)
    assert new_id is not None
    new = RunQueries(store.unit_of_work).show(new_id.group(1))
    assert new is not None
    assert (new.run.input, new.run.policy, new.run.priority) == ({"n": 2}, IDEMPOTENT, 3)
    assert new.run.status is RunStatus.QUEUED
    assert f'class="again-of">{run_id}<' in operator.get(f"/runs/{new.run.id}").text
    assert f'class="again">{new.run.id}<' in operator.get(f"/runs/{run_id}").text
    assert operator.post(f"/runs/{run_id}/again", data={"input": "{bad"}).status_code == 400


def test_running_an_unsafe_task_again_needs_its_name(operator: TestClient, store: Any) -> None:
    unsafe = RetryPolicy(retry_on_lost=False, max_attempts=1, safety=Safety.UNSAFE)
    run_id = _submit(store, task="charge", policy=unsafe)
    Admission(store.unit_of_work, RandomIdentities()).cancel(run_id, "stop")
    page = operator.get(f"/runs/{run_id}").text
    assert "not declared safe to repeat" in page and 'name="confirm"' in page
    refused = operator.post(f"/runs/{run_id}/again", data={"input": "null", "confirm": "x"})
    assert refused.status_code == 400 and "type its name" in refused.text
    ok = operator.post(f"/runs/{run_id}/again", data={"input": "null", "confirm": "charge"})
    assert ok.status_code == 200


@pytest.mark.parametrize(
    "query",
    [
        "status=nope",
        "input=not-json",
        "input=[1]",
        "since=yesterday",
        "after=garbage",
        "limit=0",
        "limit=x",
        "order=sideways",
        "since=2026-01-02T00:00&until=2026-01-01T00:00",
    ],
)
def test_a_bad_filter_is_a_400(viewer: TestClient, query: str) -> None:
    response = viewer.get(f"/runs?{query}")
    assert response.status_code == 400 and "Refused" in response.text


def test_runs_filter_and_page(viewer: TestClient, store: Any) -> None:
    ids = [_submit(store, input={"n": i, "shop": "a" if i % 2 else "b"}) for i in range(5)]
    page = viewer.get("/runs", params={"input": json.dumps({"shop": "a"})}).text
    assert "2 run(s) match" in page
    assert ids[1] in page and ids[3] in page and ids[0] not in page
    first = viewer.get("/runs", params={"limit": "2", "order": "oldest"}).text
    assert "5 run(s) match" in first and ids[0] in first and ids[2] not in first
    link = re.search(r'href="/runs(\?[^"]+)" rel="next"', first)
    assert link is not None
    second = viewer.get("/runs" + link.group(1).replace("&amp;", "&")).text
    assert ids[2] in second and ids[3] in second and ids[0] not in second
    by_id = viewer.get("/runs", params={"id": ids[4], "status": "queued"}).text
    assert "1 run(s) match" in by_id


def test_the_event_stream_needs_sign_in_and_says_changed(console: Any, store: Any) -> None:
    feed = console.feed
    marker = feed.marker()
    _submit(store)
    changed, now = feed.wait_past(marker, timeout_s=3)
    assert changed and now > marker
    assert feed.wait_past(now, timeout_s=1) == (False, now)


def _wait_job(operator: TestClient, location: str) -> str:
    import time

    deadline = time.monotonic() + 30
    while True:
        page = operator.get(location).text
        if 'data-state="finished"' in page:
            return page
        assert time.monotonic() < deadline, page
        time.sleep(0.05)


def test_bulk_cancel_by_filter_after_its_preview(operator: TestClient, store: Any) -> None:
    mails = [_submit(store, task="mail", input={"n": i}) for i in range(5)]
    other = _submit(store, task="report")
    Admission(store.unit_of_work, RandomIdentities()).cancel(mails[0], "early")
    page = operator.get("/runs", params={"task": "mail"}).text
    assert 'id="bulk-form"' in page and 'name="run"' in page
    form = {"action": "cancel", "scope": "filter", "query": "task=mail", "reason": "tidy"}
    preview = operator.post("/bulk/preview", data=form)
    assert preview.status_code == 200 and 'data-count="4"' in preview.text
    assert all(_status(store, run_id) is not RunStatus.CANCELLED for run_id in mails[1:])
    began = re.search(r'name="began" value="(\d+)"', preview.text)
    assert began is not None
    started = operator.post("/bulk", data={**form, "began": began.group(1)}, follow_redirects=False)
    assert started.status_code == 303
    done = _wait_job(operator, started.headers["location"])
    assert "4 done, 0 skipped, 0 failed of 4 previewed" in done and "otto" in done
    assert all(_status(store, run_id) is RunStatus.CANCELLED for run_id in mails)
    assert _status(store, other) is RunStatus.QUEUED
    view = RunQueries(store.unit_of_work).show(mails[3])
    assert view is not None and view.run.error == "[console: otto] tidy"
    assert "otto" in operator.get("/bulk").text


def test_bulk_run_again_of_a_selection(
    operator: TestClient, viewer: TestClient, store: Any
) -> None:
    admission = Admission(store.unit_of_work, RandomIdentities())
    done = [_submit(store, task="mail", policy=IDEMPOTENT) for _ in range(2)]
    unsafe = _submit(store, task="charge")
    waiting = _submit(store, task="mail")
    for run_id in (*done, unsafe):
        admission.cancel(run_id, "stop")
    form = [
        ("action", "run_again"),
        ("scope", "selected"),
        ("query", ""),
        *[("run", run_id) for run_id in (*done, unsafe, waiting)],
    ]
    assert viewer.post("/bulk/preview", data=dict(form)).status_code == 403
    preview = operator.post(
        "/bulk/preview",
        content=_encoded(form),
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert 'data-count="4"' in preview.text
    began = re.search(r'name="began" value="(\d+)"', preview.text)
    assert began is not None
    started = operator.post(
        "/bulk",
        content=_encoded([*form, ("began", began.group(1))]),
        headers={"Content-Type": "application/x-www-form-urlencoded"},
        follow_redirects=False,
    )
    page = _wait_job(operator, started.headers["location"])
    assert "2 done, 2 skipped, 0 failed" in page and "not declared safe to repeat" in page
    for run_id in done:
        assert 'class="again">' in operator.get(f"/runs/{run_id}").text
    missing = operator.post("/bulk/preview", data={"action": "cancel", "scope": "selected"})
    assert missing.status_code == 400
    assert operator.post("/bulk/preview", data={"action": "nope"}).status_code == 400
    assert operator.get("/bulk/unknown").status_code == 404


def _encoded(pairs: list[tuple[str, str]]) -> str:
    from urllib.parse import urlencode

    return urlencode(pairs)


def test_revoking_a_credential_is_audited_with_the_operator(
    operator: TestClient, viewer: TestClient, store: Any
) -> None:
    with store.unit_of_work() as uow:
        keeps_credentials = hasattr(uow, "credentials")
    if not keeps_credentials:  # SQLite keeps no worker credentials: nothing to revoke
        assert operator.post("/credentials/c1/revoke", data={"reason": "x"}).status_code == 404
        assert "Credentials" not in operator.get("/workers").text
        return
    from ql3.application.credentials import CredentialCommands

    commands = CredentialCommands(store.unit_of_work, RandomIdentities())
    issued = commands.issue("host-a-*")
    page = operator.get("/workers").text
    assert issued.credential.id in page and issued.secret not in page
    assert issued.secret not in viewer.get("/workers").text
    done = operator.post(f"/credentials/{issued.credential.id}/revoke", data={"reason": "lost"})
    assert done.status_code == 200 and "revoked credential" in done.text
    audit = commands.audit(issued.credential.id)
    assert "[console: otto] lost" in json.dumps([str(event) for event in audit])
    again = operator.post(f"/credentials/{issued.credential.id}/revoke", data={"reason": "x"})
    assert again.status_code in (400, 409)
