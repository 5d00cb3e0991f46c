"""The producer's composition root: a store with admission, cancellation and the run queries,
for a process that submits and reads but runs no scheduler and no task (``ql3 runs cancel``,
an application's web process before it starts the runtime); and :func:`submit` on a
submit-only store, which admits and does nothing else, on its database driver alone (``ql3
submit``).

It is built without a dependency-injector container, so that importing it loads neither that
library nor, through it, a web framework; the submit-only stores load no SQLAlchemy either: a
submit from the command line stays quick (ADR 0009). The profile's container
(:mod:`ql3.bootstrap.cluster`, :mod:`ql3.bootstrap.standalone`) is built on the same store only when
the application starts the runtime."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

from ql3.application.admission import Admission, AdmissionRequest, Admitted, admit_requests
from ql3.application.identities import RandomIdentities

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ql3.application.ports import AdmissionUnitOfWork, SchedulerStore
    from ql3.application.queries import RunQueries

SQLITE_BUSY_TIMEOUT_S = 30.0


def open_postgres_store(database_url: str, pool_size: int) -> SchedulerStore:
    from ql3.adapters.postgres.store import PostgresStore

    return PostgresStore.from_url(database_url, pool_size=pool_size)


def open_sqlite_store(
    database_path: str | None,
    *,
    busy_timeout_s: float = SQLITE_BUSY_TIMEOUT_S,
    synchronous: str = "FULL",
) -> SchedulerStore:
    from ql3.adapters.sql.sqlite import SqliteStore

    return SqliteStore(database_path, busy_timeout_s=busy_timeout_s, synchronous=synchronous)


class SubmitStore(Protocol):
    """What :func:`submit` needs of a store: its units of work admit Runs."""

    def unit_of_work(self) -> AdmissionUnitOfWork: ...

    def close(self) -> None: ...


def open_postgres_submit_store(database_url: str) -> SubmitStore:
    """Admission alone, on the psycopg driver alone (quick to import: no SQLAlchemy)."""
    from ql3.adapters.postgres.submit import PostgresSubmitStore

    return PostgresSubmitStore(database_url)


def open_sqlite_submit_store(database_path: str) -> SubmitStore:
    """Admission alone on the ``sqlite3`` driver, into an existing database of the store's
    schema version; any other file (missing, older, not the runtime's) is opened by the store,
    which creates, upgrades or refuses it."""
    from ql3.adapters.sql.sqlite.submit import SqliteSubmitStore

    store = SqliteSubmitStore.open(database_path, busy_timeout_s=SQLITE_BUSY_TIMEOUT_S)
    if store is not None:
        return store
    return open_sqlite_store(database_path)


def submit(store: SubmitStore, requests: Sequence[AdmissionRequest]) -> list[Admitted]:
    """Admit ``requests`` on ``store``, as every admission does
    (:func:`ql3.application.admission.admit_requests`)."""
    return admit_requests(store.unit_of_work, RandomIdentities(), requests)


@dataclass
class Producer:
    """Admission and the run queries on one store; :meth:`close` closes the store."""

    store: SchedulerStore
    admission: Admission = field(init=False)
    identities: RandomIdentities = field(default_factory=RandomIdentities)

    def __post_init__(self) -> None:
        self.admission = Admission(self.store.unit_of_work, self.identities)

    @cached_property
    def queries(self) -> RunQueries:
        """The run queries (loaded when first asked for: a submit does not need them)."""
        from ql3.application.queries import RunQueries

        return RunQueries(self.store.unit_of_work)

    def admission_in(self, unit_of_work: Callable[[], Any]) -> Admission:
        """Admission writing through another unit of work (the caller's transaction)."""
        return Admission(unit_of_work, self.identities)

    def close(self) -> None:
        self.store.close()
