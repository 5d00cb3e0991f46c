"""Log lines (ADR 0010): JSON objects with the fields that apply, and no secret in any format."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from ql3.adapters import logs

SECRET = "s3cr3t-registration-token"


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    yield stream
    root.handlers[:] = before[0]
    root.setLevel(before[1])


def test_json_lines_carry_the_fields_that_apply(captured: io.StringIO) -> None:
    logs.configure("info", "json", context={"worker_id": "w-1"}, secrets=(SECRET,), stream=captured)
    log = logging.getLogger("ql3.test")
    log.error("cycle aborted at %s", "lost_retry", extra={"step": "lost_retry", "run_id": "r1"})
    log.info("quiet")
    try:
        raise RuntimeError(f"connect failed: Authorization: Bearer abc.def token {SECRET}")
    except RuntimeError:
        log.exception("request failed for postgresql://ql3:hunter22@db:5432/ql3")
    first, second, third = (json.loads(line) for line in captured.getvalue().splitlines())
    assert first["message"] == "cycle aborted at lost_retry"
    assert (first["level"], first["logger"], first["step"], first["run_id"]) == (
        "error",
        "ql3.test",
        "lost_retry",
        "r1",
    )
    assert first["worker_id"] == second["worker_id"] == "w-1"
    assert "attempt_id" not in first and "run_id" not in second
    text = json.dumps(third)
    assert SECRET not in text and "abc.def" not in text and "hunter22" not in text
    assert "Bearer ***" in third["error"] and "ql3:***@db" in third["message"]


def test_text_lines_are_redacted_too(captured: io.StringIO) -> None:
    logs.configure("info", "text", secrets=(SECRET, None, ""), stream=captured)
    logging.getLogger("ql3.test").warning("token %s refused", SECRET)
    line = captured.getvalue()
    assert SECRET not in line and "token *** refused" in line


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError):
        logs.configure("info", "xml")


def test_url_password() -> None:
    assert logs.url_password("postgresql+psycopg://u:pw@h/db") == "pw"
    assert logs.url_password("postgresql+psycopg://u@h/db") is None
    assert logs.url_password(None) is None


def test_ids_named_in_a_message_become_fields(captured: io.StringIO) -> None:
    logs.configure("info", "json", stream=captured)
    log = logging.getLogger("ql3.test")
    log.info("attempt %s abandoned (%s): %d%% done", "a-1", "stopped", 50)
    log.info("hand-back of attempt %s refused", "a-2", extra={"attempt_id": "given"})
    log.info("worker %s registered session %s (%d slot(s))", "w-1", "s-1", 2)
    first, second, third = (json.loads(line) for line in captured.getvalue().splitlines())
    assert (
        first["attempt_id"] == "a-1"
        and first["message"] == "attempt a-1 abandoned (stopped): 50% done"
    )
    assert second["attempt_id"] == "given"
    assert (third["worker_id"], third["session_id"]) == ("w-1", "s-1")
