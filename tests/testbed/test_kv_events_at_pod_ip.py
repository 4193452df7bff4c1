"""Engines at test-cluster Pod IPs publish their KV events where llm-d's router dials: one port, each at its
own loopback address, bound by the engine (vLLM 0.32 binds only endpoints holding ``*`` or ``::``)."""

from __future__ import annotations

import json
import time

import pytest
import zmq
from vllm_stack_dev.testbed.engines import EngineSpec, kv_events_bind_host, port_for_later, server_args


def _events_config(args: list[str]) -> dict:
    return json.loads(args[args.index("--kv-events-config") + 1])


def test_an_engine_at_a_pod_ip_binds_its_kv_events_there_with_llmds_topic() -> None:
    spec = EngineSpec("/models/mid", "mid", enable_lora=False)
    config = _events_config(server_args(spec, 8000, 5557, host="127.16.0.3", kv_events_at_host=True))
    assert config["endpoint"] == "tcp://[::ffff:127.16.0.3]:5557"
    assert config["topic"] == "kv@127.16.0.3@mid"  # kv@<pod>@<model>, as llm-d's vLLM adapter parses it
    # without it: every interface, no topic (as before)
    plain = _events_config(server_args(spec, 8000, 5557, host="127.16.0.3"))
    assert plain["endpoint"] == "tcp://*:5557" and "topic" not in plain
    # the form vLLM binds (not connects): it holds "::" (ZmqEventPublisher._is_bind_endpoint)
    assert "::" in config["endpoint"]
    assert kv_events_bind_host("::1") == "::1"


def test_two_publishers_share_one_port_at_their_own_addresses() -> None:
    """What the engines do with that endpoint (libzmq, as vLLM calls it): two PUB sockets bound on one
    port at two loopback addresses, each reached by a subscriber dialling that address in IPv4 form."""
    port = port_for_later()
    context = zmq.Context()
    sockets = []
    try:
        received = {}
        for index, host in enumerate(("127.16.0.41", "127.16.0.42")):
            pub = context.socket(zmq.PUB)
            pub.bind(f"tcp://{kv_events_bind_host(host)}:{port}")
            assert pub.getsockopt_string(zmq.LAST_ENDPOINT) == f"tcp://{host}:{port}"
            sub = context.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://{host}:{port}")
            sockets += [pub, sub]
            deadline = time.monotonic() + 10
            while not sub.poll(50):  # a PUB drops what it sends before the subscription arrives
                if time.monotonic() > deadline:
                    pytest.fail(f"no message from the publisher at {host}:{port} within 10 s")
                pub.send_multipart([f"kv@{host}@mid".encode(), str(index).encode()])
            received[host] = sub.recv_multipart()
        assert {host: frames[0].decode() for host, frames in received.items()} == {
            "127.16.0.41": "kv@127.16.0.41@mid",
            "127.16.0.42": "kv@127.16.0.42@mid",
        }
    finally:
        for sock in sockets:
            sock.close(linger=0)
        context.term()
