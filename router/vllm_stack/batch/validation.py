"""A batch's input file checked as OpenAI checks it before a batch runs: every line a JSON object with a
``custom_id`` (unique), ``method`` ``POST``, the batch's ``url`` and a ``body`` naming a ``model`` the fleet
serves. Errors are OpenAI's ``errors.data`` entries, each with its line number (from 1); a batch with any
fails as a whole and sends nothing. What is kept of a good line is where it is in the file (its bytes are
read again when it is sent), so a 200 MB input costs no memory here beyond the ids seen and one line.

A line must also be one the runner can send as any client request is sent: at most the router's
``max_body_bytes`` long (``line_too_large``: a longer line is never read whole, here or later) and its
JSON nested at most :data:`~vllm_stack.json_depth.MAX_JSON_DEPTH` deep (``invalid_request``), the
request path's own limits. Values quoted in errors are cut to :data:`QUOTED_CHARS`, so a batch's errors
(at most :data:`MAX_ERRORS` of them) stay small whatever the lines hold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

from vllm_stack.batch.objects import batch_error
from vllm_stack.json_depth import MAX_JSON_DEPTH, too_deep

MAX_ERRORS = 100  # errors reported for one file (OpenAI reports a bounded list too)
#: Request lines in one batch, at most (OpenAI's limit): what validation holds per line is then bounded too.
MAX_LINES = 50_000
QUOTED_CHARS = 64  # of a bad value quoted in an error message
SKIP_CHUNK = 1024 * 1024  # bytes read at a time while skipping the rest of a line too long to take


@dataclass
class CheckedInput:
    lines: list[tuple[int, str, int, int]] = field(default_factory=list)  # (index, custom_id, start, length)
    models: dict[str, int] = field(default_factory=dict)  # model -> first line naming it (from 1)
    errors: list[dict[str, Any]] = field(default_factory=list)

    def error(self, code: str, message: str, line: int | None = None, param: str | None = None) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(batch_error(code, message, line, param))


def quoted(value: object) -> str:
    """A value as an error message quotes it: a string's or a number's repr, cut short; a container by kind."""
    if isinstance(value, dict | list):
        return "an object" if isinstance(value, dict) else "an array"
    text = repr(value[: QUOTED_CHARS + 1] if isinstance(value, str) else value)
    return text if len(text) <= QUOTED_CHARS + 2 else text[:QUOTED_CHARS] + "..."


def _lines(handle: IO[bytes], max_line_bytes: int) -> Iterator[tuple[int, int, bytes | None]]:
    """(start, length, the line or None when it is longer than ``max_line_bytes``): never more than
    ``max_line_bytes`` plus a chunk in memory, however long a line is."""
    offset = 0
    while True:
        raw = handle.readline(max_line_bytes + 1)
        if not raw:
            return
        start, length = offset, len(raw)
        if length > max_line_bytes and not raw.endswith(b"\n"):  # too long: skip to its end
            while not raw.endswith(b"\n"):
                raw = handle.readline(SKIP_CHUNK)
                if not raw:
                    break
                length += len(raw)
            offset += length
            yield start, length, None
            continue
        offset += length
        yield start, length, raw


def check_input(path: Path, endpoint: str, max_line_bytes: int) -> CheckedInput:
    """Read the input file line by line (blocking: run it off the loop). Blank lines are skipped."""
    checked = CheckedInput()
    seen: set[str] = set()
    number = 0
    with open(path, "rb") as handle:
        for start, length, raw in _lines(handle, max_line_bytes):
            number += 1
            text = raw.strip() if raw is not None else None
            if text is not None and not text:
                continue
            if len(checked.lines) >= MAX_LINES:
                checked.error(
                    "too_many_lines", f"A batch may have at most {MAX_LINES} request lines.", number
                )
                break
            if text is None or len(text) > max_line_bytes:
                checked.error(
                    "line_too_large",
                    f"The line is {length} bytes long; a request may have at most {max_line_bytes} bytes.",
                    number,
                )
                continue
            _check_line(checked, seen, text, number, start, length, endpoint)
    if not checked.lines and not checked.errors:
        checked.error("empty_file", "The input file has no request lines.")
    return checked


def _check_line(
    checked: CheckedInput, seen: set[str], text: bytes, number: int, start: int, length: int, endpoint: str
) -> None:
    if too_deep(text, MAX_JSON_DEPTH + 1):  # the line's object holds the request's body
        checked.error(
            "invalid_request",
            f"The line's body is nested more than {MAX_JSON_DEPTH} levels deep (arrays and objects inside"
            " one another).",
            number,
            "body",
        )
        return
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
            f"The custom_id {quoted(custom_id)} is used by an earlier line; each must be unique.",
            number,
            "custom_id",
        )
        return
    seen.add(custom_id)
    method = doc.get("method")
    if method != "POST":
        checked.error("invalid_method", f"The method must be 'POST', got {quoted(method)}.", number, "method")
        return
    url = doc.get("url")
    if url != endpoint:
        checked.error(
            "invalid_url",
            f"The url must be the batch's endpoint '{endpoint}', got {quoted(url)}.",
            number,
            "url",
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
                f"The model {quoted(model)} does not exist or is not served here.",
                line,
                "body.model",
            )
