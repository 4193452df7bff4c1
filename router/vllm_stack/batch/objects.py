"""The Batch API's objects as OpenAI defines them: identifiers, statuses, and the JSON of a file, a batch
and an output or error line."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

import orjson

# Batch statuses (OpenAI's)
VALIDATING = "validating"
IN_PROGRESS = "in_progress"
FINALIZING = "finalizing"
COMPLETED = "completed"
FAILED = "failed"
EXPIRED = "expired"
CANCELLING = "cancelling"
CANCELLED = "cancelled"
STATUSES = (VALIDATING, IN_PROGRESS, FINALIZING, COMPLETED, FAILED, EXPIRED, CANCELLING, CANCELLED)
#: A batch in one of these may still change; its input file may not be deleted meanwhile.
ACTIVE = (VALIDATING, IN_PROGRESS, FINALIZING, CANCELLING)

COMPLETION_WINDOWS = ("24h",)
FILE_PURPOSES = ("batch", "batch_output")  # uploads are ``batch``; outputs and error files ``batch_output``
METADATA_PAIRS = 16  # OpenAI: up to 16 key-value pairs, keys up to 64 and values up to 512 characters


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}" if prefix != "file" else f"file-{secrets.token_hex(12)}"


def output_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's ``output`` or ``error`` file: derived from the batch's, so a finalization
    done again (its router died half-way) writes the same file, never a second one."""
    return f"file-{batch_id.removeprefix('batch_')}-{kind}"


def file_object(row: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": row["created_at"],
        "expires_at": None,
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "status_details": None,
    }


def batch_object(row: Mapping[str, Any]) -> dict[str, Any]:
    errors = row["errors"]
    metadata = row["metadata"]
    return {
        "id": row["id"],
        "object": "batch",
        "endpoint": row["endpoint"],
        "model": row["model"],
        "errors": orjson.loads(errors) if errors else None,
        "input_file_id": row["input_file_id"],
        "completion_window": row["completion_window"],
        "status": row["status"],
        "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"],
        "created_at": row["created_at"],
        "in_progress_at": row["in_progress_at"],
        "expires_at": row["expires_at"],
        "finalizing_at": row["finalizing_at"],
        "completed_at": row["completed_at"],
        "failed_at": row["failed_at"],
        "expired_at": row["expired_at"],
        "cancelling_at": row["cancelling_at"],
        "cancelled_at": row["cancelled_at"],
        "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
        "metadata": orjson.loads(metadata) if metadata else None,
    }


def batch_error(code: str, message: str, line: int | None = None, param: str | None = None) -> dict[str, Any]:
    """One entry of a failed batch's ``errors.data`` (``line`` counts from 1, as OpenAI's do)."""
    return {"code": code, "message": message, "param": param, "line": line}


def result_line(custom_id: str, request_id: str, status: int, body: bytes) -> bytes:
    """One line of the output file (status 200) or the error file (any other), as OpenAI writes them:
    the engine's answer body as it came (JSON), or a JSON error when it was not JSON."""
    try:
        doc = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        doc = {
            "error": {
                "message": body[:2000].decode("utf-8", "replace"),
                "type": "server_error",
                "param": None,
                "code": "invalid_upstream_body",
            }
        }
    return orjson.dumps(
        {
            "id": f"batch_req_{secrets.token_hex(12)}",
            "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": doc},
            "error": None,
        }
    )


def unsent_line(custom_id: str, code: str, message: str) -> bytes:
    """An error file line for a request never answered (the batch expired or was cancelled first)."""
    return orjson.dumps(
        {
            "id": f"batch_req_{secrets.token_hex(12)}",
            "custom_id": custom_id,
            "response": None,
            "error": {"code": code, "message": message},
        }
    )
