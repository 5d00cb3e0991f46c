"""What the ingress's routes share: the state a node gives the app (its commands, the claim
signal, its settings) and the dependencies that read it, the secret and the path ids."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import AfterValidator

from ql3.adapters.http.auth import RegistrationAuth
from ql3.adapters.http.errors import ApiError
from ql3.adapters.http.schemas import MAX_ID_LENGTH, storable
from ql3.adapters.http.wake import ClaimSignal
from ql3.application.worker_commands import WorkerCommands

log = logging.getLogger("ql3.ingress")

bearer = HTTPBearer(auto_error=False, description="The session secret.")


@dataclass(frozen=True, slots=True)
class IngressState:
    """The app's collaborators, in ``app.state.ingress``.

    ``on_attempts_ended`` is called after an abandon that lost Attempts, so a node can run its
    scheduler cycle (lost retry) early. Completions do not call it: claims refill freed slots
    themselves, and a cycle per completion would keep the scheduler busy under load."""

    commands: WorkerCommands
    signal: ClaimSignal
    heartbeat_interval_ms: int
    registration_token: str | None = None
    on_attempts_ended: Callable[[], None] | None = None
    registration: RegistrationAuth | None = None

    @property
    def registration_auth(self) -> RegistrationAuth:
        """How registrations are admitted (ADR 0008); without one, by the token alone."""
        if self.registration is not None:
            return self.registration
        return RegistrationAuth(token=self.registration_token)

    def attempts_ended(self) -> None:
        if self.on_attempts_ended is None:
            return
        try:
            self.on_attempts_ended()
        except Exception:  # a wake-up is an optimisation; the cadence runs anyway
            log.exception("waking the scheduler failed")


# The dependencies are coroutines: FastAPI would run plain functions in a worker thread.


async def ingress_state(request: Request) -> IngressState:
    state: IngressState = request.app.state.ingress
    return state


async def session_secret(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> str:
    if credentials is None or not credentials.credentials:
        raise ApiError(401, "unauthorized", "send the session secret as a bearer token")
    return credentials.credentials


Ingress = Annotated[IngressState, Depends(ingress_state)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
Secret = Annotated[str, Depends(session_secret)]
SessionId = Annotated[
    str,
    Path(min_length=1, max_length=MAX_ID_LENGTH, description="The session's id."),
    AfterValidator(storable),
]
