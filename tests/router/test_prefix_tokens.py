"""Conversation-prefix token cache: a new turn encodes only what is new, and the ids are always the
ones a full encode gives (the tiny model's byte-level BPE tokenizer and chat template)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_stack.scheduling.index.prefix_tokens import PrefixTokenCache
from vllm_stack.scheduling.index.tokens import ChatTokenizer


def full(tok: ChatTokenizer, request: dict) -> list[int]:
    return tok.tokenizer.encode(tok.render(request), add_special_tokens=False).ids


def test_each_turn_reuses_the_last_one_and_equals_a_full_encode(tiny_model_dir: Path) -> None:
    tok = ChatTokenizer(tiny_model_dir)
    messages: list[dict] = [{"role": "system", "content": "Ünïcode system prompt, emoji 🙂. " * 20}]
    for turn in range(6):
        messages.append({"role": "user", "content": [{"type": "text", "text": f"question {turn} " * 30}]})
        request = {"messages": messages, "tools": [{"type": "function", "function": {"name": "f"}}]}
        assert tok.chat_ids(request) == full(tok, request)
        messages.append({"role": "assistant", "content": f"answer {turn} " * 20})
    cache = tok.prefixes
    assert cache.misses == 1 and cache.hits == 5
    assert len(cache) == 1  # each turn's entry replaced the shorter one it grew from
    # Another conversation sharing the system prompt only: correct ids, from its own encode.
    other = {"messages": [messages[0], {"role": "user", "content": "something else"}]}
    assert tok.chat_ids(other) == full(tok, other)


def test_the_cache_is_bounded(tiny_model_dir: Path) -> None:
    tok = ChatTokenizer(tiny_model_dir)
    cache = PrefixTokenCache(tok._encode_plain, ["<|end|>"], max_chars=2_000)  # noqa: SLF001
    for i in range(50):
        text = f"<|start|>user\nconversation {i} " + "words " * 40 + "<|end|>\n<|start|>assistant\n"
        assert cache.ids(text) == tok._encode_plain(text)  # noqa: SLF001
        assert cache._chars <= 2_000  # noqa: SLF001
    assert 0 < len(cache) < 50


PIECES = st.sampled_from(["<|start|>", "<|end|>", "\n", " ", "a", "ab", "héllo", "🙂", "user", "<|", "|>"])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(PIECES, max_size=12).map("".join), min_size=1, max_size=5))
def test_any_sequence_of_growing_texts_gives_the_full_encode(tiny_model_dir: Path, parts: list[str]) -> None:
    tok = ChatTokenizer(tiny_model_dir)
    text = ""
    for part in parts:  # each text extends the one before, as turns do
        text += part
        assert tok.prefixes.ids(text) == tok._encode_plain(text)  # noqa: SLF001
