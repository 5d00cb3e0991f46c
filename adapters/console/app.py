"""The operator console as an ASGI app (ADR 0020): server-rendered pages (Jinja2, every value
escaped), htmx served from the package, a strict Content-Security-Policy, a same-origin check
on every state-changing request, viewers who read and operators who act.

The pages read through the application's queries; the actions are the application's commands
(:class:`ql3.application.console_actions.ConsoleActions`). Nothing here decides a rule."""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.staticfiles import StaticFiles

from ql3.adapters.console.auth import Operator, Role
from ql3.adapters.console.bulk import BulkJobs
from ql3.adapters.console.feed import ChangeFeed
from ql3.adapters.console.graph import workflow_graph
from ql3.adapters.console.views import bars, describe_trigger
from ql3.application.admission import UnknownRun
from ql3.application.bulk import BulkActions, BulkRequest
from ql3.application.console import (
    DAY_MS,
    DEFAULT_RUNS_PAGE,
    HOUR_MS,
    LIVE_STATUSES,
    MAX_RUNS_PAGE,
    ConsoleQueries,
    RunBrowser,
    RunCursor,
    RunFilter,
    RunOrder,
)
from ql3.application.console_actions import RERUNNABLE, ConsoleActions, Done, again_of
from ql3.application.lookups import UnknownAttempt
from ql3.application.operations import Doctor
from ql3.application.ports import HARD_PAGE_CAP, OperationsSource
from ql3.application.queries import RunQueries
from ql3.application.task_limits import TaskLimits
from ql3.domain.bulk import BulkAction
from ql3.domain.credentials import UnknownCredential
from ql3.domain.errors import DomainError, InvalidTransition
from ql3.domain.model import JsonValue, RunStatus
from ql3.domain.rerun import needs_confirmation

log = logging.getLogger("ql3.console")

HERE = Path(__file__).parent
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
MAX_FORM_BYTES = 64_000
TASK_WINDOWS = {"1h": HOUR_MS, "24h": DAY_MS, "7d": 7 * DAY_MS}


@dataclass
class ConsoleServices:
    """What the console reads and acts through, built by :mod:`ql3.bootstrap.console`."""

    browser: RunBrowser
    operations: OperationsSource
    runs: RunQueries
    limits: TaskLimits
    actions: ConsoleActions
    feed: ChangeFeed
    credentials: Any = None  # CredentialCommands, on the stores that keep credentials
    triggers: Any = None  # (Triggers, CronCalendar) on the stores that keep triggers

    def __post_init__(self) -> None:
        self.bulk = BulkActions(self.browser, self.actions)
        self.jobs = BulkJobs(self.bulk, self.feed_now)

    def feed_now(self) -> int:
        """The store's clock, as a page read by primary key observes it (an empty one)."""
        empty = RunFilter(run_id="")
        return self.browser.browse_runs(empty, RunOrder.OLDEST, None, 1).observed_at_ms

    @property
    def queries(self) -> ConsoleQueries:
        return ConsoleQueries(self.browser, self.operations)


Identify = Callable[[Request], "Operator | None"]


class Refused(Exception):
    """A client's mistake, answered with ``status`` and a message (never a 5xx)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _iso(ms: int | None) -> str:
    if ms is None:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _age(now_ms: int, ms: int | None) -> str:
    if ms is None:
        return "-"
    seconds = max(0, now_ms - ms) // 1000
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    if seconds < 172_800:
        return f"{seconds // 3600} h"
    return f"{seconds // 86400} d"


def _pretty(value: JsonValue) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)


def _environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(HERE / "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["iso"] = _iso
    env.filters["pretty"] = _pretty
    env.globals["age"] = _age
    return env


def _time_param(value: str | None, name: str) -> int | None:
    if not value:
        return None
    try:
        moment = dt.datetime.fromisoformat(value)
    except ValueError:
        raise Refused(400, f"{name} is not an ISO 8601 time: {value[:40]!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return int(moment.timestamp() * 1000)


def run_filter(params: Mapping[str, str], statuses: list[str]) -> RunFilter:
    try:
        chosen = tuple(RunStatus(s) for s in statuses if s)
    except ValueError:
        raise Refused(400, "unknown status") from None
    document: Any = None
    if params.get("input"):
        try:
            document = json.loads(params["input"])
        except json.JSONDecodeError as error:
            raise Refused(400, f"the input filter is not JSON: {error.msg}") from None
        if not isinstance(document, dict):
            raise Refused(400, "the input filter must be a JSON object")
    try:
        return RunFilter(
            statuses=chosen,
            task=params.get("task") or None,
            created_from_ms=_time_param(params.get("since"), "since"),
            created_to_ms=_time_param(params.get("until"), "until"),
            unique_key=params.get("key") or None,
            run_id=params.get("id") or None,
            input_contains=document,
        )
    except DomainError as error:
        raise Refused(400, str(error)) from None


def create_app(
    services: ConsoleServices,
    identify: Identify,
    *,
    title: str = "QL3 console",
) -> FastAPI:
    """The console. ``identify`` says who sent a request (None: nobody signed in, answered
    401 with a Basic challenge)."""
    env = _environment()
    app = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        if request.method not in ("GET", "HEAD") and not _same_origin(request):
            response: Response = _plain(403, "refused: not a same-origin request")
        else:
            response = await call_next(request)
        for name, value in SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)
        return response

    @app.exception_handler(Refused)
    async def refused(request: Request, error: Refused) -> Response:
        return _page(request, "error.html", {"message": error.message}, status=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        if error.status_code == 401:
            return _plain(401, "sign in", {"WWW-Authenticate": 'Basic realm="ql3 console"'})
        return _plain(error.status_code, str(error.detail))

    @app.exception_handler(Exception)
    async def failed(request: Request, error: Exception) -> Response:
        # The store unreachable and the like: one line in the log, no traceback on the page.
        log.error("console: %s on %s: %s", type(error).__name__, request.url.path, error)
        return _plain(503, f"unavailable: {type(error).__name__}")

    def who(request: Request) -> Operator:
        operator = identify(request)
        if operator is None:
            raise HTTPException(401)
        return operator

    def acting(request: Request) -> Operator:
        operator = who(request)
        if not operator.may_act:
            raise HTTPException(403, "refused: a viewer may not act")
        return operator

    def _page(
        request: Request, template: str, context: dict[str, Any], status: int = 200
    ) -> Response:
        operator = identify(request)
        body = env.get_template(template).render(
            request=request,
            operator=operator,
            may_act=operator is not None and operator.may_act,
            base=str(request.scope.get("root_path", "")).rstrip("/"),
            title=title,
            **context,
        )
        return HTMLResponse(body, status_code=status)

    async def _read(call: Callable[[], Any]) -> Any:
        try:
            return await run_in_threadpool(call)
        except DomainError as error:
            raise Refused(400, str(error)) from None

    # --- pages ------------------------------------------------------------------------------

    @app.get("/", response_class=HTMLResponse)
    async def overview(request: Request) -> Response:
        who(request)
        data = await _read(services.queries.overview)
        view = data.operations
        states: dict[str, int] = {}
        for found in view.sessions:
            states[found.session.status.value] = states.get(found.session.status.value, 0) + 1
        return _page(
            request,
            "overview.html",
            {
                "o": data,
                "view": view,
                "now": view.observed_at_ms,
                "statuses": list(RunStatus),
                "live_statuses": LIVE_STATUSES,
                "hour_chart": bars(data.last_hour, "minute"),
                "day_chart": bars(data.last_day, "hour"),
                "session_states": states,
            },
        )

    @app.get("/runs", response_class=HTMLResponse)
    async def runs_page(request: Request) -> Response:
        who(request)
        params = request.query_params
        where = run_filter(params, params.getlist("status"))
        try:
            order = RunOrder(params.get("order") or RunOrder.NEWEST.value)
            after = RunCursor.parse(params["after"]) if params.get("after") else None
            limit = int(params.get("limit") or DEFAULT_RUNS_PAGE)
        except (ValueError, DomainError) as error:
            raise Refused(400, f"bad page: {error}") from None
        if not 1 <= limit <= MAX_RUNS_PAGE:
            raise Refused(400, f"a page holds 1..{MAX_RUNS_PAGE} runs")
        page, count = await _read(lambda: services.queries.runs(where, order, after, limit))
        kept = [(k, v) for k, v in params.multi_items() if k != "after" and v]
        next_url = None
        if page.next_cursor is not None:
            next_url = "?" + urlencode([*kept, ("after", page.next_cursor.token())])
        return _page(
            request,
            "runs.html",
            {
                "page": page,
                "count": count,
                "params": params,
                "chosen": set(params.getlist("status")),
                "statuses": list(RunStatus),
                "next_url": next_url,
                "first_url": "?" + urlencode(kept),
                "bulk_query": urlencode(kept),
                "now": page.observed_at_ms,
                "order": order.value,
            },
        )

    @app.get("/runs/{run_id}", response_class=HTMLResponse)
    async def run_page(request: Request, run_id: str) -> Response:
        who(request)
        view = await _read(lambda: services.runs.show(run_id))
        if view is None:
            raise Refused(404, f"not found: run {run_id}")
        last_sequence = view.events[-1][0] if view.events else 0
        again = await _read(lambda: services.browser.runs_again_of(run_id, last_sequence))
        graph = workflow_graph(view.steps) if view.steps else None
        return _page(
            request,
            "run.html",
            {
                "v": view,
                "r": view.run,
                "now": view.observed_at_ms,
                "again_of": again_of(view.events),
                "again": again,
                "graph": graph,
                "rerunnable": view.run.status in RERUNNABLE
                and view.run.parent_run_id is None
                and view.run.owner.value == "runtime",
                "confirm": needs_confirmation(view.run),
                "input_text": _pretty(view.run.input),
            },
        )

    @app.get("/tasks", response_class=HTMLResponse)
    async def tasks_page(request: Request) -> Response:
        who(request)
        window = request.query_params.get("window") or "1h"
        if window not in TASK_WINDOWS:
            raise Refused(400, f"the window is one of {', '.join(TASK_WINDOWS)}")

        def read() -> Any:
            limits = {limit.task: limit.max_running for limit in services.limits.all()}
            return services.queries.tasks(TASK_WINDOWS[window], limits)

        rows = await _read(read)
        return _page(
            request, "tasks.html", {"rows": rows, "window": window, "windows": list(TASK_WINDOWS)}
        )

    @app.get("/workers", response_class=HTMLResponse)
    async def workers_page(request: Request) -> Response:
        who(request)
        view = await _read(lambda: services.operations.operations_view(HARD_PAGE_CAP))
        credentials = None
        if services.credentials is not None:
            credentials = await _read(services.credentials.list_credentials)
        return _page(
            request,
            "workers.html",
            {"view": view, "now": view.observed_at_ms, "credentials": credentials},
        )

    @app.get("/triggers", response_class=HTMLResponse)
    async def triggers_page(request: Request) -> Response:
        who(request)
        if services.triggers is None:
            raise Refused(404, "this store keeps no triggers")
        triggers, calendar = services.triggers

        def read() -> Any:
            rows = []
            for trigger in triggers.list_triggers():
                words, upcoming = describe_trigger(trigger, calendar, 5)
                rows.append((trigger, words, upcoming, triggers.firings(trigger.name, 5)))
            return rows

        return _page(request, "triggers.html", {"rows": await _read(read)})

    @app.get("/workflows", response_class=HTMLResponse)
    async def workflows_page(request: Request) -> Response:
        who(request)
        page, _count = await _read(
            lambda: services.queries.runs(
                RunFilter(workflows=True), RunOrder.NEWEST, None, MAX_RUNS_PAGE
            )
        )
        workflows = page.runs
        return _page(
            request,
            "workflows.html",
            {"workflows": workflows, "now": page.observed_at_ms},
        )

    @app.get("/doctor", response_class=HTMLResponse)
    async def doctor_page(request: Request) -> Response:
        who(request)
        view, findings = await _read(Doctor(services.operations).examine)
        return _page(request, "doctor.html", {"findings": findings, "now": view.observed_at_ms})

    @app.get("/events")
    async def events(request: Request) -> Response:
        who(request)

        async def stream() -> AsyncIterator[bytes]:
            marker = await run_in_threadpool(services.feed.marker)
            yield b"retry: 3000\n\n"
            while not await request.is_disconnected():
                changed, marker = await run_in_threadpool(services.feed.wait_past, marker)
                if changed:
                    yield f"event: changed\ndata: {marker}\n\n".encode()
                else:
                    yield b": still here\n\n"

        return StreamingResponse(
            stream(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    # --- actions ----------------------------------------------------------------------------

    async def _form(request: Request) -> Mapping[str, str]:
        return dict(await _pairs(request))

    async def _pairs(request: Request) -> list[tuple[str, str]]:
        """The fields of an url-encoded form (the console's forms post nothing else)."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind not in ("application/x-www-form-urlencoded", ""):
            raise Refused(415, "the console takes url-encoded forms only")
        body = await request.body()
        if len(body) > MAX_FORM_BYTES:
            raise Refused(413, f"a form holds at most {MAX_FORM_BYTES} bytes")
        try:
            return parse_qsl(body.decode("utf-8"), keep_blank_values=True, strict_parsing=False)
        except (UnicodeDecodeError, ValueError):
            raise Refused(400, "the form is not url-encoded UTF-8") from None

    async def _act(
        request: Request, action: Callable[[Operator, Mapping[str, str]], Done]
    ) -> Response:
        operator = acting(request)
        form = await _form(request)
        try:
            done = await run_in_threadpool(action, operator, form)
        except (UnknownRun, UnknownAttempt, UnknownCredential, LookupError) as error:
            raise Refused(404, f"not found: {error}") from None
        except InvalidTransition as error:  # the run (or credential) is past that action
            raise Refused(409, str(error)) from None
        except DomainError as error:
            raise Refused(400, str(error)) from None
        return _page(request, "done.html", {"done": done}, status=200)

    @app.post("/runs/{run_id}/cancel")
    async def cancel(request: Request, run_id: str) -> Response:
        return await _act(
            request,
            lambda op, form: services.actions.cancel(op.name, run_id, form.get("reason", "")),
        )

    @app.post("/runs/{run_id}/quarantine")
    async def quarantine(request: Request, run_id: str) -> Response:
        return await _act(
            request,
            lambda op, form: services.actions.quarantine(op.name, run_id, form.get("reason", "")),
        )

    @app.post("/runs/{run_id}/unquarantine")
    async def unquarantine(request: Request, run_id: str) -> Response:
        return await _act(
            request,
            lambda op, form: services.actions.unquarantine(op.name, run_id, form.get("reason", "")),
        )

    @app.post("/attempts/{attempt_id}/attest-stopped")
    async def attest(request: Request, attempt_id: str) -> Response:
        return await _act(
            request,
            lambda op, form: services.actions.attest_stopped(
                op.name, attempt_id, form.get("reason", "")
            ),
        )

    @app.post("/tasks/limit")
    async def set_limit(request: Request) -> Response:
        def act(op: Operator, form: Mapping[str, str]) -> Done:
            task = form.get("task", "")
            if not task or task.strip() != task:
                raise Refused(400, "name the task, without padding")
            if form.get("clear"):
                return services.actions.clear_limit(op.name, task)
            try:
                max_running = int(form.get("max_running", ""))
            except ValueError:
                raise Refused(400, "the limit is a whole number") from None
            return services.actions.set_limit(op.name, task, max_running)

        return await _act(request, act)

    @app.post("/credentials/{credential_id}/revoke")
    async def revoke(request: Request, credential_id: str) -> Response:
        return await _act(
            request,
            lambda op, form: services.actions.revoke_credential(
                op.name, credential_id, form.get("reason", "")
            ),
        )

    @app.post("/runs/{run_id}/again")
    async def again(request: Request, run_id: str) -> Response:
        def act(op: Operator, form: Mapping[str, str]) -> Done:
            try:
                document = json.loads(form.get("input", "null"))
            except json.JSONDecodeError as error:
                raise Refused(400, f"the input is not JSON: {error.msg}") from None
            return services.actions.run_again(op.name, run_id, document, form.get("confirm"))

        return await _act(request, act)

    # --- bulk actions -----------------------------------------------------------------------

    def _bulk_request(pairs: list[tuple[str, str]]) -> BulkRequest:
        fields = dict(pairs)
        try:
            action = BulkAction(fields.get("action", ""))
        except ValueError:
            raise Refused(400, "the bulk action is cancel or run_again") from None
        query = fields.get("query", "")
        if len(query) > MAX_FORM_BYTES:
            raise Refused(400, "the filter is too long")
        params = parse_qsl(query, keep_blank_values=False)
        where = run_filter(dict(params), [v for k, v in params if k == "status"])
        selected = tuple(dict.fromkeys(v for k, v in pairs if k == "run" and v))
        if fields.get("scope") == "selected" and not selected:
            raise Refused(400, "select runs first, or act on everything the filter matches")
        try:
            return BulkRequest(
                action=action,
                where=where,
                run_ids=selected if fields.get("scope") == "selected" else (),
                reason=fields.get("reason", "")[:200],
            )
        except DomainError as error:
            raise Refused(400, str(error)) from None

    @app.post("/bulk/preview", response_class=HTMLResponse)
    async def bulk_preview(request: Request) -> Response:
        acting(request)
        pairs = await _pairs(request)
        wanted = _bulk_request(pairs)
        began = await _read(services.feed_now)
        count = await _read(lambda: services.bulk.preview(wanted, began))
        return _page(
            request,
            "bulk_preview.html",
            {"wanted": wanted, "count": count, "pairs": pairs, "began": began},
        )

    @app.post("/bulk")
    async def bulk_start(request: Request) -> Response:
        operator = acting(request)
        pairs = await _pairs(request)
        wanted = _bulk_request(pairs)
        try:
            began = int(dict(pairs).get("began", ""))
        except ValueError:
            raise Refused(400, "start the bulk action from its preview") from None
        count = await _read(lambda: services.bulk.preview(wanted, began))
        job = services.jobs.start(operator.name, wanted, began, count.value)
        base = str(request.scope.get("root_path", "")).rstrip("/")
        return Response(status_code=303, headers={"Location": f"{base}/bulk/{job.id}"})

    @app.get("/bulk", response_class=HTMLResponse)
    async def bulk_jobs(request: Request) -> Response:
        who(request)
        return _page(request, "bulk_jobs.html", {"jobs": services.jobs.all()})

    @app.get("/bulk/{job_id}", response_class=HTMLResponse)
    async def bulk_job(request: Request, job_id: str) -> Response:
        who(request)
        job = services.jobs.get(job_id)
        if job is None:
            raise Refused(404, f"not found: bulk job {job_id} (jobs live as long as the console)")
        return _page(request, "bulk_job.html", {"job": job})

    return app


def _plain(status: int, text: str, headers: Mapping[str, str] | None = None) -> Response:
    return Response(text + "\n", status_code=status, media_type="text/plain", headers=headers)


def _same_origin(request: Request) -> bool:
    """The request comes from a page of this console: its ``Origin`` (or, without one, its
    ``Referer``) names this host, or the browser says ``Sec-Fetch-Site: same-origin``."""
    host = request.headers.get("host")
    site = request.headers.get("sec-fetch-site")
    if site is not None and site != "same-origin":
        return False
    source = request.headers.get("origin") or request.headers.get("referer")
    if source is None or source == "null":
        return site == "same-origin"
    return bool(host) and urlsplit(source).netloc == host


__all__ = ["ConsoleServices", "Role", "create_app"]
