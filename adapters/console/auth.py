"""Who may use the console (ADR 0020): viewers read, operators also act.

Users come from a file or the environment, one a line: ``NAME:ROLE:HASH``, where HASH is an
scrypt hash made by ``ql3 console hash-password`` (``scrypt$N$r$p$SALT$KEY``, base64). The
console asks for them with HTTP Basic authentication; a password is compared with its hash in
constant time, and neither is ever logged or shown. A console mounted in an application may
take the application's own dependency instead: a callable from the request to an
:class:`Operator`, or None for "not signed in"."""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import hmac
import os
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**14, 8, 1
NAME_MAX = 64
VERIFIED_CACHE = 256


class Role(enum.Enum):
    VIEWER = "viewer"
    OPERATOR = "operator"


@dataclass(frozen=True, slots=True)
class Operator:
    """Who is signed in: their name (recorded with every action) and their role."""

    name: str
    role: Role

    @property
    def may_act(self) -> bool:
        return self.role is Role.OPERATOR


class InvalidUsers(ValueError):
    """A users file or variable that cannot be read as users."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def hash_password(password: str, *, salt: bytes | None = None) -> str:
    if not password:
        raise ValueError("a password must not be empty")
    salt = salt if salt is not None else secrets.token_bytes(16)
    key = hashlib.scrypt(
        password.encode(), salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, dklen=32
    )
    return f"scrypt${SCRYPT_N}${SCRYPT_R}${SCRYPT_P}${_b64(salt)}${_b64(key)}"


def verify_password(password: str, hashed: str) -> bool:
    try:
        scheme, n, r, p, salt, key = hashed.split("$")
        if scheme != "scrypt":
            return False
        expected = base64.b64decode(key, validate=True)
        found = hashlib.scrypt(
            password.encode(),
            salt=base64.b64decode(salt, validate=True),
            n=int(n),
            r=int(r),
            p=int(p),
            dklen=len(expected),
            maxmem=64 * 1024 * 1024,
        )
    except (ValueError, binascii.Error):
        return False
    return hmac.compare_digest(found, expected)


@dataclass(frozen=True, slots=True)
class User:
    name: str
    role: Role
    password_hash: str


def parse_users(lines: Iterable[str], where: str) -> dict[str, User]:
    users: dict[str, User] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition(":")
        role, _, hashed = rest.partition(":")
        if not name or len(name) > NAME_MAX or not hashed.startswith("scrypt$"):
            raise InvalidUsers(f"{where} line {number}: expected NAME:ROLE:SCRYPT-HASH")
        try:
            users[name] = User(name=name, role=Role(role), password_hash=hashed)
        except ValueError:
            raise InvalidUsers(
                f"{where} line {number}: the role is viewer or operator, got {role!r}"
            ) from None
    return users


def load_users(path: str | None, environ: Mapping[str, str] = os.environ) -> dict[str, User]:
    """The users of ``path`` (a file), else of ``$QL3_CONSOLE_USERS`` (lines, or entries
    separated by spaces), else of the file named by ``$QL3_CONSOLE_USERS_FILE``."""
    path = path or environ.get("QL3_CONSOLE_USERS_FILE")
    if path:
        try:
            with open(path, encoding="utf-8") as file:
                return parse_users(file, path)
        except OSError as error:
            raise InvalidUsers(f"cannot read the users file {path}: {error.strerror}") from None
    inline = environ.get("QL3_CONSOLE_USERS", "")
    return parse_users(inline.split(), "$QL3_CONSOLE_USERS")


Identify = Callable[[Any], "Operator | None"]


class BasicAuth:
    """HTTP Basic authentication against ``users``."""

    def __init__(self, users: Mapping[str, User]) -> None:
        self._users = dict(users)
        # Unknown names are checked against this, so that they take as long as known ones.
        self._decoy = hash_password(secrets.token_hex(8))
        # scrypt is slow on purpose: a header verified once is known by its digest (in memory
        # only) for the pages and updates that follow.
        self._verified: dict[bytes, Operator] = {}

    def __call__(self, authorization: str | None) -> Operator | None:
        if not authorization or not authorization.lower().startswith("basic "):
            return None
        digest = hashlib.sha256(authorization.encode()).digest()
        known = self._verified.get(digest)
        if known is not None:
            return known
        found = self._verify(authorization)
        if found is not None:
            if len(self._verified) >= VERIFIED_CACHE:
                self._verified.clear()
            self._verified[digest] = found
        return found

    def _verify(self, authorization: str) -> Operator | None:
        try:
            decoded = base64.b64decode(authorization[6:].strip(), validate=True).decode()
        except (ValueError, binascii.Error, UnicodeDecodeError):
            return None
        name, sep, password = decoded.partition(":")
        if not sep:
            return None
        user = self._users.get(name)
        if not verify_password(password, user.password_hash if user else self._decoy):
            return None
        if user is None:
            return None
        return Operator(name=user.name, role=user.role)


# The names the public API exports (``ql3.ConsoleOperator`` and so on).
ConsoleOperator = Operator
ConsoleRole = Role
console_users = load_users
