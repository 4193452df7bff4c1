"""The rendered cache server command is real and its TCP probe works: `lmcache_server HOST PORT` from the
LMCache 0.5.6 wheel starts with the engine environment's torch, and a TCP connect (what the kubelet's
tcpSocket probe does) succeeds.

Changed from the rendered command: host 0.0.0.0 -> 127.0.0.1 and the port -> a free port (parallel test
sessions share this machine). LMCache is not installable here (its CUDA extension), so its wheel and
sortedcontainers (its one missing pure-Python import) are unpacked from .cache/wheels/, which `make install`
fills (`pip download lmcache==0.5.6 sortedcontainers==2.4.0 --no-deps -d .cache/wheels`)."""

from __future__ import annotations

import subprocess
import time

import pytest
from vllm_stack_dev.paths import engine_python
from vllm_stack_dev.testbed.engines import free_port, stop_process
from vllm_stack_dev.testbed.lmcache import lmcache_env, unpack_lmcache
from vllm_stack_dev.waiting import tcp_open

from tests.helm.chart import EXAMPLES, ROOT, cache_server_name, container, env_of, one, render

pytestmark = [pytest.mark.helm, pytest.mark.engine]

WHEELS = ROOT / ".cache" / "wheels"


def test_rendered_cache_server_starts_and_answerstcp_open(tmp_path):
    site = unpack_lmcache(tmp_path)

    objs = render([EXAMPLES / "cache-server.yaml"])
    c = container(one(objs, "Deployment", cache_server_name("Deployment")))
    program, host, port = c["command"]
    assert (program, host, port) == ("lmcache_server", "0.0.0.0", "8080")
    probe = c["livenessProbe"]["tcpSocket"]["port"]
    assert {"name": probe, "containerPort": int(port), "protocol": "TCP"} in c["ports"]

    test_port = free_port()
    env = lmcache_env(site, {e: v["value"] for e, v in env_of(c).items() if "value" in v and e != "HOME"})
    # The console script `lmcache_server` is lmcache.v1.server.__main__:main with argv [HOST, PORT].
    script = f"import sys; sys.argv = ['{program}', '127.0.0.1', '{test_port}']; from lmcache.v1.server.__main__ import main; main()"
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen(
        [str(engine_python()), "-c", script], stdout=log, stderr=subprocess.STDOUT, env=env
    )
    try:
        deadline = time.monotonic() + 120
        while not tcp_open(test_port):
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.5)
        assert env_of(c)["LMCACHE_TRACK_USAGE"]["value"] == "false"  # rendered, not the test's default
    finally:
        stop_process(proc)
