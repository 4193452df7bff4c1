"""A model's tokenizer and chat template, so the router cuts prompts into the engine's own token blocks.

The files are the model's (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja`` when
present), read with the ``tokenizers`` library and rendered with a sandboxed Jinja environment set up
as Hugging Face's ``apply_chat_template`` sets it up (``trim_blocks``, ``lstrip_blocks``, ``tojson``,
``raise_exception``). vLLM tokenizes a chat request as the rendered conversation with
``add_generation_prompt`` true by default and no special tokens added (the template writes them), and
a completion prompt with special tokens added; the router does the same, so its token ids are the
engine's (checked against the engine's ``POST /tokenize`` by the tests).

Keys (:func:`vllm_stack.scheduling.index.blocks.token_block_keys`) chain whole blocks of token ids.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from vllm_stack.config import ConfigError
from vllm_stack.scheduling.index.prefix_tokens import PrefixTokenCache


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:  # noqa: ANN401 - any JSON value
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


class ChatTokenizer:
    """Tokenizer and chat template of one model, from its directory."""

    def __init__(self, directory: str | Path) -> None:
        path = Path(directory)
        try:
            self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
            config = json.loads((path / "tokenizer_config.json").read_text())
        except (OSError, ValueError, Exception) as exc:  # tokenizers raises its own Exception type
            raise ConfigError(f"cannot load the tokenizer in {path}: {exc}") from exc
        template_file = path / "chat_template.jinja"
        template = template_file.read_text() if template_file.exists() else config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.directory = path
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson
        self._template = env.from_string(template) if isinstance(template, str) else None
        special = [t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special]
        self.prefixes = PrefixTokenCache(self._encode_plain, special)

    def _encode_plain(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def render(self, request: Mapping[str, Any]) -> str:
        """The conversation as the engine renders it (``TemplateError`` when the template refuses it)."""
        if self._template is None:
            raise jinja2.TemplateError("the model has no chat template")
        kwargs = request.get("chat_template_kwargs")
        extra = dict(kwargs) if isinstance(kwargs, Mapping) else {}
        return self._template.render(
            messages=request.get("messages") or [],
            tools=request.get("tools"),
            documents=request.get("documents"),
            add_generation_prompt=request.get("add_generation_prompt", True),
            continue_final_message=request.get("continue_final_message", False),
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **extra,
        )

    def chat_ids(self, request: Mapping[str, Any]) -> list[int]:
        """Token ids of a chat request (rendered, then encoded without added special tokens); the
        conversation's earlier turns come from :class:`PrefixTokenCache`."""
        return self.prefixes.ids(self.render(request))

    def chat_id_array(self, request: Mapping[str, Any]) -> array:
        """:meth:`chat_ids` as a 4-byte array (what the router hashes into block keys)."""
        return self.prefixes.id_array(self.render(request))

    def prompt_ids(self, prompt: str) -> list[int]:
        """Token ids of a completion prompt (special tokens added, as the engine does)."""
        return self.tokenizer.encode(prompt, add_special_tokens=True).ids


def _token_text(value: Any) -> str:  # noqa: ANN401 - a string or an added-token mapping
    if isinstance(value, Mapping):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""
