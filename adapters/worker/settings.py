"""What a worker is told (:class:`WorkerSettings`) and the timings it derives from them and from
its session's registration (:class:`Timings`)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_CAPACITY = 1024  # the most slots a session may register
CLAIM_WAIT_MAX_S = 10.0  # the longest a claim waits at the node by default
CLAIM_WAIT_CEILING_S = 30.0  # the most the ingress lets a claim wait
MIN_GIVE_UP_S = 5.0  # the shortest time the worker keeps trying to reach the ingress


class WorkerFailed(Exception):
    """The worker cannot go on (its session is gone, the ingress stays unreachable, its slots
    cannot start...)."""


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    # The node's URL; several, separated by commas, are one ingress at several addresses (the
    # nodes of one cluster), tried in turn.
    ingress_url: str
    app_spec: str
    worker_id: str
    tasks: tuple[str, ...]
    concurrency: int = 1
    drain_timeout_s: float = 30.0
    # The longest a claim waits at the node for work (a long poll) before it is made again;
    # None: min(10 s, lease TTL / 3).
    poll_interval_s: float | None = None
    request_timeout_s: float = 5.0
    register_timeout_s: float = 30.0
    # How long a call keeps being repeated while the ingress does not answer (or answers 5xx)
    # before it fails; a call of a registered session is repeated on, with a warning each time
    # this passes (ADR 0028). None: the lease TTL, at least 5 s.
    give_up_s: float | None = None
    registration_token: str | None = None
    # PEM file of the certificate authorities an https:// ingress is verified against; None:
    # the system's.
    ca_file: str | None = None

    @property
    def ingress_urls(self) -> tuple[str, ...]:
        return tuple(url.strip() for url in self.ingress_url.split(",") if url.strip())

    def __post_init__(self) -> None:
        if not 1 <= self.concurrency <= MAX_CAPACITY:
            raise ValueError(f"concurrency must be within 1..{MAX_CAPACITY}")
        if not self.tasks:
            raise ValueError("a worker needs at least one task")
        for name, value in (
            ("drain timeout", self.drain_timeout_s),
            ("poll interval", self.poll_interval_s),
            ("request timeout", self.request_timeout_s),
            ("register timeout", self.register_timeout_s),
            ("give-up time", self.give_up_s),
        ):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive")


@dataclass(frozen=True, slots=True)
class Timings:
    """Every period and deadline of a registered worker, in seconds.

    Local deadlines are conservative: a lease that the ingress says expires in ``d`` ms (its
    own clock: ``expires_at_ms - now_ms``) is taken to expire ``d`` ms after the request was
    *sent*. Leases are renewed once they have less than ``renew_ahead_s`` left (two thirds of
    the TTL: a renewal every third of it), and a task is stopped ``margin_s`` before its lease
    would expire."""

    ttl_s: float
    margin_s: float
    renew_ahead_s: float
    claim_wait_s: float
    heartbeat_s: float
    request_timeout_s: float
    give_up_s: float
    watchdog_interval_s: float

    @property
    def claim_wait_ms(self) -> int:
        return max(1, int(self.claim_wait_s * 1000))

    @classmethod
    def of(cls, settings: WorkerSettings, lease_ttl_ms: int, heartbeat_interval_ms: int) -> Timings:
        ttl_s = lease_ttl_ms / 1000
        wait_s = settings.poll_interval_s or min(CLAIM_WAIT_MAX_S, ttl_s / 3)
        return cls(
            ttl_s=ttl_s,
            margin_s=max(0.05, min(1.0, ttl_s * 0.1)),
            renew_ahead_s=ttl_s * 2 / 3,
            claim_wait_s=min(wait_s, CLAIM_WAIT_CEILING_S),
            heartbeat_s=max(0.05, heartbeat_interval_ms / 1000),
            request_timeout_s=min(settings.request_timeout_s, max(0.5, ttl_s / 3)),
            give_up_s=settings.give_up_s or max(ttl_s, MIN_GIVE_UP_S),
            watchdog_interval_s=max(0.01, min(0.05, ttl_s / 40)),
        )

    @classmethod
    def in_process(cls, lease_ttl_ms: int) -> Timings:
        """The timings of a loop that calls the worker commands in its own process (Standalone,
        Edge): renewals on the same schedule as a remote worker's; no long poll (the database's
        wake channel says when work is queued), no heartbeat, no self-fencing and no retry
        budget (the process owns its database: a call that failed is made again later)."""
        ttl_s = lease_ttl_ms / 1000
        return cls(
            ttl_s=ttl_s,
            margin_s=0.0,
            renew_ahead_s=ttl_s * 2 / 3,
            claim_wait_s=0.0,
            heartbeat_s=ttl_s,
            request_timeout_s=0.0,
            give_up_s=0.0,
            watchdog_interval_s=0.0,
        )
