"""Tokenizers fetched from a Hugging Face Hub repository (``hf:ORG/NAME``), as the chart configures
the router under Kubernetes.

The Hub itself cannot be reached from here: a local aiohttp server stands in for it, serving the
tiny model's tokenizer files at the Hub's ``/{repo}/resolve/{revision}/{file}`` paths and checking
the bearer token, as ``$HF_ENDPOINT`` mirrors do.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web

from vllm_stack.config import ConfigError
from vllm_stack.engines.circuit import CircuitBreaker
from vllm_stack.engines.engine import Engine
from vllm_stack.metrics import RouterMetrics
from vllm_stack.scheduling.config import build_scheduling
from vllm_stack.scheduling.framework import RequestContext
from vllm_stack.scheduling.index.blocks import salt_of, token_block_keys
from vllm_stack.scheduling.index.tokenizer_source import parse_hub
from vllm_stack.scheduling.index.tokens import ChatTokenizer
from vllm_stack.scheduling.plugins import builtin_registry
from vllm_stack.scheduling.registry import PluginState


def test_hub_specs_are_checked() -> None:
    assert parse_hub("hf:org/name") == ("org/name", "main")
    assert parse_hub("hf:org/name@v1.2") == ("org/name", "v1.2")
    for bad in ("hf:../etc", "hf:org/name@../x", "hf:", "hf:a/b/c"):
        with pytest.raises(ConfigError):
            parse_hub(bad)


async def test_a_hub_tokenizer_is_fetched_in_the_background_then_used(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, str | None]] = []
    release = asyncio.Event()

    async def resolve(request: web.Request) -> web.StreamResponse:
        seen.append((request.path, request.headers.get("authorization")))
        await release.wait()  # the Hub is slow: requests meanwhile go by character blocks
        path = tiny_model_dir / request.match_info["file"]
        if request.headers.get("authorization") != "Bearer hf-secret":
            return web.Response(status=401)
        if not path.is_file():
            return web.Response(status=404)
        return web.Response(body=path.read_bytes())

    app = web.Application()
    app.router.add_get("/{org}/{name}/resolve/{rev}/{file}", resolve)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - the ephemeral port
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_TOKEN", "hf-secret")
    monkeypatch.setenv("VLLM_STACK_CACHE_DIR", str(tmp_path))
    try:
        raw = {
            "plugins": [{"type": "prefix-cache-picker", "parameters": {"tokenizers": {"m": "hf:org/tiny"}}}],
            "schedulingProfiles": [{"name": "p", "plugins": ["prefix-cache-picker"]}],
        }
        setup = build_scheduling(raw, builtin_registry(), PluginState(), RouterMetrics())
        picker = setup.plugins["prefix-cache-picker"]
        assert picker.describe()["tokenizers"]["m"]["state"] == "not requested yet"
        engine = Engine("e0", "http://10.0.0.1:8000", CircuitBreaker(5, 10.0))
        engine.healthy, engine.kv_block_size = True, 16
        messages = [{"role": "user", "content": "tell me about the handbook " * 20}]
        body = json.dumps({"model": "m", "messages": messages}).encode()

        def request() -> RequestContext:
            ctx = RequestContext("m", body=body, prompt=json.dumps(messages).encode())
            (hook,) = setup.hooks.prepare
            assert hook(ctx) is None  # short prompt: tokenized inline, when the tokenizer is there
            return ctx

        ctx = request()
        assert "prefix-cache-picker/ids" not in ctx.cycle  # still fetching: character blocks
        assert picker.describe()["tokenizers"]["m"]["state"] == "fetching"
        release.set()
        for _ in range(200):
            if picker.describe()["tokenizers"]["m"]["state"] == "loaded":
                break
            await asyncio.sleep(0.05)
        assert picker.describe()["token_mode_models"] == ["m"]
        ctx = request()
        ids = list(ctx.cycle["prefix-cache-picker/ids"])
        assert ids == ChatTokenizer(tiny_model_dir).chat_ids({"messages": messages})
        result = setup.scheduler.schedule(ctx, [engine])
        keys = token_block_keys(ids, 16, salt_of("m", None))
        assert picker.index.match(result.engine.name, keys) == len(keys)
        # The token went to the Hub, the files to the cache (a restart reads them from there).
        assert seen and all(auth == "Bearer hf-secret" for _, auth in seen)
        assert (tmp_path / "tokenizers" / "org--tiny" / "main" / "tokenizer.json").is_file()
    finally:
        await runner.cleanup()
