"""The router's token ids for chat and completion requests equal the engine's own ``POST /tokenize``.

Real vLLM engines (the session's ``tiny-llama`` chat engines) and the model's own files: system
prompts, multi-turn conversations, tools, content parts, a completion prompt.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from vllm_stack.scheduling.index.tokens import ChatTokenizer

pytestmark = pytest.mark.engine

MODEL = "tiny-llama"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CHATS = [
    {"messages": [{"role": "user", "content": "Hello there!"}]},
    {
        "messages": [
            {"role": "system", "content": "You are a careful assistant. Answer in one sentence."},
            {"role": "user", "content": "What is a KV cache?"},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "Shared system prompt " * 20},
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "first answer, with punctuation: ; , . !"},
            {"role": "user", "content": "second question, über naïve unicode ✓"},
        ]
    },
    {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "part one. "}, {"type": "text", "text": "part two"}],
            }
        ]
    },
    {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS},
    {"messages": [{"role": "user", "content": "no generation prompt"}], "add_generation_prompt": False},
]


async def test_chat_and_prompt_token_ids_equal_the_engines(engines, tiny_model_dir: Path) -> None:
    tokenizer = ChatTokenizer(tiny_model_dir)
    async with httpx.AsyncClient(base_url=engines.urls[0], timeout=30) as h:
        for chat in CHATS:
            r = await h.post("/tokenize", json={"model": MODEL, **chat})
            assert r.status_code == 200, r.text
            assert tokenizer.chat_ids(chat) == r.json()["tokens"], chat
        for prompt in ("Once upon a time", "A longer prompt, with numbers 12345 and symbols #@!" * 10):
            r = await h.post("/tokenize", json={"model": MODEL, "prompt": prompt})
            assert r.status_code == 200, r.text
            assert tokenizer.prompt_ids(prompt) == r.json()["tokens"], prompt


async def test_prefixaware_in_token_mode_keeps_a_conversation_where_its_blocks_are(
    engines, tiny_model_dir: Path
) -> None:
    """With the model's tokenizer the index is keyed by the engine's own token blocks: every turn of
    a conversation goes to the engine that holds its earlier turns."""
    from tests.router.helpers import metric_value, running_router

    tokenizers = {MODEL: str(tiny_model_dir)}
    async with running_router(engines.urls, routing_logic="prefixaware", tokenizers=tokenizers) as (
        url,
        router,
    ):
        async with httpx.AsyncClient(base_url=url, timeout=60) as h:
            doc = (await h.get("/engines")).json()
            state = doc["scheduling"]["state"]["prefix-cache-picker"]
            assert state["token_mode_models"] == [MODEL]
            messages = [
                {"role": "system", "content": "You are the assistant of a long shared handbook. " * 30}
            ]
            for turn in range(3):
                messages.append({"role": "user", "content": f"question {turn}: " + "tell me more " * 40})
                r = await h.post(
                    "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 4}
                )
                assert r.status_code == 200, r.text
                messages.append(
                    {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}
                )
        counts = {
            e.name: metric_value(
                router, "vllm_stack_router_requests_total", model=MODEL, engine=e.name, status="200"
            )
            for e in router.registry.engines()
        }
        assert sorted(counts.values()) == [0, 3], counts  # one engine took every turn
        reasons = {
            r: metric_value(
                router, "vllm_stack_router_routing_decisions_total", strategy="prefixaware", reason=r
            )
            for r in ("prefix_partial", "prefix_hit")
        }
        assert reasons["prefix_partial"] + reasons["prefix_hit"] == 2, reasons
