"""The input snapshot of a workflow step that comes after other steps: its own input and its
parents' outputs, fixed when its Run is admitted (ADR 0021).

A step with parents is admitted with the input ``{"ql3.step": {"workflow_run_id": ...,
"step": ..., "parents": {step id: output}, "input": <the step's own input>}}``; every Attempt
of the Run reads the same values. Whatever executes a task unwraps it (:func:`split`): the task
gets the step's own input, and its context the parents' outputs. A step without parents is
admitted with its own input, unchanged.

This module imports nothing but the standard library: a worker's task slot loads it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

STEP_INPUT_KEY = "ql3.step"
# The parents' outputs one step receives, JSON-encoded as UTF-8 (without spaces), at most.
MAX_PARENT_OUTPUTS_BYTES = 1024 * 1024


def encoded_size(value: object) -> int:
    """The bytes of ``value`` as compact JSON in UTF-8."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))


def wrap(
    *, workflow_run_id: str, step_id: str, input: Any, parents: Mapping[str, Any]
) -> dict[str, Any]:
    """The input snapshot of a step with parents."""
    return {
        STEP_INPUT_KEY: {
            "workflow_run_id": workflow_run_id,
            "step": step_id,
            "parents": dict(parents),
            "input": input,
        }
    }


def split(value: Any) -> tuple[Any, Mapping[str, Any] | None]:
    """The task's own input and the step's envelope (``workflow_run_id``, ``step``,
    ``parents``) when ``value`` is a step's snapshot; else ``value`` and None."""
    if not isinstance(value, dict) or len(value) != 1 or STEP_INPUT_KEY not in value:
        return value, None
    envelope = value[STEP_INPUT_KEY]
    if not isinstance(envelope, dict) or not isinstance(envelope.get("parents"), dict):
        return value, None
    return envelope.get("input"), envelope
