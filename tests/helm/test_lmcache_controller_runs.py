"""The rendered LMCache controller command is real and answers the router's lookup: `lmcache_controller --host
--port --monitor-ports JSON` from the LMCache 0.5.6 wheel starts with the engine environment's torch, its API port
takes a TCP connect (the kubelet's tcpSocket probe) and `POST /lookup {"tokens": [1, 2, 3]}` answers 200 with no
holder (`layout_info: {}`: no engine reported anything).

Changed from the rendered command: host 0.0.0.0 -> 127.0.0.1 and the four ports -> free ports (parallel test
sessions share this machine). LMCache is not installable here (its CUDA extension), so its wheel and
sortedcontainers (its one missing pure-Python import) are unpacked from .cache/wheels/, which `make install`
fills (`pip download lmcache==0.5.6 sortedcontainers==2.4.0 --no-deps -d .cache/wheels`)."""

from __future__ import annotations

import configparser
import json
import subprocess
import time
import urllib.error
import urllib.request
import zipfile

import pytest
from vllm_stack_dev.paths import engine_python
from vllm_stack_dev.testbed.engines import free_port, stop_process
from vllm_stack_dev.testbed.lmcache import lmcache_env, unpack_lmcache
from vllm_stack_dev.waiting import tcp_open

from tests.helm.chart import RELEASE, ROOT, container, env_of, one, render, values_file

pytestmark = [pytest.mark.helm, pytest.mark.engine]

WHEELS = ROOT / ".cache" / "wheels"
VALUES = {
    "servingEngineSpec": {
        "modelSpec": [{"name": "m", "modelURL": "org/m", "lmcacheConfig": {"enabled": True}}]
    },
    "routerSpec": {"routingLogic": "kvaware"},
}


def _lookup(port: int, tokens: list[int]) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/lookup",
        data=json.dumps({"tokens": tokens}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode(errors="replace")}


def test_the_console_script_is_the_module_started_here():
    """The image's `lmcache_controller` (the rendered command) is the entry point this test runs."""
    wheels = sorted(WHEELS.glob("lmcache-0.5.6-*.whl"))
    if not wheels:
        pytest.fail("LMCache 0.5.6 wheel missing in .cache/wheels: run `make install`")
    parser = configparser.ConfigParser()
    with zipfile.ZipFile(wheels[0]) as whl:
        parser.read_string(whl.read("lmcache-0.5.6.dist-info/entry_points.txt").decode())
    assert parser["console_scripts"]["lmcache_controller"] == "lmcache.v1.api_server.__main__:main"


def test_rendered_controller_starts_and_answers_a_lookup(tmp_path):
    site = unpack_lmcache(tmp_path)
    c = container(one(render([values_file(tmp_path, VALUES)]), "Deployment", f"{RELEASE}-lmcache-controller"))
    command = c["command"]
    assert command[:3] == ["lmcache_controller", "--host", "0.0.0.0"]
    assert command[3:6:2] == ["--port", "--monitor-ports"]
    rendered_ports = json.loads(command[6])
    assert set(rendered_ports) == {"pull", "reply", "heartbeat"}
    probe = c["livenessProbe"]["tcpSocket"]["port"]
    assert {"name": probe, "containerPort": int(command[4]), "protocol": "TCP"} in c["ports"]

    api = free_port()
    monitor = {name: free_port() for name in rendered_ports}
    argv = [*command[:2], "127.0.0.1", command[3], str(api), command[5], json.dumps(monitor)]
    env = lmcache_env(site, {e: v["value"] for e, v in env_of(c).items() if "value" in v and e != "HOME"})
    # The console script `lmcache_controller` is lmcache.v1.api_server.__main__:main.
    script = f"import sys; sys.argv = {argv!r}; from lmcache.v1.api_server.__main__ import main; main()"
    log_path = tmp_path / "controller.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [str(engine_python()), "-c", script], stdout=log, stderr=subprocess.STDOUT, env=env
    )
    try:
        deadline = time.monotonic() + 120
        while not tcp_open(api):
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.5)
        status, body = _lookup(api, [1, 2, 3])
        assert status == 200, (body, log_path.read_text())
        assert body["layout_info"] == {}, body
        rendered = env_of(c)  # the chart's own values, not the test's defaults
        assert (
            rendered["PYTHONHASHSEED"]["value"] == "123"
            and rendered["LMCACHE_TRACK_USAGE"]["value"] == "false"
        )
        # The worker ports are bound where the engines' LMCache connects (ZMQ on TCP).
        assert all(tcp_open(p) for p in (monitor["pull"], monitor["reply"], monitor["heartbeat"])), monitor
    finally:
        stop_process(proc)
