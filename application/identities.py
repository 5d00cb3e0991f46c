"""Default identifiers and secrets."""

from __future__ import annotations

import secrets
import uuid


class RandomIdentities:
    """UUIDv4 identifiers; secrets of 256 random bits, URL-safe."""

    def new_id(self) -> str:
        return uuid.uuid4().hex

    def new_secret(self) -> str:
        return secrets.token_urlsafe(32)
