"""Seeded workloads for the routing-quality benchmark, sized in multiples of one engine's KV cache.

Every contender gets exactly the same requests in the same order: the text is random words drawn from
a seeded generator, so a run is reproducible and no contender can be helped by luck in the content.
Sizes are given as a working set (distinct prompt tokens that would have to be cached for every
request to hit) in multiples of one engine's KV capacity, because what separates a good router from a
bad one is whether the working set fits in one engine, only in both together, or in neither.

Prompt lengths are estimated from the model's own tokenizer (tokens per word measured once on the
generated text), so "1.5 x one engine's KV" means about that many engine tokens, not characters.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

WORKLOAD_NAMES = ("a", "b", "c", "d", "e")
DESCRIPTIONS = {
    "a": "multi-round QA, session header + user field",
    "b": "multi-round QA, no session information",
    "c": "shared long documents (working set 1.5x one engine's KV)",
    "d": "skewed tenants, long system prompts, Zipf popularity (1.5x)",
    "e": "cache pressure: documents, working set 3x one engine's KV (above both)",
}
SESSION_HEADER = "x-user-id"


@dataclass(frozen=True)
class Request:
    """One chat request. `after` names the request of the same conversation that must finish first."""

    index: int
    messages: list[dict[str, str]]
    session: str | None  # sent as the SESSION_HEADER header and the body's `user` when set
    after: int | None = None
    group: str = ""  # the conversation, document or tenant: for the report's working-set figures


@dataclass(frozen=True)
class Workload:
    """A named list of requests plus the figures that say how it was sized."""

    name: str
    description: str
    requests: list[Request]
    working_set_tokens: int
    kv_tokens_per_engine: int
    details: dict[str, float | int | str] = field(default_factory=dict)

    @property
    def working_set_x_kv(self) -> float:
        return self.working_set_tokens / self.kv_tokens_per_engine


@dataclass(frozen=True)
class Sizing:
    """Everything a workload's size depends on: one engine's KV, `--scale` and `--requests`.

    `scale` multiplies every prompt length *and* the KV capacity the engines are started with (the
    caller does the latter), so the working set stays the same multiple of the KV: the regime (fits
    in one engine, in both, in neither) is what the benchmark is about. `requests` multiplies only
    how many requests (users, accesses) each workload sends.
    """

    kv_tokens: int
    scale: float = 1.0
    requests: float = 1.0
    seed: int = 0

    def tokens(self, base: int) -> int:
        """A prompt length given for scale 1, scaled (at least 8 tokens)."""
        return max(8, round(base * self.scale))

    def count(self, base: int, minimum: int = 1) -> int:
        """A number of requests or users given for --requests 1, scaled."""
        return max(minimum, round(base * self.requests))


class TextSource:
    """Random words from the test bed's corpus, with the tokenizer's tokens-per-word ratio measured.

    Words from the corpus the tokenizer was trained on tokenize compactly (about 1.3 tokens a word for
    the mid model), so a target token count converts to a word count reliably.
    """

    def __init__(self, corpus: str, tokenizer_json: Path | None) -> None:
        self.words = sorted(set(re.findall(r"[a-z]+", corpus.lower())))
        self.tokens_per_word = 1.3  # the mid model's figure, until measured
        self.tokens_per_word = self._measure(tokenizer_json)

    def _measure(self, tokenizer_json: Path | None) -> float:
        """Tokens per word on 4,000 random words; the current estimate without a tokenizer."""
        if tokenizer_json is None or not tokenizer_json.exists():
            return self.tokens_per_word
        from tokenizers import Tokenizer

        sample = self.text(random.Random(12345), 4000 * 1.3)
        ids = Tokenizer.from_file(str(tokenizer_json)).encode(sample).ids
        return len(ids) / 4000

    def text(self, rng: random.Random, tokens: float) -> str:
        """About `tokens` tokens of random words drawn from `rng`."""
        count = max(1, round(tokens / self.tokens_per_word))
        return " ".join(rng.choice(self.words) for _ in range(count))


def _chat_overhead() -> int:
    """Tokens the chat template adds per message (role markers); a rough figure for sizing only."""
    return 4


def multi_round(size: Sizing, source: TextSource, *, sessions: bool) -> tuple[list[Request], dict]:
    """U users, R rounds each, interleaved round by round (users in a seeded order per round).

    Every user shares one system prompt (one application); each round appends the user's question
    and a fixed synthetic answer (not the model's output, so every contender sees the same text).
    U is chosen so that the final conversations together are 1.5 x one engine's KV.
    """
    rng = random.Random(size.seed * 1000 + 1)
    system_len, question_len, answer_len, rounds = size.tokens(256), size.tokens(160), size.tokens(24), 5
    per_user = rounds * (question_len + answer_len + 2 * _chat_overhead())
    users = max(2, round((1.5 * size.kv_tokens - system_len) / per_user))
    users = size.count(users, minimum=2)
    system = "You are the assistant of the routing benchmark. " + source.text(rng, system_len)
    questions = [[source.text(rng, question_len) for _ in range(rounds)] for _ in range(users)]
    answers = [[source.text(rng, answer_len) for _ in range(rounds)] for _ in range(users)]
    requests: list[Request] = []
    last: dict[int, int] = {}
    for round_index in range(rounds):
        order = list(range(users))
        rng.shuffle(order)
        for user in order:
            messages = [{"role": "system", "content": system}]
            for past in range(round_index):
                messages.append({"role": "user", "content": questions[user][past]})
                messages.append({"role": "assistant", "content": answers[user][past]})
            messages.append({"role": "user", "content": questions[user][round_index]})
            session = f"user-{user:04d}" if sessions else None
            request = Request(len(requests), messages, session, last.get(user), f"user-{user}")
            last[user] = request.index
            requests.append(request)
    working_set = system_len + users * per_user
    return requests, {"users": users, "rounds": rounds, "working_set": working_set}


def documents(
    size: Sizing, source: TextSource, *, working_set_x: float, per_doc: int, zipf: float, seed_offset: int
) -> tuple[list[Request], dict]:
    """Many users asking short questions about D long documents; D set by the working set target.

    Document choice is uniform (`zipf` 0) or Zipf-like with exponent `zipf`. Each request comes from a
    distinct user id (sent as a session), so per-user stickiness gains nothing here.
    """
    rng = random.Random(size.seed * 1000 + seed_offset)
    doc_len, question_len = size.tokens(1536), size.tokens(48)
    count = max(2, round(working_set_x * size.kv_tokens / doc_len))
    docs = [f"Document {i}. " + source.text(rng, doc_len) for i in range(count)]
    weights = [1.0 / (rank + 1) ** zipf for rank in range(count)]
    total = size.count(per_doc * count, minimum=2 * count)
    requests = []
    for index in range(total):
        doc = rng.choices(range(count), weights)[0]
        messages = [
            {"role": "system", "content": "Answer from the document."},
            {"role": "user", "content": docs[doc] + "\nQuestion: " + source.text(rng, question_len)},
        ]
        requests.append(Request(index, messages, f"reader-{index:05d}", None, f"doc-{doc}"))
    return requests, {"documents": count, "document_tokens": doc_len, "working_set": count * doc_len}


def tenants(size: Sizing, source: TextSource) -> tuple[list[Request], dict]:
    """T tenants, each with its own long system prompt, Zipf(1.0) popularity; working set 1.5x KV.

    Users of a tenant have their own ids, so routing by session scatters a tenant over both engines
    while routing by prefix keeps each tenant's system prompt in one place.
    """
    rng = random.Random(size.seed * 1000 + 4)
    system_len, question_len = size.tokens(1024), size.tokens(96)
    count = max(2, round(1.5 * size.kv_tokens / system_len))
    systems = [f"Tenant {t} policy. " + source.text(rng, system_len) for t in range(count)]
    weights = [1.0 / (rank + 1) for rank in range(count)]
    total = size.count(64, minimum=2 * count)
    requests = []
    for index in range(total):
        tenant = rng.choices(range(count), weights)[0]
        messages = [
            {"role": "system", "content": systems[tenant]},
            {"role": "user", "content": source.text(rng, question_len)},
        ]
        user = f"tenant-{tenant}-user-{rng.randrange(1000):03d}"
        requests.append(Request(index, messages, user, None, f"tenant-{tenant}"))
    return requests, {"tenants": count, "system_tokens": system_len, "working_set": count * system_len}


def build(name: str, size: Sizing, source: TextSource) -> Workload:
    """The workload called `name` ("a".."e") at `size`."""
    builders: dict[str, Callable[[], tuple[list[Request], dict]]] = {
        "a": lambda: multi_round(size, source, sessions=True),
        "b": lambda: multi_round(size, source, sessions=False),
        "c": lambda: documents(size, source, working_set_x=1.5, per_doc=6, zipf=0.0, seed_offset=3),
        "d": lambda: tenants(size, source),
        "e": lambda: documents(size, source, working_set_x=3.0, per_doc=4, zipf=0.0, seed_offset=5),
    }
    if name not in builders:
        raise ValueError(f"unknown workload {name!r}; choose from {','.join(WORKLOAD_NAMES)}")
    requests, details = builders[name]()
    working_set = int(details.pop("working_set"))
    return Workload(name, DESCRIPTIONS[name], requests, working_set, size.kv_tokens, details)


def estimated_prompt_tokens(workload: Workload, source: TextSource) -> int:
    """The longest prompt of `workload` in tokens (estimate), to check it fits the engine's limits."""
    longest = 0
    for request in workload.requests:
        words = sum(len(m["content"].split()) for m in request.messages)
        longest = max(longest, math.ceil(words * source.tokens_per_word) + 8 * len(request.messages))
    return longest
