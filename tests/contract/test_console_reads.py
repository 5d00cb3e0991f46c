"""The console's reads on every store (ADR 0020): the runs list by each filter, keyset pages
that neither repeat nor skip a Run, capped counts, and the finished history of a window."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ql3.application.admission import Admission, AdmissionRequest
from ql3.application.console import ConsoleQueries, RunCursor, RunFilter, RunOrder
from ql3.application.identities import RandomIdentities
from ql3.domain.model import RunStatus

Advance = Callable[[int], None]


def _seed(store: Any, advance: Advance) -> tuple[Admission, list[str]]:
    admission = Admission(store.unit_of_work, RandomIdentities())
    ids = []
    for i in range(7):
        request = AdmissionRequest(
            task="mail" if i % 2 == 0 else "report",
            input={"n": i, "shop": {"id": 3 if i < 3 else 4}, "flag": i == 5, "tag": f"t{i}"},
            unique_key=f"key-{i}" if i == 4 else None,
        )
        ids.append(admission.submit_many([request])[0])
        advance(1000)
    return admission, ids


def _ids(page: Any) -> list[str]:
    return [run.id for run in page.runs]


def test_filters_select_what_they_name(store: Any, advance: Advance) -> None:
    admission, ids = _seed(store, advance)
    admission.cancel(ids[1], "no")
    browse = store.browse_runs
    newest = RunOrder.NEWEST

    def found(where: RunFilter) -> set[str]:
        return {run.id for run in browse(where, newest, None, 50).runs}

    assert found(RunFilter()) == set(ids)
    assert found(RunFilter(statuses=(RunStatus.CANCELLED,))) == {ids[1]}
    assert found(RunFilter(task="report")) == {ids[1], ids[3], ids[5]}
    assert found(RunFilter(unique_key="key-4")) == {ids[4]}
    assert found(RunFilter(run_id=ids[6])) == {ids[6]}
    assert found(RunFilter(input_contains={"n": 2})) == {ids[2]}
    assert found(RunFilter(input_contains={"tag": "t3", "n": 3})) == {ids[3]}
    assert found(RunFilter(input_contains={"flag": True})) == {ids[5]}
    assert found(RunFilter(input_contains={"shop": {"id": 3}})) == {ids[0], ids[1], ids[2]}
    assert found(RunFilter(input_contains={"n": 99})) == set()
    first = browse(RunFilter(run_id=ids[2]), newest, None, 1).runs[0].created_at_ms
    last = browse(RunFilter(run_id=ids[4]), newest, None, 1).runs[0].created_at_ms
    assert found(RunFilter(created_from_ms=first, created_to_ms=last)) == set(ids[2:5])
    assert found(RunFilter(task="mail", statuses=(RunStatus.QUEUED,))) == {
        ids[0], ids[2], ids[4], ids[6]
    }


def test_keyset_pages_neither_repeat_nor_skip(store: Any, advance: Advance) -> None:
    _admission, ids = _seed(store, advance)
    for order, expected in ((RunOrder.NEWEST, ids[::-1]), (RunOrder.OLDEST, ids)):
        seen: list[str] = []
        cursor: RunCursor | None = None
        for _ in range(10):
            page = store.browse_runs(RunFilter(), order, cursor, 3)
            seen += _ids(page)
            cursor = page.next_cursor
            if cursor is None:
                break
            assert RunCursor.parse(cursor.token()) == cursor
        assert seen == expected


def test_counts_are_exact_up_to_their_cap(store: Any, advance: Advance) -> None:
    _seed(store, advance)
    exact = store.count_runs(RunFilter(task="mail"), 10)
    assert (exact.value, exact.exact) == (4, True)
    capped = store.count_runs(RunFilter(), 5)
    assert not capped.exact and capped.value >= 5


def test_finished_history_by_bucket_task_and_status(store: Any, advance: Advance) -> None:
    admission, ids = _seed(store, advance)
    for run_id in ids[:3]:
        admission.cancel(run_id, "done")
    now, buckets = store.finished_between(0, 60_000)
    assert sum(b.cancelled for b in buckets) == 3 and sum(b.total for b in buckets) == 3
    assert store.finished_between(now + 1, 60_000)[1] == []
    assert store.finished_counts(0) == {("mail", "cancelled"): 2, ("report", "cancelled"): 1}
    assert store.task_durations(0, 100) == {}
    queries = ConsoleQueries(store, store)
    overview = queries.overview()
    assert overview.status_counts[RunStatus.CANCELLED].value == 3
    assert overview.status_counts[RunStatus.QUEUED].value == 4
    assert len(overview.last_hour) == 60 and len(overview.last_day) == 24
    assert sum(b.total for b in overview.last_hour) == 3
    tasks = {row.task: row for row in queries.tasks(3_600_000, {"mail": 2})}
    assert (tasks["mail"].queued, tasks["mail"].limit) == (2, 2)
    assert (tasks["report"].queued, tasks["report"].limit) == (2, None)


def test_durations_of_the_attempts_finished_in_a_window(store: Any, advance: Advance) -> None:
    from tests.contract.builders import committed, finish, given_session, given_started

    given_session(store, "s1", "w-1")
    attempt_id = given_started(store, "r-done", "s1")
    advance(1_500)
    with committed(store) as uow:
        finish(uow, attempt_id)
    durations = store.task_durations(0, 100)
    assert list(durations) == ["mail"] and durations["mail"][0] >= 1_500
    queries = ConsoleQueries(store, store)
    (row,) = [t for t in queries.tasks(3_600_000, {}) if t.task == "mail"]
    assert row.succeeded == 1 and row.p50_ms is not None and row.p50_ms >= 1_500
