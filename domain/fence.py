"""Lease tokens and the fence check every worker command passes through."""

from __future__ import annotations

import hashlib
import hmac

from attrs import frozen

from ql3.domain.errors import FenceReason, FenceRejected
from ql3.domain.guards import LEASE_EXPIRED, holds
from ql3.domain.model import DispatchLease, LeaseStatus, ReleaseReason


def hash_token(token: str) -> str:
    """The stored form of a lease token or session secret: SHA-256, hex."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def secrets_match(presented: str, stored_hash: str) -> bool:
    """Constant-time comparison of a presented secret with a stored hash."""
    return hmac.compare_digest(hash_token(presented), stored_hash)


@frozen(kw_only=True)
class LeaseFence:
    """What a worker presents with every fenced command."""

    attempt_id: str
    generation: int
    version: int
    token: str


def check_holder(lease: DispatchLease | None, fence: LeaseFence) -> DispatchLease:
    """The fence names this exact lease and its token, whatever the lease's status or expiry."""
    if lease is None:
        raise FenceRejected(FenceReason.NO_LEASE, fence.attempt_id)
    if lease.attempt_id != fence.attempt_id:
        raise FenceRejected(FenceReason.ATTEMPT_MISMATCH, fence.attempt_id)
    if lease.generation != fence.generation:
        raise FenceRejected(FenceReason.GENERATION_MISMATCH, fence.attempt_id)
    if lease.token_hash is None or not secrets_match(fence.token, lease.token_hash):
        raise FenceRejected(FenceReason.TOKEN_MISMATCH, fence.attempt_id)
    return lease


def released_for_cancel(lease: DispatchLease) -> bool:
    """The lease was released because its Run was cancelled (ADR 0017)."""
    return lease.status is LeaseStatus.RELEASED and lease.release_reason is ReleaseReason.CANCELLED


def check_not_cancelled(lease: DispatchLease, attempt_id: str) -> DispatchLease:
    """Refuse, as ``cancelled``, the holder of a lease released because its Run was cancelled
    (whatever version a fence names: a released lease never changes again), so the worker
    knows to stop the task rather than to treat it as a stale fence (ADR 0017)."""
    if released_for_cancel(lease):
        raise FenceRejected(FenceReason.CANCELLED, attempt_id)
    return lease


def check_fence(lease: DispatchLease | None, fence: LeaseFence, now_ms: int) -> DispatchLease:
    """Accept the fence only while that exact lease is ``leased`` and unexpired."""
    lease = check_not_cancelled(check_holder(lease, fence), fence.attempt_id)
    if lease.version != fence.version:
        raise FenceRejected(FenceReason.VERSION_MISMATCH, fence.attempt_id)
    if lease.status is not LeaseStatus.LEASED:
        raise FenceRejected(FenceReason.RELEASED, fence.attempt_id)
    if holds(LEASE_EXPIRED, {"lease": lease}, now_ms):
        raise FenceRejected(FenceReason.EXPIRED, fence.attempt_id)
    return lease
