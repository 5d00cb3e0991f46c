"""What admission snapshots on a Run besides its policy: priority, unique key and timeout, each
checked at admission; and ``retry_on_error`` in a policy document."""

from __future__ import annotations

import pytest

from ql3.domain.errors import InvalidAdmission, InvalidRetryPolicy
from ql3.domain.model import MAX_PRIORITY, MAX_UNIQUE_KEY_LENGTH, MIN_PRIORITY, RunStatus
from ql3.domain.policy import RetryPolicy, Safety, policy_from_document, policy_to_document
from ql3.domain.transitions import admit


def _admit(**options: object) -> object:
    return admit(run_id="r", attempt_id="a", task="t", input=None, policy=None, now_ms=5, **options)  # type: ignore[arg-type]


def test_admission_snapshots_priority_unique_key_and_timeout() -> None:
    change = admit(
        run_id="r",
        attempt_id="a",
        task="t",
        input=None,
        policy=None,
        now_ms=5,
        priority=7,
        unique_key="order-42",
        timeout_ms=1500,
    )
    run = change.run
    assert (run.status, run.priority, run.unique_key, run.timeout_ms) == (
        RunStatus.QUEUED,
        7,
        "order-42",
        1500,
    )


def test_defaults_are_no_priority_no_key_no_timeout() -> None:
    run = admit(run_id="r", attempt_id="a", task="t", input=None, policy=None, now_ms=5).run
    assert (run.priority, run.unique_key, run.timeout_ms) == (0, None, None)


@pytest.mark.parametrize(
    "options",
    [
        {"priority": MAX_PRIORITY + 1},
        {"priority": MIN_PRIORITY - 1},
        {"priority": True},
        {"unique_key": ""},
        {"unique_key": "x" * (MAX_UNIQUE_KEY_LENGTH + 1)},
        {"unique_key": "a\x00b"},
        {"timeout_ms": 0},
        {"timeout_ms": -5},
    ],
)
def test_bad_options_are_refused(options: dict[str, object]) -> None:
    with pytest.raises(InvalidAdmission):
        _admit(**options)


def test_retry_on_error_round_trips_through_a_policy_document() -> None:
    policy = RetryPolicy(retry_on_error=True, max_attempts=4, safety=Safety.IDEMPOTENT)
    document = policy_to_document(policy)
    assert document["retry_on_error"] is True
    assert policy_from_document(document) == policy
    assert policy_from_document({"max_attempts": 2}) == RetryPolicy(max_attempts=2)
    with pytest.raises(InvalidRetryPolicy):
        policy_from_document({"retry_on_error": "yes"})
