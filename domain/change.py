"""What every transition returns: the values to persist and the one event they imply."""

from __future__ import annotations

from attrs import frozen

from ql3.domain.events import RunEvent
from ql3.domain.model import Attempt, DispatchLease, Run


@frozen(kw_only=True)
class Change:
    """The outcome of one transition: the values to persist and the event to append.

    ``attempts`` holds the Attempts that changed or were created; ``lease`` the lease that changed
    or was created, if any.
    """

    run: Run
    attempts: tuple[Attempt, ...]
    lease: DispatchLease | None
    event: RunEvent
