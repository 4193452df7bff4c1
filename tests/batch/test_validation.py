"""The input checks on their own: line numbers, blank lines, the line limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.batch.helpers import input_lines, jsonl
from vllm_stack.batch import validation


def test_blank_lines_are_skipped_and_numbers_count_every_line(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    lines = input_lines(2, "m")
    path.write_bytes(jsonl(lines[:1]) + b"\n  \n" + jsonl(lines[1:]) + b"[1]\n")
    checked = validation.check_input(path, "/v1/chat/completions", 1 << 20)
    assert [(idx, cid) for idx, cid, _, _ in checked.lines] == [(0, "req-0"), (1, "req-1")]
    assert checked.errors == [
        {"code": "invalid_json_line", "message": "This line is not a JSON object.", "param": None, "line": 5}
    ]
    data = path.read_bytes()
    _, _, start, length = checked.lines[1]
    assert data[start : start + length].strip() == jsonl(lines[1:]).strip()  # where the line is, to send it


def test_more_lines_than_the_limit_fail_the_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(validation, "MAX_LINES", 3)
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(input_lines(5, "m")))
    checked = validation.check_input(path, "/v1/chat/completions", 1 << 20)
    assert [e["code"] for e in checked.errors] == ["too_many_lines"] and checked.errors[0]["line"] == 4


def test_an_empty_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n\n")
    assert [e["code"] for e in validation.check_input(path, "/v1/embeddings", 1 << 20).errors] == [
        "empty_file"
    ]
