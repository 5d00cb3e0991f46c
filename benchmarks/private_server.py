"""A private, throw-away PostgreSQL server started from the installed binaries.

The test suite falls back to one when no server answers, and the chaos benchmark runs on one
because it stops and starts the server under load. ``initdb`` and ``pg_ctl`` are looked up on
``PATH``, then under ``/usr/lib/postgresql/*/bin`` (newest major version first). The server
refuses to run as root, so as root every PostgreSQL tool runs as the ``postgres`` OS user. Its
data directory, log and unix socket live in one temporary directory, deleted by :meth:`stop`.
"""

from __future__ import annotations

import glob
import os
import pwd
import shlex
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import URL

DRIVER = "postgresql+psycopg"
LOCAL_HOST = "127.0.0.1"
LOCAL_USER = "postgres"
SERVER_START_TIMEOUT_S = 30

PRIVATE_SERVER_SETTINGS = {
    "listen_addresses": f"'{LOCAL_HOST}'",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "200",
}


class ServerUnavailable(RuntimeError):
    """No PostgreSQL server could be reached or started; the message says why."""


def find_binaries() -> Path:
    """The directory holding both ``initdb`` and ``pg_ctl``; newest major version first."""
    candidates: list[Path] = []
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(Path(on_path).parent)
        candidates.append(Path(on_path).resolve().parent)

    def major(directory: str) -> int:
        version = Path(directory).parent.name
        return int(version) if version.isdigit() else -1

    versioned = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=major, reverse=True)
    candidates.extend(Path(directory) for directory in versioned)
    for directory in candidates:
        if (directory / "initdb").is_file() and (directory / "pg_ctl").is_file():
            return directory
    raise ServerUnavailable("initdb and pg_ctl not found on PATH or in /usr/lib/postgresql/*/bin")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOCAL_HOST, 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class PrivateServer:
    """A server this process started in ``base_dir``; ``stop`` shuts it down and deletes it."""

    bin_dir: Path
    base_dir: Path
    port: int
    run_as: str | None
    running: bool = True

    @property
    def data_dir(self) -> Path:
        return self.base_dir / "data"

    @property
    def log_file(self) -> Path:
        return self.base_dir / "server.log"

    @property
    def admin_url(self) -> str:
        return URL.create(
            DRIVER, username=LOCAL_USER, host=LOCAL_HOST, port=self.port, database="postgres"
        ).render_as_string(hide_password=False)

    def _pg_ctl(self, *argv: str) -> None:
        _run(
            [
                str(self.bin_dir / "pg_ctl"),
                "-D",
                str(self.data_dir),
                "-w",
                "-t",
                str(SERVER_START_TIMEOUT_S),
                *argv,
            ],
            run_as=self.run_as,
            cwd=self.base_dir,
        )

    def shut_down(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m MODE``: every connection is cut; the data directory stays."""
        self._pg_ctl("-m", mode, "stop")
        self.running = False

    def start(self) -> None:
        """``pg_ctl start`` on the existing data directory; the log grows in ``log_file``."""
        try:
            self._pg_ctl("-l", str(self.log_file), "start")
        except ServerUnavailable as error:
            log = ""
            if self.log_file.exists():
                log = self.log_file.read_text(errors="replace")[-2000:]
            raise ServerUnavailable(f"{error}\n{log}") from error
        self.running = True

    def restart(self) -> None:
        """``pg_ctl restart -m fast``: every connection is cut, the data directory stays."""
        self._pg_ctl("-l", str(self.log_file), "-m", "fast", "restart")
        self.running = True

    def stop(self) -> None:
        """Shut the server down at once and delete its directory."""
        try:
            if self.running:
                self.shut_down("immediate")
        finally:
            self.running = False
            shutil.rmtree(self.base_dir, ignore_errors=True)


def _run(
    command: Sequence[str], *, run_as: str | None, cwd: Path
) -> subprocess.CompletedProcess[str]:
    """Run a PostgreSQL tool, as ``run_as`` when given (the server refuses to run as root)."""
    if run_as is not None:
        if shutil.which("runuser"):
            command = ["runuser", "-u", run_as, "--", *command]
        else:
            command = ["su", run_as, "-s", "/bin/sh", "-c", shlex.join(command)]
    env = {key: value for key, value in os.environ.items() if not key.startswith("PG")}
    env["LC_ALL"] = "C"
    result = subprocess.run(
        list(command),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=SERVER_START_TIMEOUT_S * 2,
        check=False,
    )
    if result.returncode != 0:
        raise ServerUnavailable(
            f"{shlex.join(command)} exited {result.returncode}: "
            f"{(result.stderr or result.stdout).strip()[-2000:]}"
        )
    return result


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    os.chown(root, uid, gid)
    for directory, subdirs, files in os.walk(root):
        for name in [*subdirs, *files]:
            os.chown(os.path.join(directory, name), uid, gid)


def start_private_server(
    bin_dir: Path | None = None, settings: Mapping[str, str] | None = None
) -> PrivateServer:
    """Initialise and start a throw-away server on a free local port.

    Durability is switched off (``fsync``, ``synchronous_commit``, ``full_page_writes``) because
    the data dies with the server; ``settings`` adds to or overrides
    :data:`PRIVATE_SERVER_SETTINGS` (values as ``postgresql.conf`` spells them). Its unix socket
    lives in the temporary directory, so it never collides with a system server. Raises
    ``ServerUnavailable`` when it cannot be started.
    """
    bin_dir = bin_dir or find_binaries()
    run_as: str | None = None
    owner: pwd.struct_passwd | None = None
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError as error:
            raise ServerUnavailable("running as root and no 'postgres' OS user exists") from error
        run_as = owner.pw_name

    base_dir = Path(tempfile.mkdtemp(prefix="ql3-pg-"))
    try:
        if owner is not None:
            _chown_tree(base_dir, owner.pw_uid, owner.pw_gid)
        server = PrivateServer(
            bin_dir=bin_dir, base_dir=base_dir, port=free_port(), run_as=run_as, running=False
        )
        _run(
            [
                str(bin_dir / "initdb"),
                "-D",
                str(server.data_dir),
                "-U",
                LOCAL_USER,
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ],
            run_as=run_as,
            cwd=base_dir,
        )
        conf = {
            **PRIVATE_SERVER_SETTINGS,
            **(settings or {}),
            "port": str(server.port),
            "unix_socket_directories": f"'{base_dir}'",
        }
        with (server.data_dir / "postgresql.conf").open("a", encoding="utf-8") as handle:
            handle.write("\n# throw-away server\n")
            handle.writelines(f"{key} = {value}\n" for key, value in conf.items())
        server.start()
    except BaseException:
        shutil.rmtree(base_dir, ignore_errors=True)
        raise
    return server
