"""Page budgets shared by every bounded step, and the batch budget of a prune (ADR 0016)."""

from __future__ import annotations

from ql3.domain.errors import Error

# The largest page any bounded step reads, and the page a step reads when not told.
HARD_PAGE_CAP = 64
DEFAULT_PAGE_SIZE = 16

# Runs a prune deletes per transaction (ql3.application.history).
DEFAULT_BATCH_SIZE = 500
MAX_BATCH_SIZE = 10_000


class InvalidPageSize(Error, ValueError):
    """A page budget outside 1..HARD_PAGE_CAP."""


def check_page_limit(limit: int, name: str = "limit") -> None:
    """Page sizes are 1..HARD_PAGE_CAP; anything else is a caller's bug."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= HARD_PAGE_CAP:
        raise ValueError(f"{name} must be an integer within 1..{HARD_PAGE_CAP}, got {limit!r}")


def validate_page_size(page_size: int | None, default: int = DEFAULT_PAGE_SIZE) -> int:
    """The page size to use: ``default`` when none is given; 1..64 otherwise."""
    size = default if page_size is None else page_size
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= HARD_PAGE_CAP:
        raise InvalidPageSize(
            f"page size must be an integer within 1..{HARD_PAGE_CAP}, got {size!r}"
        )
    return size
