"""Logging of the long-running commands (``ql3 serve``, ``ql3 worker``, ``ql3 standalone``):
text lines or one JSON object per line (``--log-format json``, ADR 0010).

A JSON line carries ``time``, ``level``, ``logger``, ``message`` and, where they apply,
``run_id``, ``attempt_id``, ``worker_id``, ``session_id`` and ``step``: from the record's
``extra`` or from the process's context (a worker's id is on every line it logs). Whatever the
format, every line passes through :class:`Redactor` first: the secrets the process was handed
(a registration token, database passwords) and anything after ``Bearer`` are replaced, so no
secret or token reaches a log even when an error message quotes one."""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import sys
from collections.abc import Iterable, Mapping
from typing import TextIO

FORMATS = ("text", "json")
FIELDS = ("run_id", "attempt_id", "worker_id", "session_id", "step")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
HIDDEN = "***"
_BEARER = re.compile(r"(?i)(bearer\s+)[^\s\"',;]+")
_URL_PASSWORD = re.compile(r"(://[^:/@\s]+:)[^@\s]+(@)")


def url_password(url: str | None) -> str | None:
    """The password of a database URL, if it has one."""
    if not url:
        return None
    from sqlalchemy.engine import make_url  # only a process that has a database URL pays for it

    try:
        return make_url(url).password
    except Exception:
        return None


_NAMED_ID = re.compile(r"\b(attempt|run|session|worker) (%[sr])|(%[a-z%])")
_ID_FIELDS = {
    "attempt": "attempt_id",
    "run": "run_id",
    "session": "session_id",
    "worker": "worker_id",
}


class IdFields(logging.Filter):
    """Fields from the ids a message names by the project's wording (``"attempt %s ..."``,
    ``"session %s ..."``): each such argument also becomes ``attempt_id``, ``session_id``, ...
    unless the record carries that field already. Runs before :class:`Redactor` merges the
    arguments into the message."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(record.msg, str) or not isinstance(args, tuple):
            return True
        index = 0
        for match in _NAMED_ID.finditer(record.msg):
            if match.group(3) == "%%":
                continue
            if match.group(1) and index < len(args):
                name = _ID_FIELDS[match.group(1)]
                if not getattr(record, name, None):
                    setattr(record, name, str(args[index]))
            index += 1
        return True


class Redactor(logging.Filter):
    """Replaces known secrets, bearer tokens and URL passwords in a record's message, its
    arguments already merged in, and in its exception text."""

    def __init__(self, secrets: Iterable[str | None] = ()) -> None:
        super().__init__()
        self._secrets = sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True)

    def redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, HIDDEN)
        text = _BEARER.sub(rf"\g<1>{HIDDEN}", text)
        return _URL_PASSWORD.sub(rf"\g<1>{HIDDEN}\g<2>", text)

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = self.redact(record.getMessage())
        record.args = None
        if record.exc_info:
            record.exc_text = self.redact(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True


class JsonFormatter(logging.Formatter):
    def __init__(self, context: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self._context = dict(context or {})

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, object] = {
            "time": dt.datetime.fromtimestamp(record.created, tz=dt.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None) or self._context.get(name)
            if value:
                document[name] = value
        if record.exc_text:
            document["error"] = record.exc_text
        return json.dumps(document, default=str)


def configure(
    level: str,
    log_format: str,
    *,
    context: Mapping[str, str] | None = None,
    secrets: Iterable[str | None] = (),
    stream: TextIO | None = None,
) -> logging.Handler:
    """One handler on ``stream`` (stderr) for the root logger, in ``log_format``, behind a
    redactor."""
    if log_format not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.addFilter(IdFields())
    handler.addFilter(Redactor(secrets))
    if log_format == "json":
        handler.setFormatter(JsonFormatter(context))
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    return handler
