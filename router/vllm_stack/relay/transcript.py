"""What a client has received of a streamed OpenAI answer, so that another engine can continue it.

A stream whose engine dies after it began (:mod:`vllm_stack.director.continuation`) is continued on
another engine. What the client already holds is read back once, at the break, from the bytes the leg
forwarded (:attr:`vllm_stack.relay.leg.Leg.kept`): the answer's id, creation time and model, the text
of its one choice so far, and how many token events carried it. The continuation's own events are then
rewritten through the same transcript (:meth:`StreamTranscript.rewrite`) so that the client sees one
answer: the first answer's id, ``created`` and ``model``, no second role event, and a ``usage`` that counts
the text streamed before the break as completion tokens, not as prompt.

Nothing here runs for a stream that does not break: the bytes are only parsed when one does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from vllm_stack.relay.sse import DONE, sse_payloads


class NotContinuable(Exception):  # noqa: N818 - a reason, read by the caller as one
    """The stream cannot be continued faithfully; the message says why (a metric's label)."""


@dataclass(slots=True)
class StreamTranscript:
    """One streamed answer as its client received it, extended by each continuation."""

    chat: bool  # chat.completion.chunk events (else text_completion)
    answer_id: Any = None
    created: Any = None
    model: Any = None
    fingerprint: Any = None
    parts: list[str] = field(default_factory=list)  # the text of choice 0, as streamed
    tokens: int = 0  # events that carried text (vLLM: one per token, at its default stream interval)
    carried: int = 0  # ``tokens`` when the current continuation was sent (what its prompt holds)
    finished: bool = False  # a finish_reason (or [DONE]) reached the client: nothing to continue
    continued: int = 0  # continuations so far
    role_seen: bool = False

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @classmethod
    def read(cls, body: bytes, chat: bool) -> StreamTranscript:
        """The transcript of the SSE ``body`` a client received (unchunked); NotContinuable when it
        holds what a continuation cannot carry on (an error event, tool calls, reasoning, n > 1)."""
        transcript = cls(chat)
        payloads, rest = sse_payloads(body)
        if rest.strip():
            raise NotContinuable("partial_event")
        for payload in payloads:
            if payload == DONE:
                transcript.finished = True
                continue
            try:
                event = orjson.loads(payload)
            except orjson.JSONDecodeError:
                raise NotContinuable("unreadable_event") from None
            transcript.take(event)
        return transcript

    def take(self, event: Any) -> None:  # noqa: ANN401 - an event as JSON decodes it
        """Account one event the client received (the first answer's, or a rewritten continuation's)."""
        if not isinstance(event, dict) or "error" in event:
            raise NotContinuable("error_event")
        if self.answer_id is None:
            self.answer_id = event.get("id")
            self.created = event.get("created")
            self.model = event.get("model")
            self.fingerprint = event.get("system_fingerprint")
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                raise NotContinuable("several_choices")
            if self.chat:
                delta = choice.get("delta") or {}
                if delta.get("tool_calls") or delta.get("reasoning_content") or delta.get("reasoning"):
                    raise NotContinuable("tool_call_or_reasoning")
                text = delta.get("content")
                if delta.get("role"):  # the event that opens the message carries no token
                    self.role_seen = True
                    text = text or None
            else:
                text = choice.get("text")
            if isinstance(text, str):  # one token per event, its text empty while a character is incomplete
                self.parts.append(text)
                self.tokens += 1
            if choice.get("finish_reason") is not None:
                self.finished = True

    def begin_continuation(self) -> None:
        """A continuation is sent now: its prompt carries every token streamed so far."""
        self.continued += 1
        self.carried = self.tokens

    def rewrite(self, payload: bytes) -> bytes | None:
        """A continuation's event payload as the client's answer goes on: None to drop it (its role
        event: the client had one), else the payload with the first answer's identity and usage."""
        if payload == DONE:
            return payload
        event = orjson.loads(payload)
        if not isinstance(event, dict):
            raise NotContinuable("unreadable_event")
        if "error" in event:
            return payload  # the engine's own error ends the stream as it says
        choices = event.get("choices") or []
        if self.chat and self.role_seen and choices and _role_only(choices[0]):
            return None
        event["id"] = self.answer_id
        event["created"] = self.created
        event["model"] = self.model
        if "system_fingerprint" in event:
            event["system_fingerprint"] = self.fingerprint
        usage = event.get("usage")
        if isinstance(usage, dict):  # the streamed text was prompt to this engine; to the client, output
            carried = self.carried
            prompt = usage.get("prompt_tokens")
            completion = usage.get("completion_tokens")
            if isinstance(prompt, int) and isinstance(completion, int):
                # the tokens generated, exactly; the prompt as this engine read it less the streamed tokens
                # (exact where the streamed text tokenizes back to the tokens generated)
                usage["prompt_tokens"] = max(0, prompt - carried)
                usage["completion_tokens"] = completion + carried
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        self.take(event)
        return orjson.dumps(event)


def _role_only(choice: Any) -> bool:  # noqa: ANN401 - a choice as JSON decodes it
    """A chat event that only opens the assistant's message (role, empty content, no finish)."""
    if not isinstance(choice, dict) or choice.get("finish_reason") is not None:
        return False
    delta = choice.get("delta") or {}
    return bool(delta.get("role")) and not delta.get("content") and not delta.get("tool_calls")
