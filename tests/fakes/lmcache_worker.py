"""Stands in for engines' LMCache workers towards a real ``lmcache_controller`` (LMCache 0.5.6).

The vLLM LMCache connector needs CUDA, so no engine here runs an LMCache worker. This script speaks
the worker's side of the controller's own ZMQ protocol with LMCache's own classes: ``RegisterMsg``
over a DEALER socket to the controller's reply port, and ``BatchedKVOperationMsg`` (admit / evict)
over a PUSH socket to its pull port, with chunk hashes computed by LMCache's ``ChunkedTokenDatabase``
(256-token chunks, Python's hash seeded by ``PYTHONHASHSEED``), the same code a worker runs.

It runs with the engine environment's Python and the LMCache wheel on ``PYTHONPATH`` (see
:mod:`tests.fakes.lmcache_procs`), reads one JSON command per line on stdin and answers one JSON line:
``{"op": "register", "instance": ID}``, ``{"op": "admit"|"evict", "instance": ID, "tokens": [...]}``
(answers ``{"keys": N}``, the chunks sent). Admits and evicts are pushed without an answer from the
controller, so each is followed by a ``/lookup`` on the controller's HTTP API until it shows.
"""

from __future__ import annotations

import argparse
import json
import sys

import msgspec
import zmq
from lmcache.v1.cache_controller.message import (
    BatchedKVOperationMsg,
    KVOpEvent,
    Msg,
    OpType,
    RegisterMsg,
    RegisterRetMsg,
)
from lmcache.v1.token_database import ChunkedTokenDatabase

LOCATION = "LocalCPUBackend"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pull", required=True, help="the controller's pull address, host:port")
    parser.add_argument("--reply", required=True, help="the controller's reply address, host:port")
    args = parser.parse_args()
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.connect(f"tcp://{args.pull}")
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 10_000)
    dealer.connect(f"tcp://{args.reply}")
    database = ChunkedTokenDatabase()
    seq: dict[str, int] = {}
    for line in sys.stdin:
        command = json.loads(line)
        instance = command["instance"]
        if command["op"] == "register":
            msg = RegisterMsg(instance_id=instance, worker_id=0, ip="127.0.0.1", port=0, peer_init_url=None)
            dealer.send_multipart([b"", msgspec.msgpack.encode(msg)])
            answer = msgspec.msgpack.decode(dealer.recv_multipart()[-1], type=Msg)
            reply: dict[str, object] = {"registered": isinstance(answer, RegisterRetMsg)}
        else:
            op = OpType.ADMIT if command["op"] == "admit" else OpType.EVICT
            keys = [key for _, _, key in database.process_tokens(command["tokens"], make_key=False)]
            events = []
            for key in keys:
                seq[instance] = seq.get(instance, -1) + 1
                events.append(KVOpEvent(op_type=op, key=key, seq_num=seq[instance]))
            batch = BatchedKVOperationMsg(
                instance_id=instance, worker_id=0, location=LOCATION, operations=events
            )
            push.send_multipart([msgspec.msgpack.encode(batch)])
            reply = {"keys": len(keys)}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
