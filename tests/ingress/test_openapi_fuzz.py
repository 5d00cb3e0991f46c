"""Schemathesis against the node's OpenAPI document: the ingress app exactly as ``ql3 serve``
builds it (``ql3.bootstrap.node``), on PostgreSQL, its commands running as the least-privilege
ingress role.

Every operation of the document gets a bounded number of generated requests, valid and
invalid ones, each sent twice over: by a stranger (the generated session id and secret) and
by the worker whose session holds a live lease (its session id, its secret, the id of the
Attempt it runs; the rest as generated). Each answer must conform to the document and never
be a 5xx, and a refused request (any 4xx) must leave every row of every table as it was; a
stranger's invalid request must also be refused.

The scheduler lifecycle is not started (the app's lifespan does not run), so nothing but the
request under test writes; a long poll is capped at a few milliseconds so that a claim that
finds nothing answers at once. Schemathesis's ``positive_data_acceptance`` check is left out:
JSON Schema calls ``100.0`` an integer and cannot say "no lone surrogate", and the ingress
refuses both on purpose (strict types, text the store can keep) with a 422, which this test
still holds to changing nothing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, note, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    ignored_auth,
    negative_data_rejection,
    positive_data_acceptance,
)
from starlette.types import ASGIApp, Receive, Scope, Send

from ql3.bootstrap.node import NodeContainer, build, close_stores, create_node_app
from tests.ingress.support import dump

pytestmark = pytest.mark.postgres

EXAMPLES = 6  # per operation, caller and mode
MAX_WAIT_MS = 5
REGISTRATION_TOKEN = "fuzz-registration-token"
TASK = "t"
OPERATIONS = {
    "GET /v1/health",
    "POST /v1/sessions",
    "POST /v1/sessions/{session_id}/heartbeat",
    "POST /v1/sessions/{session_id}/drain",
    "POST /v1/sessions/{session_id}/close",
    "POST /v1/sessions/{session_id}/claim",
    "POST /v1/sessions/{session_id}/renew",
    "POST /v1/sessions/{session_id}/complete",
    "POST /v1/sessions/{session_id}/release",
    "POST /v1/sessions/{session_id}/abandon",
}


@pytest.fixture(scope="module")
def node(pg_database_url: str, ingress_url: str) -> Iterator[NodeContainer]:
    container = build(
        database_url=pg_database_url,
        ingress_database_url=ingress_url,
        registration_token=REGISTRATION_TOKEN,
        pool_size=2,
        ingress_pool_size=2,
    )
    try:
        yield container
    finally:
        close_stores(container)


@pytest.fixture(scope="module")
def api(node: NodeContainer) -> Any:
    app = without_lifespan(create_node_app(node, run_startup_recovery=False))
    return schemathesis.openapi.from_asgi("/openapi.json", app)


def without_lifespan(app: ASGIApp) -> ASGIApp:
    """``app`` with its lifespan answered and not run: the node's scheduler lifecycle and
    dispatch listener stay off, so only the request under test writes."""

    async def serve(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)
            return
        while True:
            message = await receive()
            await send({"type": f"{message['type']}.complete"})
            if message["type"] == "lifespan.shutdown":
                return

    return serve


@pytest.fixture(scope="module")
def world(node: NodeContainer) -> World:
    return World(node)


class World:
    """The rows every example starts from: one queued Run, one Run running under the worker's
    live lease, the worker's open session. Made again only after an example changed a row."""

    def __init__(self, node: NodeContainer) -> None:
        self.node = node
        self.store = node.cluster.store()
        self.session_id = ""
        self.secret = ""
        self.attempt_id = ""
        self.baseline: dict[str, list[tuple[Any, ...]]] = {}
        self.make()

    def rows(self) -> dict[str, list[tuple[Any, ...]]]:
        return dump(self.store.engine)

    def make(self) -> None:
        self.store.testing_reset()
        admission = self.node.cluster.core.admission()
        for i in range(2):
            admission.submit(TASK, {"i": i})
        commands = self.node.ingress_commands()
        grant = commands.register("fuzz-worker", 2, [TASK])
        answer = commands.claim(grant.session_id, grant.secret, limit=1)
        assert len(answer.grants) == 1, answer
        self.session_id = grant.session_id
        self.secret = grant.secret
        self.attempt_id = answer.grants[0].attempt_id
        self.baseline = self.rows()

    def restore(self) -> None:
        """The starting rows again, if the last example changed any."""
        if self.rows() != self.baseline:
            self.make()


def as_worker(case: schemathesis.Case, world: World) -> None:
    """The worker's own identity in ``case``: session id, secret, its Attempt's id."""
    token = REGISTRATION_TOKEN if case.path == "/v1/sessions" else world.secret
    case.headers = {**(case.headers or {}), "Authorization": f"Bearer {token}"}
    if "session_id" in (case.path_parameters or {}):
        case.path_parameters = {**case.path_parameters, "session_id": world.session_id}
    body = case.body
    if isinstance(body, dict):
        for key in ("items", "completions"):
            items = body.get(key)
            if isinstance(items, list):
                for item in items:
                    if isinstance(item, dict) and "attempt_id" in item:
                        item["attempt_id"] = world.attempt_id
        if isinstance(body.get("held"), list):
            body["held"] = [world.attempt_id, *body["held"]]


def has_inputs(operation: Any) -> bool:
    return any(len(part) for part in (operation.body, operation.path_parameters, operation.headers))


def cap_long_poll(case: schemathesis.Case) -> None:
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("wait_ms"), int):
        body["wait_ms"] = min(body["wait_ms"], MAX_WAIT_MS)


FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
    database=None,
)


def check(case: schemathesis.Case, world: World, *, excluded: list[Any]) -> None:
    """No 5xx, nothing changed by a refusal, and an answer the document describes."""
    cap_long_poll(case)
    response = case.call()
    assert response.status_code < 500, (response.status_code, response.text)
    if response.status_code >= 400:
        assert world.rows() == world.baseline, (response.status_code, response.text)
    case.validate_response(response, excluded_checks=excluded)


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda mode: mode.value)
@pytest.mark.parametrize("caller", ["stranger", "worker"])
def test_no_5xx_and_a_refused_request_changes_nothing(
    api: Any, world: World, caller: str, mode: GenerationMode
) -> None:
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.label for op in operations} >= OPERATIONS

    for operation in operations:
        if mode is GenerationMode.NEGATIVE and not has_inputs(operation):
            continue  # nothing to make invalid
        exchanges(operation, mode, caller, world)()


def exchanges(operation: Any, mode: GenerationMode, caller: str, world: World) -> Any:
    """The bounded search of one operation: generated requests, each checked."""

    @FUZZ
    @given(case=operation.as_strategy(mode))
    def exchange(case: schemathesis.Case) -> None:
        note(operation.label)
        excluded = [positive_data_acceptance]
        if caller == "worker":
            as_worker(case, world)
            # Its auth is real, not generated, and its ids may repair what was made invalid.
            excluded += [ignored_auth, negative_data_rejection]
        try:
            check(case, world, excluded=excluded)
        finally:
            world.restore()

    return exchange
