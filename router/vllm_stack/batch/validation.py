"""A batch's input file checked as OpenAI checks it before a batch runs: every line a JSON object with a
``custom_id`` (unique), ``method`` ``POST``, the batch's ``url`` and a ``body`` naming a ``model`` the fleet
serves. Errors are OpenAI's ``errors.data`` entries, each with its line number (from 1); a batch with any
fails as a whole and sends nothing. What is kept of a good line is where it is in the file (its bytes are
read again when it is sent), so a 200 MB input costs no memory here beyond the ids seen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from vllm_stack.batch.objects import batch_error

MAX_ERRORS = 100  # errors reported for one file (OpenAI reports a bounded list too)
#: Request lines in one batch, at most (OpenAI's limit): what validation holds per line is then bounded too.
MAX_LINES = 50_000


@dataclass
class CheckedInput:
    lines: list[tuple[int, str, int, int]] = field(default_factory=list)  # (index, custom_id, start, length)
    models: dict[str, int] = field(default_factory=dict)  # model -> first line naming it (from 1)
    errors: list[dict[str, Any]] = field(default_factory=list)

    def error(self, code: str, message: str, line: int | None = None, param: str | None = None) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(batch_error(code, message, line, param))


def check_input(path: Path, endpoint: str) -> CheckedInput:
    """Read the input file line by line (blocking: run it off the loop). Blank lines are skipped."""
    checked = CheckedInput()
    seen: set[str] = set()
    offset = 0
    number = 0
    with open(path, "rb") as handle:
        for raw in handle:
            number += 1
            start, offset = offset, offset + len(raw)
            text = raw.strip()
            if not text:
                continue
            if len(checked.lines) >= MAX_LINES:
                checked.error(
                    "too_many_lines", f"A batch may have at most {MAX_LINES} request lines.", number
                )
                break
            _check_line(checked, seen, text, number, start, len(raw), endpoint)
    if not checked.lines and not checked.errors:
        checked.error("empty_file", "The input file has no request lines.")
    return checked


def _check_line(
    checked: CheckedInput, seen: set[str], text: bytes, number: int, start: int, length: int, endpoint: str
) -> None:
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError:
        checked.error("invalid_json_line", "This line is not parseable as valid JSON.", number)
        return
    if not isinstance(doc, dict):
        checked.error("invalid_json_line", "This line is not a JSON object.", number)
        return
    custom_id = doc.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        checked.error(
            "missing_required_parameter", "The line has no 'custom_id' string.", number, "custom_id"
        )
        return
    if custom_id in seen:
        checked.error(
            "duplicate_custom_id",
            f"The custom_id '{custom_id[:200]}' is used by an earlier line; each must be unique.",
            number,
            "custom_id",
        )
        return
    seen.add(custom_id)
    method = doc.get("method")
    if method != "POST":
        checked.error("invalid_method", f"The method must be 'POST', got {method!r}.", number, "method")
        return
    url = doc.get("url")
    if url != endpoint:
        checked.error(
            "invalid_url", f"The url must be the batch's endpoint '{endpoint}', got {url!r}.", number, "url"
        )
        return
    body = doc.get("body")
    if not isinstance(body, dict):
        checked.error("missing_required_parameter", "The line has no 'body' object.", number, "body")
        return
    model = body.get("model")
    if not isinstance(model, str) or not model:
        checked.error("missing_required_parameter", "The line's body names no 'model'.", number, "body.model")
        return
    if body.get("stream"):
        checked.error(
            "invalid_request", "Batch requests cannot stream ('stream': true).", number, "body.stream"
        )
        return
    checked.models.setdefault(model, number)
    checked.lines.append((len(checked.lines), custom_id, start, length))


def check_models(checked: CheckedInput, served: Callable[[str], bool]) -> None:
    """Every model the lines name must be one the fleet serves (``served``: the router's rule)."""
    for model, line in checked.models.items():
        if not served(model):
            checked.error(
                "model_not_found",
                f"The model '{model[:200]}' does not exist or is not served here.",
                line,
                "body.model",
            )
