"""RuntimeRecovery with several recovery transactions at once: same outcome, same fail-closed
rule (no candidate is started once one has failed)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

import pytest

from ql3.application.diagnosis import CandidateFailed
from ql3.application.ports import Page, RecoveryCandidate
from ql3.application.recovery import MAX_CONCURRENCY, RuntimeRecovery
from ql3.domain.model import AttemptStatus


def candidates(n: int) -> Page[RecoveryCandidate]:
    return Page(
        items=tuple(
            RecoveryCandidate(
                run_id=f"r{i}",
                attempt_id=f"a{i}",
                attempt_status=AttemptStatus.CLAIMED,
                lease_expires_at_ms=0,
                resolvable=True,
            )
            for i in range(n)
        ),
        has_more=False,
        observed_at_ms=0,
    )


class Source:
    def __init__(self, n: int) -> None:
        self.page = candidates(n)

    def recovery_candidates(self, limit: int) -> Page[RecoveryCandidate]:
        return self.page


class Runs:
    def lock_attempt(self, attempt_id: str, *, skip_locked: bool = False) -> None:
        return None  # gone in between: the candidate is moved on


class FakeUow:
    def __init__(self, factory: Factory) -> None:
        self.factory = factory
        self.runs = Runs()

    def __enter__(self) -> FakeUow:
        self.factory.enter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def commit(self) -> None:
        raise AssertionError("nothing to commit")


class Factory:
    """The first transaction fails; the others wait until it has, then find nothing."""

    def __init__(self, fail_first: bool, together: int = 1) -> None:
        self.fail_first = fail_first
        # The first ``together`` transactions wait for each other: they must run at once.
        self.barrier = threading.Barrier(together)
        self.calls = 0
        self.lock = threading.Lock()
        self.failed = threading.Event()
        self.threads: set[str] = set()

    def __call__(self) -> FakeUow:
        return FakeUow(self)

    def enter(self) -> None:
        with self.lock:
            self.calls += 1
            first = self.calls == 1
            call = self.calls
            self.threads.add(threading.current_thread().name)
        if not self.fail_first and call <= self.barrier.parties:
            self.barrier.wait(5)
        if self.fail_first and first:
            self.failed.set()
            raise ConnectionError("the server went away")
        if self.fail_first:
            assert self.failed.wait(5)


@pytest.mark.parametrize("concurrency", [1, 2, 4])
def test_every_candidate_is_resolved_once_whatever_the_concurrency(concurrency: int) -> None:
    factory = Factory(fail_first=False, together=concurrency)
    recovery = RuntimeRecovery(factory, Source(16), page_size=16, concurrency=concurrency)
    report = recovery.run_once()
    assert report.examined == 16 and report.moved_on == 16
    assert factory.calls == 16
    assert len(factory.threads) == concurrency


@pytest.mark.parametrize("concurrency", [1, 2, 4])
def test_a_failure_stops_the_pass_and_no_candidate_starts_after_it(concurrency: int) -> None:
    factory = Factory(fail_first=True)
    recovery = RuntimeRecovery(factory, Source(16), page_size=16, concurrency=concurrency)
    with pytest.raises(CandidateFailed, match="went away") as failed:
        recovery.run_once()
    assert isinstance(failed.value.__cause__, ConnectionError)
    # At most one candidate per other worker was under way when the first one failed.
    assert 1 <= factory.calls <= concurrency


@pytest.mark.parametrize("bad", [0, -1, MAX_CONCURRENCY + 1, True, 1.5])
def test_concurrency_is_checked(bad: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        RuntimeRecovery(Factory(False), Source(1), concurrency=bad)  # type: ignore[arg-type]


class Hold:
    """Counts the holds entered, and the threads that opened a unit of work outside one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entered = 0
        self.inside: set[int] = set()

    @contextmanager
    def __call__(self) -> Iterator[None]:
        ident = threading.get_ident()
        with self.lock:
            self.entered += 1
            self.inside.add(ident)
        try:
            yield
        finally:
            with self.lock:
                self.inside.discard(ident)


@pytest.mark.parametrize("concurrency", [1, 2, 4])
def test_each_thread_of_a_pass_resolves_its_candidates_inside_one_hold(concurrency: int) -> None:
    hold = Hold()
    outside: list[int] = []

    class HeldFactory(Factory):
        def enter(self) -> None:
            if threading.get_ident() not in hold.inside:
                outside.append(threading.get_ident())
            super().enter()

    factory = HeldFactory(fail_first=False, together=concurrency)
    recovery = RuntimeRecovery(
        factory, Source(16), page_size=16, concurrency=concurrency, hold=hold
    )
    report = recovery.run_once()
    assert report.moved_on == 16 and factory.calls == 16
    assert outside == []
    assert hold.entered == concurrency and hold.inside == set()
