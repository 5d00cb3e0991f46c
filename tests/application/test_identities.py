"""The default identities: UUIDv7 ids that sort in the order they were made, random secrets."""

from __future__ import annotations

import time
import uuid

from ql3.application.identities import RandomIdentities


def test_ids_are_uuid7_hex_and_increase_in_the_order_they_were_made() -> None:
    identities = RandomIdentities()
    made = [identities.new_id() for _ in range(10_000)]  # thousands within one millisecond
    time.sleep(0.003)
    later = identities.new_id()
    for one in [*made[:50], later]:
        parsed = uuid.UUID(one)
        assert len(one) == 32 and one == parsed.hex
        assert parsed.version == 7 and parsed.variant == uuid.RFC_4122
    assert made == sorted(made) and len(set(made)) == len(made)
    assert made[-1] < later
    now_ms = time.time_ns() // 1_000_000
    # the millisecond it was made in (or, past 4,096 in one, a little after)
    assert now_ms - 1_000 <= uuid.UUID(later).int >> 80 <= now_ms + 10


def test_secrets_are_url_safe_and_never_repeat() -> None:
    identities = RandomIdentities()
    made = {identities.new_secret() for _ in range(100)}
    assert len(made) == 100
    assert all(len(s) == 43 and s.replace("-", "").replace("_", "").isalnum() for s in made)
