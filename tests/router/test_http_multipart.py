"""The ``model`` of a multipart form (transcriptions, translations) as the engine reads it.

The router routes a form request by its ``model`` field, so it must read the same field as the
engine's form parser or it routes one model while the engine serves another (issue 29: a file part
with ``filename="model"`` was taken for the field). The cases are data
(``corpus/multipart_model.yaml``); each is checked against the router's reading and against the
engine's own parser (Starlette's ``MultiPartParser`` with FastAPI's rule for an empty field), run in
the engine's environment, so the expectations are the engine's and not a guess.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_stack.api.parsing import multipart_field
from vllm_stack.errors import RouterError

ROOT = Path(__file__).resolve().parents[2]
CASES: list[dict[str, Any]] = yaml.safe_load(
    (Path(__file__).parent / "corpus/multipart_model.yaml").read_text()
)
DEFAULT_TYPE = "multipart/form-data; boundary=B"
ERROR = "error!"
ENGINE_PYTHON = ROOT / ".venv-engine/bin/python"

#: Runs in the engine's environment: each case through Starlette's MultiPartParser, as FastAPI
#: reads a form field (``form.get(name)``; an empty string or None is absent; a file is no string).
_ENGINE_READS = """
import asyncio, json, sys
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

async def read(case):
    async def stream():
        yield case["body"].encode("latin-1")
    headers = Headers({"content-type": case["content_type"]})
    try:
        form = await MultiPartParser(headers, stream()).parse()
    except MultiPartException:
        return "error!"
    value = form.get("model")
    if isinstance(value, UploadFile):
        return "error!"
    return value or None

cases = json.load(sys.stdin)
print(json.dumps([asyncio.run(read(case)) for case in cases]))
"""


def _router_reads(case: dict[str, Any]) -> str | None:
    try:
        return multipart_field(
            case["body"].encode("latin-1"), case.get("content_type", DEFAULT_TYPE).encode(), b"model"
        )
    except RouterError as err:
        assert err.status == 400, err
        return ERROR


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_the_router_reads_the_model_the_engine_reads(case: dict[str, Any]) -> None:
    assert _router_reads(case) == case["model"]


def test_the_cases_are_what_the_engines_form_parser_reads() -> None:
    assert ENGINE_PYTHON.exists(), f"{ENGINE_PYTHON} is missing: make install builds the engine environment"
    cases = [{**c, "content_type": c.get("content_type", DEFAULT_TYPE)} for c in CASES]
    done = subprocess.run(
        [str(ENGINE_PYTHON), "-c", _ENGINE_READS],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    engine = json.loads(done.stdout)
    assert {c["name"]: m for c, m in zip(CASES, engine, strict=True)} == {
        c["name"]: c["model"] for c in CASES
    }
