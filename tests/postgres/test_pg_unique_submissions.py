"""Unique submissions on PostgreSQL across connections (ADR 0015): concurrent submits of one key
make one Run and all of them answer its id; a submit that meets another transaction's
uncommitted Run with its key waits for it and answers with it; the key lookup uses the partial
unique index."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from ql3.adapters.postgres.store import PostgresStore
from ql3.application.admission import Admission, AdmissionRequest, Admitted
from ql3.application.identities import RandomIdentities
from ql3.domain.model import RunStatus
from ql3.domain.transitions import admit

pytestmark = pytest.mark.postgres

THREADS = 8


@pytest.fixture(scope="module")
def wide_store(pg_database_url: str) -> Iterator[PostgresStore]:
    """A store with a connection for every submitting thread."""
    store = PostgresStore.from_url(pg_database_url, pool_size=THREADS + 2)
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def store(wide_store: PostgresStore) -> PostgresStore:
    wide_store.testing_reset()
    return wide_store


def _unfinished(store: PostgresStore, key: str) -> list[str]:
    with store.unit_of_work() as uow:
        runs = uow.runs.list_runs(None, 1_000)
    return [r.id for r in runs if r.unique_key == key and not r.status.is_terminal]


def test_concurrent_submits_of_one_key_make_one_run_and_all_answer_its_id(
    store: PostgresStore,
) -> None:
    admission = Admission(store.unit_of_work, RandomIdentities())
    for round_ in range(5):
        key = f"order-{round_}"
        start = threading.Barrier(THREADS)

        def submit(_: int, key: str = key, start: threading.Barrier = start) -> Admitted:
            start.wait(timeout=30)
            return admission.admit_many([AdmissionRequest(task="mail", unique_key=key)])[0]

        with ThreadPoolExecutor(THREADS) as pool:
            answers = list(pool.map(submit, range(THREADS)))
        [run_id] = _unfinished(store, key)
        assert {answer.run_id for answer in answers} == {run_id}
        assert sum(not answer.existing for answer in answers) == 1
        with store.unit_of_work() as uow:
            assert len(uow.runs.events_of(run_id)) == 1
            assert len(uow.runs.attempts_of(run_id)) == 1


def test_a_submit_waits_for_an_uncommitted_run_with_its_key_and_answers_with_it(
    store: PostgresStore,
) -> None:
    """The race made certain: the other transaction read the key free, inserted its Run and
    has not committed when this submit reads the key (free: it cannot see that Run) and inserts;
    the partial unique index makes the insert wait, then refuses it, and the key is read
    again."""
    admission = Admission(store.unit_of_work, RandomIdentities())
    with store.unit_of_work() as holder:
        change = admit(
            run_id="first",
            attempt_id="first-a1",
            task="mail",
            input=None,
            policy=None,
            unique_key="k",
            now_ms=holder.now_ms(),
        )
        holder.runs.add_many([change])
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(
                lambda: admission.admit_many([AdmissionRequest(task="mail", unique_key="k")])[0]
            )
            with pytest.raises(TimeoutError):
                pending.result(timeout=1.0)  # blocked on the index, not answered
            holder.commit()
            answer = pending.result(timeout=30)
    assert answer == Admitted(run_id="first", existing=True)
    assert _unfinished(store, "k") == ["first"]


def test_a_submit_inserts_when_the_uncommitted_run_with_its_key_rolls_back(
    store: PostgresStore,
) -> None:
    admission = Admission(store.unit_of_work, RandomIdentities())
    with ThreadPoolExecutor(1) as pool:
        with store.unit_of_work() as holder:
            change = admit(
                run_id="first",
                attempt_id="first-a1",
                task="mail",
                input=None,
                policy=None,
                unique_key="k",
                now_ms=holder.now_ms(),
            )
            holder.runs.add_many([change])
            pending = pool.submit(
                lambda: admission.admit_many([AdmissionRequest(task="mail", unique_key="k")])[0]
            )
            with pytest.raises(TimeoutError):
                pending.result(timeout=1.0)
            # Leaving the block uncommitted rolls the holder back.
        answer = pending.result(timeout=30)
    assert not answer.existing and answer.run_id != "first"
    assert _unfinished(store, "k") == [answer.run_id]
    with store.unit_of_work() as uow:
        run = uow.runs.get_run(answer.run_id)
    assert run is not None and run.status is RunStatus.QUEUED


def test_the_key_lookup_reads_the_partial_unique_index(store: PostgresStore) -> None:
    from ql3.adapters.postgres import queries

    statement = queries.unfinished_with_keys(["a", "b"])
    compiled = statement.compile(
        dialect=store.engine.dialect, compile_kwargs={"literal_binds": True}
    )
    with store.engine.connect() as connection:
        connection.exec_driver_sql("SET enable_seqscan = off")
        plan = "\n".join(
            row[0] for row in connection.exec_driver_sql(f"EXPLAIN {compiled}").all()
        )
    assert "uq_runs_unique_key" in plan, plan
