"""One JSON depth limit for every body the router reads (vllm_stack.json_depth): exact against a parse,
brackets inside strings and escapes not counted, and the request path's 400 past it."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from tests.router.helpers import http
from vllm_stack.api.parsing import make_parser
from vllm_stack.errors import RouterError
from vllm_stack.json_depth import MAX_JSON_DEPTH, too_deep


def _depth(value: Any) -> int:  # noqa: ANN401 - a parsed JSON value
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


def _random_value(rng: random.Random, depth: int) -> Any:  # noqa: ANN401
    if depth == 0:  # strings with brackets, quotes and backslashes, which must not count
        return rng.choice(["a[{", 1, '\\"]}', None, 'q"x', "\\\\", "[[\\\\]]", "é{"])
    if rng.random() < 0.5:
        return [_random_value(rng, depth - 1) for _ in range(rng.randint(1, 3))]
    return {f"k{i}[{{": _random_value(rng, depth - 1) for i in range(rng.randint(1, 3))}


def test_the_depth_matches_a_parse_for_random_documents() -> None:
    rng = random.Random(44)
    for _ in range(400):
        document = orjson.dumps(_random_value(rng, rng.randint(1, 9)))
        depth = _depth(orjson.loads(document))
        for limit in range(max(depth - 2, 0), depth + 2):
            assert too_deep(document, limit) == (depth > limit), (document, depth, limit)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 300, 1000])
def test_the_limit_is_exact_for_deep_documents(depth: int) -> None:
    document = b'{"a": "[[[[", "b": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"
    assert too_deep(document) == (depth > MAX_JSON_DEPTH)
    wide = b"[" + b",".join([b"[]"] * 100_000) + b"]"  # many brackets, two levels
    assert not too_deep(wide)


@pytest.mark.parametrize("parser", ["msgspec", "orjson"])
def test_both_parsers_refuse_past_the_limit(parser: str) -> None:
    def body(depth: int) -> bytes:
        return b'{"model": "m", "prompt": "x", "extra": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"

    make_parser(parser).parse(body(MAX_JSON_DEPTH))
    for depth in (MAX_JSON_DEPTH + 1, 300):
        with pytest.raises(RouterError) as caught:
            make_parser(parser).parse(body(depth))
        assert caught.value.status == 400 and str(MAX_JSON_DEPTH) in caught.value.message


async def test_the_request_path_answers_400_past_the_limit_and_relays_at_it(router2) -> None:  # noqa: ANN001
    url, _, engines = router2

    def body(depth: int) -> bytes:
        nest = b"[" * (depth - 1) + b"]" * (depth - 1)
        return b'{"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "x": ' + nest + b"}"

    async with http(url) as h:
        refused = await h.post("/v1/chat/completions", content=body(MAX_JSON_DEPTH + 1))
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_json"
        assert not any(e.seen for e in engines)
        relayed = await h.post("/v1/chat/completions", content=body(MAX_JSON_DEPTH))
        assert relayed.status_code == 200, relayed.text
