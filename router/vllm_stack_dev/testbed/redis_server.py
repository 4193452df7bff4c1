"""A real Redis server for the tests: Debian's ``redis-server``, a throw-away directory, loopback only.

The rate limits' shared store is tested against the real server, not a fake: what makes it exact
across router replicas is Redis running each decision's script atomically on its own clock, which a
fake would only imitate. Started and stopped by PID (:class:`RedisServer`); no persistence, a password
(``requirepass``) so the tests pass one as the chart's Secret does.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from vllm_stack_dev.testbed.engines import port_for_later, spawn_logged

MISSING = (
    "Redis's server (redis-server) was not found on PATH: install Debian's package with "
    "`apt-get install redis-server` (`make install` does when it runs as root)"
)


class RedisError(RuntimeError):
    """The server could not start in time or exited; the message carries its log tail."""


class RedisServer:
    """One ``redis-server`` on 127.0.0.1 in its own temp directory; :attr:`url` names it (password
    included). Use as a context manager, or :meth:`start` / :meth:`stop`."""

    def __init__(self, base_dir: Path | None = None) -> None:
        self.base_dir = base_dir
        self.dir: Path | None = None
        self.port = 0
        self.password = secrets.token_hex(12)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        assert self.dir is not None
        return self.dir / "redis.log"

    def start(self, timeout: float = 20.0) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisError(MISSING)
        self.dir = Path(tempfile.mkdtemp(prefix="vllm-stack-redis-", dir=self.base_dir))
        self.port = port_for_later()
        config = self.dir / "redis.conf"
        config.write_text(
            f"bind 127.0.0.1\nport {self.port}\nprotected-mode yes\nrequirepass {self.password}\n"
            f'dir {self.dir}\nsave ""\nappendonly no\ndaemonize no\nlogfile ""\n'
        )
        os.chmod(config, 0o600)
        self.process = spawn_logged([binary, str(config)], self.log_path, None)
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        """Until the server answers PING with our password (raises with the log tail otherwise)."""
        deadline = time.monotonic() + timeout
        hello = f"AUTH {self.password}\r\nPING\r\n".encode()
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RedisError(f"redis-server exited with {self.process.returncode}:\n{self._log_tail()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 1) as sock:
                sock.sendall(hello)
                sock.settimeout(1)
                answer = b""
                while b"PONG" not in answer:
                    chunk = sock.recv(256)
                    if not chunk:
                        break
                    answer += chunk
                if b"+PONG" in answer:
                    return
            time.sleep(0.05)
        raise RedisError(
            f"redis-server did not answer on 127.0.0.1:{self.port} in {timeout}s:\n{self._log_tail()}"
        )

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server by its PID (SIGTERM, then SIGKILL to its group) and remove its directory."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=5)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
