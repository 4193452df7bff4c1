"""A streamed answer that survives its engine: the request that continues it on another engine.

When an engine dies (or is stopped) after a stream began, the router sends the same request to another
engine of the model with the text already streamed as the start of the answer, and relays the rest into
the client's stream (:class:`vllm_stack.relay.continued_leg.ContinuedLeg`): chat completions as the
partial assistant message with vLLM's ``continue_final_message`` (and no generation prompt), completions
as the prompt followed by that text. ``max_tokens`` (and ``min_tokens``) shrink by the tokens already sent.

Some requests cannot be continued faithfully, and are broken off as before (an error event):

- ``n`` or ``best_of`` above 1, beam search: several answers, each its own place;
- ``logprobs``/``top_logprobs``/``prompt_logprobs``, ``echo``: they describe the earlier tokens, which the
  second engine reads as prompt;
- ``seed``: the client asked for one reproducible sample, which a second sampler does not continue;
- structured output (``response_format`` other than text, ``guided_*``, ``structured_outputs``): the
  grammar would start again mid-answer;
- a tool call or reasoning under way (read from the stream), ``suffix``, a prompt that is not one string,
  usage on every event (``continuous_usage_stats``);
- a stream whose last forwarded bytes end mid-event, or longer than the bytes kept for it.

Penalties (``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``) then see the earlier
output as prompt: a small difference, accepted. What the client receives stays one answer: the first
id, ``created`` and model on every event, one role event, and a ``usage`` that counts the streamed text as
completion (its token count is the number of events that carried text: vLLM's one token per event).
"""

from __future__ import annotations

from typing import Any

import orjson

from vllm_stack.endpoint_table import ENDPOINTS
from vllm_stack.relay.sse import dechunked
from vllm_stack.relay.transcript import NotContinuable, StreamTranscript

#: path -> how its request is continued: "chat" (a partial assistant message) or "prompt" (prompt + text)
PATHS = ENDPOINTS.continuable

#: Fields whose presence (with a value that is not the default) makes a continuation unfaithful.
_UNFAITHFUL = (
    "best_of",
    "use_beam_search",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
    "seed",
    "suffix",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)


def _blocking_field(request: dict[str, Any]) -> str | None:
    """The first field of ``request`` that rules a continuation out, else None."""
    n = request.get("n")
    if n not in (None, 1):
        return "n"
    for name in _UNFAITHFUL:
        value = request.get(name)
        if value is None or value is False or (name == "best_of" and value == 1):
            continue  # absent, or its default
        return name
    response_format = request.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        return "response_format"
    options = request.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return "continuous_usage_stats"
    return None


class Continuation:
    """One request's continuation state: its original body and what its client received so far."""

    __slots__ = ("request", "transcript", "client_chunked", "keep_alive", "ttft", "broke_at", "chat")

    def __init__(
        self, request: dict[str, Any], transcript: StreamTranscript, client_chunked: bool, keep_alive: bool
    ) -> None:
        self.request = request
        self.transcript = transcript
        self.chat = transcript.chat
        # the client's body is chunked (else it ends with the connection)
        self.client_chunked = client_chunked
        self.keep_alive = keep_alive
        self.ttft: float | None = None  # the first engine's, kept as the request's
        self.broke_at = 0.0  # time.perf_counter() of the latest break (the gap metric counts from it)

    @classmethod
    def begin(
        cls, path: str, body: bytes, sent: bytes, client_chunked: bool, keep_alive: bool
    ) -> Continuation:
        """The continuation of a request to ``path`` with ``body`` whose client received ``sent`` (as
        framed to it); NotContinuable (its reason) when the request or its stream rules one out."""
        kind = PATHS.get(path)
        if kind is None:
            raise NotContinuable("path")
        try:
            request = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise NotContinuable("unreadable_request") from None
        if not isinstance(request, dict):
            raise NotContinuable("unreadable_request")
        blocking = _blocking_field(request)
        if blocking is not None:
            raise NotContinuable(f"parameter_{blocking}")
        chat = kind == "chat"
        if chat:
            messages = request.get("messages")
            if not isinstance(messages, list) or not messages:
                raise NotContinuable("unreadable_request")
            if request.get("continue_final_message") and not _own_text(messages[-1]):
                raise NotContinuable("unreadable_request")
        elif not isinstance(_one_prompt(request.get("prompt")), str):
            raise NotContinuable("prompt_not_one_string")
        transcript = StreamTranscript.read(dechunked(sent) if client_chunked else sent, chat)
        return cls(request, transcript, client_chunked, keep_alive)

    def body(self) -> bytes:
        """The request that continues the answer from where its client's stream stands."""
        transcript = self.transcript
        request = dict(self.request)
        text = transcript.text
        if self.chat:
            messages = list(request["messages"])
            if request.get("continue_final_message"):
                last = dict(messages[-1])
                last["content"] = last["content"] + text
                messages[-1] = last
            else:
                messages.append({"role": "assistant", "content": text})
            request["messages"] = messages
            request["continue_final_message"] = True
            request["add_generation_prompt"] = False
        else:
            request["prompt"] = _one_prompt(request["prompt"]) + text
        for name in ("max_tokens", "max_completion_tokens"):
            limit = request.get(name)
            if isinstance(limit, int) and not isinstance(limit, bool):
                request[name] = max(1, limit - transcript.tokens)
        minimum = request.get("min_tokens")
        if isinstance(minimum, int) and not isinstance(minimum, bool) and minimum:
            request["min_tokens"] = max(0, minimum - transcript.tokens)
        transcript.begin_continuation()
        return orjson.dumps(request)


def _one_prompt(prompt: Any) -> Any:  # noqa: ANN401 - the request's prompt, as sent
    """A completions prompt that is one string (or a list holding one), else what was sent."""
    if isinstance(prompt, list) and len(prompt) == 1:
        return prompt[0]
    return prompt


def _own_text(message: Any) -> bool:  # noqa: ANN401 - one chat message, as sent
    """A final assistant message whose text a continuation can extend."""
    return (
        isinstance(message, dict)
        and message.get("role") == "assistant"
        and isinstance(message.get("content"), str)
    )
