"""Worker credentials end to end on PostgreSQL (ADR 0008): a node over TLS that requires
credentials, its database URL and its ingress role's password read from files; workers that
present their credential from a file and verify the node by a CA file.

Anonymous and unknown registrations are refused (401) and change nothing; workers rotate to a
second credential one at a time under load without a refusal or a lost claim; a revoked
worker is shut out at once but its running attempt waits for evidence; an expired credential
is refused; and no log of the run holds any secret handed out."""

from __future__ import annotations

import json
import re
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url

from tests.e2e.conftest import (
    CADENCE_S,
    LEASE_TTL_S,
    Cluster,
    Ledger,
    Process,
    listening_url,
    torn_down,
    wait_for,
)
from tests.postgres_server import connect, random_name

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

INGRESS_PASSWORD = "ingress-" + "p" * 24


def make_certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1, and its key."""
    cert, key = folder / "node.crt", folder / "node.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )
    return cert, key


class SecureCluster(Cluster):
    cert: Path
    secrets: list[str]

    def start_secure_node(self, ingress_url: str) -> str:
        url_file = self.workdir / "database-url"
        url_file.write_text(self.database_url + "\n")
        password_file = self.workdir / "ingress-password"
        password_file.write_text(INGRESS_PASSWORD + "\n")
        argv = ["serve", "--port", "0", "--lease-ttl", str(LEASE_TTL_S),
                "--cadence", str(CADENCE_S), "--require-credentials",
                "--tls-cert", str(self.cert), "--tls-key", str(self.cert.with_suffix(".key")),
                "--ingress-database-url", ingress_url,
                "--ingress-password-file", str(password_file),
                "--access-log", "--log-level", "debug"]
        process = self._spawn("secure-node", argv, env={"QL3_DATABASE_URL_FILE": str(url_file),
                                                        "QL3_DATABASE_URL": ""})
        url = listening_url(process)
        assert url.startswith("https://")
        self.nodes.append(url)
        return url

    def issue(self, *argv: str) -> dict[str, Any]:
        done = self.ql3("credentials", *argv, "--json")
        assert done.returncode == 0, done.stderr
        document: dict[str, Any] = json.loads(done.stdout)
        self.secrets.append(document["secret"])
        return document

    def start_credentialed_worker(self, prefix: str, worker_id: str, ledger: Ledger,
                                  secret: str) -> Process:
        credential = self.workdir / f"credential-{worker_id}-{len(self.processes)}"
        credential.write_text(secret + "\n")
        return self._spawn(
            f"worker-{worker_id}-{len(self.processes)}",
            ["worker", "--ingress", self.nodes[0], "--app", "tests.e2e.tasks:app",
             "--worker-id", worker_id, "--credential-file", str(credential),
             "--ca-file", str(self.cert), "--concurrency", "2"],
            env={"QL3_E2E_LEDGER": str(ledger.path), "QL3_E2E_PREFIX": prefix},
        )

    def register(self, worker_id: str, tasks: list[str], bearer: str | None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
        trust = ssl.create_default_context(cafile=str(self.cert))
        return httpx.post(f"{self.nodes[0]}/v1/sessions", verify=trust, timeout=10,
                          headers=headers,
                          json={"worker_id": worker_id, "capacity": 1, "tasks": tasks})

    def session_count(self) -> int:
        with connect(self.database_url) as conn:
            row = conn.execute("SELECT count(*) FROM worker_sessions").fetchone()
        assert row is not None
        return int(row[0])


@pytest.fixture(scope="module")
def secure(pg_database_url: str, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[SecureCluster]:
    workdir = tmp_path_factory.mktemp("credentials-e2e")
    built = SecureCluster(database_url=pg_database_url, workdir=workdir)
    built.secrets = [INGRESS_PASSWORD]
    built.cert, _ = make_certificate(workdir)
    role = random_name("ql3_e2e_cred_ingress_")
    granted = subprocess.run(
        ["ql3", "db", "grant-ingress", role, "--password-env", "INGRESS_PASSWORD"],
        capture_output=True, text=True, timeout=60,
        env={"PATH": str(Path(sys.executable).parent),
             "QL3_DATABASE_URL": pg_database_url, "INGRESS_PASSWORD": INGRESS_PASSWORD},
    )
    assert granted.returncode == 0, granted.stderr
    built.roles.append(role)
    ingress_url = make_url(pg_database_url).set(username=role, password=None)
    with torn_down(built):
        built.start_secure_node(ingress_url.render_as_string(hide_password=False))
        yield built


def test_a_anonymous_and_unknown_registrations_are_refused(secure: SecureCluster) -> None:
    before = secure.session_count()
    for bearer in (None, "ql3w_" + "x" * 43, "guess"):
        answer = secure.register("intruder-1", ["a.double"], bearer)
        assert answer.status_code == 401, answer.text
        assert answer.json()["error"] == "unauthorized"
    # TLS is verified: a client that does not trust the node's certificate gets nowhere.
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{secure.nodes[0]}/v1/health", timeout=5)
    assert secure.session_count() == before


def test_b_rotation_under_load_loses_no_claim(secure: SecureCluster, ledger: Ledger) -> None:
    old = secure.issue("issue", "rot-*")
    workers = {w: secure.start_credentialed_worker("b", w, ledger, old["secret"])
               for w in ("rot-1", "rot-2")}
    runs = [secure.submit("b.sleep", {"seconds": 0.05}) for _ in range(40)]
    # Under load: both work under the old credential when it is rotated.
    wait_for(lambda: all("registered session" in p.output() for p in workers.values()), 30,
             "the workers to register")
    new = secure.issue("rotate", old["id"])
    assert new["worker_pattern"] == "rot-*" and new["rotates_id"] == old["id"]
    for worker_id, process in list(workers.items()):
        process.signal(signal.SIGTERM)  # a drain: what it holds finishes or is handed back
        assert process.wait() == 0, process.output()
        workers[worker_id] = secure.start_credentialed_worker("b", worker_id, ledger,
                                                              new["secret"])
        runs += [secure.submit("b.sleep", {"seconds": 0.05}) for _ in range(10)]
    revoked = secure.ql3("credentials", "revoke", old["id"], "--reason", "rotated", "--json")
    assert revoked.returncode == 0, revoked.stderr
    assert json.loads(revoked.stdout)["revoked_session_ids"] == []
    secure.wait_status(runs, {"succeeded"}, timeout=60)
    for run_id in runs:
        assert [a["status"] for a in secure.show(run_id)["attempts"]] == ["succeeded"]
    for process in workers.values():
        # A status of 401 as a word (the log's ids are hex, and may hold those digits).
        output = process.output()
        assert not re.search(r"\b401\b", output) and "refused" not in output, output
    audit = secure.ql3("credentials", "audit", new["id"], "--json")
    used = [e for e in json.loads(audit.stdout) if e["type"] == "used"]
    assert sorted(e["worker_id"] for e in used) == ["rot-1", "rot-2"]
    for process in workers.values():
        process.stop()


def test_c_revocation_shuts_the_worker_out_and_recovery_waits(
    secure: SecureCluster, ledger: Ledger
) -> None:
    issued = secure.issue("issue", "rev-1")
    run_id = secure.submit("c.sleep", {"seconds": 120})
    worker = secure.start_credentialed_worker("c", "rev-1", ledger, issued["secret"])
    secure.wait_status([run_id], {"running"}, timeout=30)
    wait_for(lambda: bool(ledger.entries("start", run_id)), 20, "the task to start")
    revoked = secure.ql3("credentials", "revoke", issued["id"], "--json")
    assert revoked.returncode == 0, revoked.stderr
    (session_id,) = json.loads(revoked.stdout)["revoked_session_ids"]
    # The worker's next call is refused: it stops. Its attempt is not declared stopped.
    assert worker.wait(timeout=30) != 0
    time.sleep(2 * LEASE_TTL_S + 2 * CADENCE_S)
    shown = secure.show(run_id)
    assert shown["status"] == "running"
    assert [a["status"] for a in shown["attempts"]] == ["running"]
    answer = secure.register("rev-1", ["c.sleep"], issued["secret"])
    assert answer.status_code == 401 and answer.json()["reason"] == "revoked"
    attempt_id = shown["attempts"][0]["id"]
    attested = secure.ql3("attempts", "attest-stopped", attempt_id, "--reason", "host wiped")
    assert attested.returncode == 0, attested.stderr
    secure.wait_status([run_id], {"failed"}, timeout=20)
    assert session_id


def test_d_expired_and_out_of_scope_credentials_are_refused(secure: SecureCluster) -> None:
    short = secure.issue("issue", "exp-*", "--expires-in", "1s")
    scoped = secure.issue("issue", "scope-*", "--task", "d.double")
    before = secure.session_count()
    time.sleep(1.2)
    expired = secure.register("exp-1", ["d.double"], short["secret"])
    assert expired.status_code == 401 and expired.json()["reason"] == "expired"
    other_task = secure.register("scope-1", ["d.double", "d.sleep"], scoped["secret"])
    assert other_task.status_code == 403 and other_task.json()["reason"] == "task_not_allowed"
    other_worker = secure.register("exp-1", ["d.double"], scoped["secret"])
    assert other_worker.status_code == 403
    assert secure.session_count() == before
    granted = secure.register("scope-1", ["d.double"], scoped["secret"])
    assert granted.status_code == 201
    secure.secrets.append(granted.json()["secret"])


def test_z_no_log_holds_a_secret_handed_out(secure: SecureCluster) -> None:
    logs = {p.name: p.output() for p in secure.processes}
    assert any("registered session" in text for text in logs.values())  # the logs are there
    assert len(secure.secrets) >= 6
    for name, text in logs.items():
        for secret in secure.secrets:
            assert secret not in text, f"{name} logged a secret"
