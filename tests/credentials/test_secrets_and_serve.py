"""Secrets from files, read again when they change (ADR 0008), and ``ql3 serve``'s refusal to
let anonymous workers register off a loopback address."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from sqlalchemy import event, text
from sqlalchemy.engine import make_url

from ql3.adapters.cli.main import main
from ql3.adapters.cli.secure import node_settings, warn_if_anonymous
from ql3.adapters.postgres.engine import pooled_engine, refresh_on_connect
from ql3.adapters.secrets import FileSecret, SecretUnavailable, from_environment, secret_source


def _write(path: Path, content: str, tick: int) -> None:
    path.write_text(content)
    os.utime(path, ns=(tick, tick))  # a distinct modification time, whatever the clock


def test_a_file_secret_is_read_again_once_it_changed(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    _write(path, "first-value\n", 1_000_000_000)
    secret = FileSecret(str(path))
    assert secret() == "first-value"
    _write(path, "second-value\r\n", 2_000_000_000)
    assert secret() == "second-value"
    assert "second-value" not in repr(secret)
    path.unlink()
    with pytest.raises(SecretUnavailable) as missing:
        secret()
    assert str(path) in str(missing.value)


def test_empty_missing_or_doubly_given_secrets_are_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(SecretUnavailable):
        FileSecret(str(empty))
    with pytest.raises(SecretUnavailable):
        FileSecret(str(tmp_path / "none"))
    with pytest.raises(ValueError):
        secret_source("value", str(empty), what="x")
    assert secret_source(None, None, what="x") is None
    named = tmp_path / "named"
    named.write_text("from-file")
    source = from_environment("QL3_X", {"QL3_X_FILE": str(named)})
    assert source is not None and source() == "from-file"
    fixed = from_environment("QL3_X", {"QL3_X": "from-env"})
    assert fixed is not None and fixed() == "from-env"


@pytest.mark.postgres
def test_new_connections_use_the_url_and_password_in_their_files_now(
    pg_database_url: str, tmp_path: Path
) -> None:
    url_file = tmp_path / "url"
    _write(url_file, pg_database_url, 1_000_000_000)
    password_file = tmp_path / "password"
    _write(password_file, "first-password", 1_000_000_000)
    engine = pooled_engine(pg_database_url, pool_size=1)
    refresh_on_connect(
        engine, url_source=FileSecret(str(url_file)), password_source=FileSecret(str(password_file))
    )
    passwords: list[str] = []
    event.listen(engine, "do_connect", lambda d, r, a, params: passwords.append(params["password"]))

    def database() -> str:
        with engine.connect() as connection:
            return str(connection.execute(text("SELECT current_database()")).scalar_one())

    try:
        assert database() == make_url(pg_database_url).database
        other = make_url(pg_database_url).set(database="postgres")
        _write(url_file, other.render_as_string(hide_password=False), 2_000_000_000)
        _write(password_file, "second-password", 2_000_000_000)
        assert database() != "postgres"  # the open pooled connection is kept
        engine.dispose()  # the pool replaces its connection: the next one reads the files
        assert database() == "postgres"
        assert passwords == ["first-password", "second-password"]
    finally:
        engine.dispose()


def test_serve_off_loopback_without_authentication_exits_2_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("QL3_REGISTRATION_TOKEN", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "--require-credentials" in err and "--allow-anonymous-workers" in err
    assert main(["serve", "--host", "::", "--require-credentials",
                 "--allow-anonymous-workers"]) == 2


def test_only_a_node_off_loopback_without_authentication_counts_as_anonymous(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("QL3_REGISTRATION_TOKEN", raising=False)

    def anonymous(host: str, *, require: bool = False, allow: bool = False) -> bool:
        options = {
            "require_credentials": require,
            "allow_anonymous_workers": allow,
            "tls_cert": None,
            "tls_key": None,
            "database_url_file": None,
            "ingress_database_url_file": None,
            "ingress_password_file": None,
        }
        return bool(node_settings(host, "sqlite:///x", None, options)["anonymous_workers"])

    assert anonymous("0.0.0.0", allow=True)  # shown in `ql3 status` (ADR 0008)
    assert not anonymous("127.0.0.1")
    assert not anonymous("127.0.0.1", allow=True)
    assert not anonymous("0.0.0.0", require=True)
    monkeypatch.setenv("QL3_REGISTRATION_TOKEN", "t")
    assert not anonymous("0.0.0.0")


def test_anonymous_workers_off_loopback_are_warned(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ql3.node")
    warn_if_anonymous("0.0.0.0", False, {"registration_token": None})
    assert any(r.levelno == logging.WARNING and "anonymous" in r.message for r in caplog.records)
    caplog.clear()
    warn_if_anonymous("0.0.0.0", True, {"registration_token": None})
    assert not caplog.records
