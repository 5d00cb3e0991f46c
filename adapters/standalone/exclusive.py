"""Exclusive ownership of a database file by one executing process.

Startup recovery in Standalone and Edge treats every Attempt the previous process left started
as no longer running. That is true only if no other process executes work on the same database,
so a process holds an exclusive lock on ``<database>.lock`` for its whole life. The operating
system releases the lock when the process dies, however it dies (SIGKILL included).
"""

from __future__ import annotations

import contextlib
import os

from ql3.domain.errors import Error

LOCK_SUFFIX = ".lock"


class AlreadyRunning(Error, RuntimeError):
    """Another process executes work on this database."""


class DatabaseLock:
    """``flock`` on ``<database>.lock``; the file also names the holder's process id."""

    def __init__(self, database_path: str) -> None:
        self.path = os.fspath(database_path) + LOCK_SUFFIX
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        import fcntl

        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise AlreadyRunning(
                f"another process (pid {holder}) executes work on {self.path[: -len(LOCK_SUFFIX)]}"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode("ascii"))
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # closing the descriptor releases the lock
