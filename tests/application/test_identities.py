"""The default identities: UUIDv7 ids that sort by the time they were made, random secrets."""

from __future__ import annotations

import time
import uuid

from application.identities import RandomIdentities


def test_ids_are_uuid7_hex_and_sort_by_the_millisecond_they_were_made() -> None:
    identities = RandomIdentities()
    earlier = [identities.new_id() for _ in range(50)]
    time.sleep(0.003)
    later = identities.new_id()
    for made in [*earlier, later]:
        parsed = uuid.UUID(made)
        assert len(made) == 32 and made == parsed.hex
        assert parsed.version == 7 and parsed.variant == uuid.RFC_4122
    assert all(made < later for made in earlier)
    now_ms = time.time_ns() // 1_000_000
    assert now_ms - 1_000 <= uuid.UUID(later).int >> 80 <= now_ms
    assert len(set(earlier)) == len(earlier)  # 74 random bits apart within one millisecond


def test_secrets_are_url_safe_and_never_repeat() -> None:
    identities = RandomIdentities()
    made = {identities.new_secret() for _ in range(100)}
    assert len(made) == 100
    assert all(len(s) == 43 and s.replace("-", "").replace("_", "").isalnum() for s in made)
