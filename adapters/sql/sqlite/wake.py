"""The wake channel of a SQLite database: how a process that admits work wakes the process that
executes it, without that process polling.

The channel is a named pipe (FIFO) beside the database file (``<database>.wake``). A committed
admission writes one byte to it when someone listens and does nothing otherwise; the executing
process blocks in ``select`` on the pipe, so an idle process makes no cycles at all.

POSIX only: where named pipes do not exist, :func:`poke` is a no-op and :class:`WakeListener`
cannot be opened (:class:`WakeUnavailable`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

WAKE_SUFFIX = ".wake"


class WakeUnavailable(OSError):
    """This platform or path offers no named pipe to listen on."""


def wake_path_for(database_path: str) -> str:
    return os.fspath(database_path) + WAKE_SUFFIX


def poke(path: str) -> bool:
    """Write one byte to the channel at ``path`` when a process listens; True if one did.

    Never blocks and never raises: with nobody listening (no pipe, or no reader) there is
    nobody to wake, and a full pipe already holds a wake-up."""
    try:
        if not stat.S_ISFIFO(os.stat(path).st_mode):
            return False
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        os.write(fd, b"\x01")
        return True
    except OSError as error:
        return error.errno in (errno.EAGAIN, errno.EWOULDBLOCK)
    finally:
        os.close(fd)


class WakeListener:
    """The reading end of a wake channel, opened by the one process that executes the work.

    ``fileno()`` becomes readable when someone pokes; :meth:`drain` empties it. The listener
    also keeps a writing end open itself, so the pipe never reports end-of-file between pokes
    (which would make ``select`` spin)."""

    def __init__(self, path: str) -> None:
        if not hasattr(os, "mkfifo"):
            raise WakeUnavailable(f"named pipes are not available here ({path})")
        self.path = path
        try:
            os.mkfifo(path, 0o600)
        except FileExistsError:
            if not stat.S_ISFIFO(os.stat(path).st_mode):
                raise WakeUnavailable(f"{path} exists and is not a named pipe") from None
        self._read_fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self._keep_open_fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)

    def fileno(self) -> int:
        return self._read_fd

    def drain(self) -> int:
        """Read every pending byte; returns how many pokes were waiting."""
        total = 0
        while True:
            try:
                chunk = os.read(self._read_fd, 4096)
            except BlockingIOError:
                return total
            if not chunk:
                return total
            total += len(chunk)

    def close(self) -> None:
        for fd in (self._read_fd, self._keep_open_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._read_fd = self._keep_open_fd = -1
