"""Secret material from the environment or from files (ADR 0008).

A secret given in a file (a mounted Kubernetes secret, say) is read again whenever the file
changed (its inode, size or modification time: a Kubernetes update swaps a symlink), at the
moment it is needed: a store opening a new connection, a worker registering. So a rotated
secret is picked up without a restart, and without a timer or a signal of its own. A secret's
value is never logged or printed: errors name the file, not what it holds."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

SecretSource = Callable[[], str]


class SecretUnavailable(RuntimeError):
    """A secret's file cannot be read, or is empty."""


class FileSecret:
    """The content of a file, without its trailing newline, read again once it changed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None
        self._value = ""
        self()  # refuse a missing or empty file at once

    def __call__(self) -> str:
        try:
            stat = os.stat(self.path)
        except OSError as error:
            raise SecretUnavailable(f"cannot read {self.path}: {error.strerror}") from None
        seen = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        with self._lock:
            if seen != self._seen:
                try:
                    with open(self.path, encoding="utf-8") as file:
                        value = file.read().rstrip("\r\n")
                except (OSError, UnicodeDecodeError) as error:
                    raise SecretUnavailable(f"cannot read {self.path}: {error}") from None
                if not value.strip():
                    raise SecretUnavailable(f"{self.path} is empty")
                self._value, self._seen = value, seen
            return self._value

    def __repr__(self) -> str:
        return f"FileSecret({self.path!r})"


def secret_source(value: str | None, path: str | None, *, what: str) -> SecretSource | None:
    """Where a secret comes from: ``path`` (read again when it changes) or a fixed ``value``
    (an option or an environment variable); None when neither is given."""
    if value and path:
        raise ValueError(f"give {what} or a file holding it, not both")
    if path:
        return FileSecret(path)
    if value:
        fixed = value
        return lambda: fixed
    return None


def from_environment(name: str, environ: dict[str, str] | None = None) -> SecretSource | None:
    """``$NAME`` or the file named by ``$NAME_FILE``."""
    env = os.environ if environ is None else environ
    return secret_source(env.get(name) or None, env.get(f"{name}_FILE") or None, what=f"${name}")
