"""Token ids of rendered conversations, reusing the ids of the conversation's earlier turns.

A chat client resends the whole conversation every turn, so the router would tokenize the same
history again and again (28 ms for an 8k-token conversation on this machine's cores). The tokenizer
splits its input at special tokens (the added tokens a chat template writes between messages,
``<|im_end|>``, ``<|eot_id|>``...) and encodes the pieces between them independently, so the ids of
a text cut just after a special token are the ids of the part before it followed by those of the
part after it. The cache keeps, per conversation, the ids of its rendered text up to the last
special token; a later turn whose text starts with that prefix encodes only the rest.

Lookup: a hash of the text up to each special-token boundary (one pass of a streaming xxh3 over the
text), longest first; a hit is confirmed by comparing the stored prefix with the text itself, so a
hash collision can never give wrong ids. Bounded: at most ``max_chars`` characters of prefixes held
(ids stored as 4-byte arrays), the least recently used go first.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

DEFAULT_MAX_CHARS = 16 << 20  # about 16 MB of text plus 4 bytes per id


@dataclass(slots=True)
class _Entry:
    text: str
    ids: array


class PrefixTokenCache:
    """Ids of conversation prefixes that end at a special token, for one tokenizer."""

    def __init__(
        self,
        encode: Callable[[str], Sequence[int]],
        special_tokens: Sequence[str],
        max_chars: int = DEFAULT_MAX_CHARS,
    ) -> None:
        self._encode = encode
        tokens = sorted((t for t in special_tokens if t), key=len, reverse=True)
        self._boundary = re.compile("|".join(re.escape(t) for t in tokens)) if tokens else None
        self.max_chars = max_chars
        self._entries: dict[int, _Entry] = {}  # prefix hash -> entry, least recently used first
        self._chars = 0
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()  # chat_ids runs on worker threads for long prompts

    def __len__(self) -> int:
        return len(self._entries)

    def ids(self, text: str) -> list[int]:
        """The ids of ``text``, as ``encode(text)`` gives them."""
        return self.id_array(text).tolist()

    def id_array(self, text: str) -> array:
        """:meth:`ids` as 4-byte ids, the form block keys hash (no list of ints made on the way)."""
        cuts = [m.end() for m in self._boundary.finditer(text)] if self._boundary is not None else []
        if not cuts:
            return array("I", self._encode(text))
        hashes = self._prefix_hashes(text, cuts)
        start, ids, used = 0, array("I"), None
        with self._lock:
            for cut, h in zip(reversed(cuts), reversed(hashes), strict=True):
                entry = self._entries.get(h)
                if entry is not None and len(entry.text) == cut and text.startswith(entry.text):
                    start, ids, used = cut, entry.ids, h
                    break
            if used is None:
                self.misses += 1
            else:
                self.hits += 1
                self._entries[used] = self._entries.pop(used)  # now the most recent
        last = cuts[-1]
        if last > start:  # the new part up to the last boundary, kept for the next turn
            prefix = array("I", ids)
            prefix.extend(self._encode(text[start:last]))
            self._store(hashes[-1], text[:last], prefix, replaces=used)
            ids = prefix
        out = array("I", ids)
        if last < len(text):
            out.extend(self._encode(text[last:]))
        return out

    @staticmethod
    def _prefix_hashes(text: str, cuts: list[int]) -> list[int]:
        """xxh3 of ``text[:cut]`` for every cut, in one streaming pass."""
        h = xxhash.xxh3_64()
        out = []
        pos = 0
        for cut in cuts:
            h.update(text[pos:cut].encode("utf-8", "surrogatepass"))
            pos = cut
            out.append(h.intdigest())
        return out

    def _store(self, key: int, text: str, ids: array, replaces: int | None) -> None:
        """Keep ``text``'s ids; the shorter prefix it grew from goes (the next turn starts from this)."""
        if len(text) > self.max_chars:
            return
        with self._lock:
            for old_key in (replaces, key):
                old = self._entries.pop(old_key, None) if old_key is not None else None
                if old is not None:
                    self._chars -= len(old.text)
            self._entries[key] = _Entry(text, ids)
            self._chars += len(text)
            while self._chars > self.max_chars:
                oldest = next(iter(self._entries))
                self._chars -= len(self._entries.pop(oldest).text)
