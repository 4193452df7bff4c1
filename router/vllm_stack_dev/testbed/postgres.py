"""A real PostgreSQL server for the tests: Debian's binaries, a throw-away cluster, loopback TCP only.

The Batch API's shared store (router replicas leasing batch work with ``FOR UPDATE SKIP LOCKED``) is
tested against the real server, not a fake: row locks, ``SKIP LOCKED`` and transaction isolation are
exactly what a fake would get wrong. See :class:`PostgresServer`.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

from vllm_stack_dev.testbed.engines import port_for_later, spawn_logged

#: The system account the server runs as when this process is root (Debian's package creates it).
SYSTEM_USER = "postgres"
#: The cluster's superuser role, which the DSNs name (with a generated password).
SUPERUSER = "postgres"
#: The private folders made in the system temp directory when base_dir is out of the server account's reach.
PRIVATE_PREFIX = "vllm-stack-postgres-"
MISSING = (
    "PostgreSQL's server binaries (initdb, postgres) were not found on PATH or under "
    "/usr/lib/postgresql/*/bin: install Debian's package with `apt-get install postgresql` "
    "(`make install` does when it runs as root)"
)


class PostgresError(RuntimeError):
    """The server could not be set up, did not start in time or exited; the message carries its log tail."""


def find_binaries() -> Path:
    """The folder holding ``initdb`` and ``postgres``: PATH first, else the newest /usr/lib/postgresql/N/bin."""
    on_path = shutil.which("postgres")
    if on_path and shutil.which("initdb"):
        return Path(on_path).resolve().parent
    candidates = [Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/postgres")]
    candidates = [c for c in candidates if (c / "initdb").exists()]
    if not candidates:
        raise PostgresError(MISSING)

    def major(folder: Path) -> float:
        try:
            return float(folder.parent.name)
        except ValueError:
            return -1.0

    return max(candidates, key=major)


def _as_server_user() -> list[str]:
    """The command prefix that runs a program as the ``postgres`` account when this process is root
    (initdb and postgres refuse to run as root); nothing otherwise.

    setpriv execs the program itself, so the PID we hold is the postmaster's and the parent-death
    signal survives the change of user (``--pdeathsig``); runuser (a PAM session with a watching parent
    that forwards signals) only where setpriv is missing.
    """
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        raise PostgresError(
            f"running as root and there is no `{SYSTEM_USER}` user to run the server as: "
            "install Debian's package with `apt-get install postgresql` (it creates the user)"
        ) from None
    if shutil.which("setpriv"):
        return [
            "setpriv",
            f"--reuid={SYSTEM_USER}",
            f"--regid={SYSTEM_USER}",
            "--init-groups",
            "--pdeathsig=TERM",
            "--",
        ]
    if shutil.which("runuser"):
        return ["runuser", "-u", SYSTEM_USER, "--"]
    raise PostgresError("running as root, and neither setpriv nor runuser (util-linux) is installed")


def _database_name(name: str) -> str:
    """``name`` as a plain lowercase identifier of at most 63 bytes (PostgreSQL's limit)."""
    cleaned = re.sub(r"[^a-z0-9_]+", "_", name.lower()).strip("_") or "db"
    if cleaned[0].isdigit():
        cleaned = f"db_{cleaned}"
    return cleaned[:63]


class PostgresServer:
    """A throw-away PostgreSQL cluster started from Debian's binaries, as a context manager.

    Why a class with ``__enter__``/``__exit__``: the server is a child process with a data directory, and
    both must go away however the test session ends; ``with PostgresServer(tmp) as pg:`` (or a session
    fixture around it) guarantees the stop. The server also gets the parent-death signal, so it does not
    outlive a test process that is killed.

    ``start()`` runs ``initdb`` (superuser ``postgres`` with a generated password, ``scram-sha-256`` for
    TCP, the way a DSN from a Kubernetes Secret carries one), then ``postgres`` on ``127.0.0.1`` and a
    free port, with ``fsync=off`` (a test cluster needs no durability), in its own process group. It
    waits until a real connection succeeds (a deadline, no fixed sleep) and creates the database
    ``dbname``. As root the server runs as the ``postgres`` account (it refuses root); its folders are
    then owned by that account, and when ``base_dir`` is not reachable by it (pytest's
    ``/tmp/pytest-of-root`` is mode 0700) they go to a private folder under the system temp directory,
    removed at stop. The server log stays in ``base_dir``.
    """

    def __init__(
        self,
        base_dir: Path,
        *,
        dbname: str = "vllm_stack",
        start_timeout: float = 60.0,
        extra_settings: dict[str, str] | None = None,
    ) -> None:
        self.base_dir = Path(base_dir)
        self.dbname = dbname
        self.start_timeout = start_timeout
        self.extra_settings = dict(extra_settings or {})
        self.user = SUPERUSER
        self.password = secrets.token_urlsafe(18)
        self.host = "127.0.0.1"
        self.port = 0
        self.root: Path | None = None  # holds data/ and socket/
        self.log_path = self.base_dir / "postgres.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.started_in: float | None = None  # seconds from initdb to the first connection
        self._private_root: Path | None = None  # a folder we made outside base_dir, removed at stop
        self._created = 0

    # -- DSNs -----------------------------------------------------------------------------------------

    def dsn_for(self, dbname: str) -> str:
        """``postgresql://user:password@127.0.0.1:port/dbname``."""
        credentials = f"{quote(self.user, safe='')}:{quote(self.password, safe='')}"
        return f"postgresql://{credentials}@{self.host}:{self.port}/{quote(dbname, safe='')}"

    @property
    def dsn(self) -> str:
        """The DSN of the database created at start (``dbname``)."""
        return self.dsn_for(self.dbname)

    @property
    def admin_dsn(self) -> str:
        """The DSN of the ``postgres`` maintenance database."""
        return self.dsn_for("postgres")

    # -- life cycle -----------------------------------------------------------------------------------

    def start(self) -> PostgresServer:
        if self.process is not None:
            return self
        binaries = find_binaries()  # before anything else: the clearest error when the package is missing
        prefix = _as_server_user()
        self.base_dir.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()
        self.root = self._make_root(prefix)
        data, sockets = self.root / "data", self.root / "socket"
        self._make_owned(sockets, prefix)
        pwfile = self.root / "pwfile"
        self._write_owned(pwfile, self.password + "\n", prefix)
        try:
            self._run(
                [
                    *prefix,
                    str(binaries / "initdb"),
                    "--pgdata",
                    str(data),
                    "--username",
                    self.user,
                    "--pwfile",
                    str(pwfile),
                    "--auth-host=scram-sha-256",
                    "--auth-local=scram-sha-256",
                    "--encoding=UTF8",
                    "--locale=C",
                    "--no-sync",
                    "--no-instructions",
                ],
                "initdb",
            )
        finally:
            pwfile.unlink(missing_ok=True)
        self.port = port_for_later()
        settings = {
            "listen_addresses": "127.0.0.1",
            "port": str(self.port),
            "unix_socket_directories": str(sockets),
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_connections": "100",
            **self.extra_settings,
        }
        command = [*prefix, str(binaries / "postgres"), "-D", str(data)]
        for key, value in settings.items():
            command += ["-c", f"{key}={value}"]
        # spawn_logged: its own process group, output to the log (opened here, so it may live where the
        # server account cannot write), SIGTERM when this process dies.
        self.process = spawn_logged(command, self.log_path, _server_env())
        try:
            self._wait_ready()
            self._create_database(self.dbname)
        except BaseException:
            self.stop()
            raise
        self.started_in = time.monotonic() - began
        return self

    def stop(self, timeout: float = 15.0) -> None:
        """Fast shutdown (SIGINT to the postmaster: it ends every session, checkpoints and exits), then
        SIGKILL to its process group after ``timeout`` seconds. Idempotent.

        Not SIGTERM: that is PostgreSQL's *smart* shutdown, which waits for every client to disconnect,
        so one connection a test leaked would hold it until the SIGKILL. The backends are not in the
        postmaster's process group (each makes itself a group leader); they exit on their own when the
        postmaster is gone.
        """
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._postmaster_pid() or process.pid, signal.SIGINT)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=5)
        if self._private_root is not None:
            shutil.rmtree(self._private_root, ignore_errors=True)
            self._private_root = None

    def _postmaster_pid(self) -> int | None:
        """The postmaster's PID from its ``postmaster.pid``: our child's PID under setpriv, its child's
        under runuser (whose watching parent does not pass SIGINT on)."""
        if self.root is None:
            return None
        try:
            return int((self.root / "data" / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # -- databases ------------------------------------------------------------------------------------

    def new_database(self, name: str = "test") -> str:
        """Create a fresh, empty database named after ``name`` (made unique) and return its DSN."""
        self._created += 1
        base = _database_name(name)
        suffix = f"_{self._created}_{secrets.token_hex(3)}"
        dbname = base[: 63 - len(suffix)] + suffix
        self._create_database(dbname)
        return self.dsn_for(dbname)

    def _create_database(self, dbname: str) -> None:
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.admin_dsn, autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))

    # -- helpers --------------------------------------------------------------------------------------

    def _wait_ready(self) -> None:
        """Until a connection to the maintenance database succeeds; PostgresError when the server exits
        first or the deadline passes."""
        import psycopg

        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout
        last: Exception | None = None
        while True:
            if self.process.poll() is not None:
                raise PostgresError(
                    f"postgres exited with code {self.process.returncode} during start-up; "
                    f"its log ({self.log_path}):\n{self.log_tail()}"
                )
            try:
                with psycopg.connect(self.admin_dsn, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError as error:
                last = error
            if time.monotonic() > deadline:
                raise PostgresError(
                    f"postgres not accepting connections on {self.host}:{self.port} after "
                    f"{self.start_timeout:.0f} s ({last}); its log ({self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def _make_root(self, prefix: Sequence[str]) -> Path:
        """The folder for data/ and socket/: under base_dir when the server account can use it there."""
        root = Path(tempfile.mkdtemp(prefix="postgres-", dir=self.base_dir))
        if not prefix:
            return root
        _chown_to_server_user(root)
        if subprocess.run([*prefix, "test", "-w", str(root), "-a", "-x", str(root)]).returncode == 0:
            return root
        # An ancestor the server account cannot enter (pytest-of-root is 0700): a private folder of its
        # own in the system temp directory (world-traversable), removed at stop.
        root.rmdir()
        _remove_stale_private_roots()
        root = Path(tempfile.mkdtemp(prefix=PRIVATE_PREFIX))
        _chown_to_server_user(root)
        self._private_root = root
        return root

    def _make_owned(self, path: Path, prefix: Sequence[str]) -> None:
        path.mkdir(mode=0o700)
        if prefix:
            _chown_to_server_user(path)

    def _write_owned(self, path: Path, text: str, prefix: Sequence[str]) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        if prefix:
            _chown_to_server_user(path)

    def _run(self, command: list[str], what: str) -> None:
        result = subprocess.run(command, capture_output=True, text=True, env=_server_env())
        if result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).splitlines()[-25:])
            raise PostgresError(f"{what} failed ({result.returncode}): `{' '.join(command)}`\n{tail}")


def _remove_stale_private_roots(min_age: float = 600.0) -> None:
    """Remove the private folders of earlier sessions that were killed before their stop (SIGKILL): older
    than ``min_age`` seconds and with no live postmaster in them."""
    for root in Path(tempfile.gettempdir()).glob(f"{PRIVATE_PREFIX}*"):
        try:
            if time.time() - root.stat().st_mtime < min_age:
                continue
            pid = int((root / "data" / "postmaster.pid").read_text().split("\n", 1)[0])
            os.kill(pid, 0)
            continue  # its server still runs
        except (OSError, ValueError):
            pass  # no pid file, no such process, unreadable: stale
        shutil.rmtree(root, ignore_errors=True)


def _chown_to_server_user(path: Path) -> None:
    entry = pwd.getpwnam(SYSTEM_USER)
    os.chown(path, entry.pw_uid, entry.pw_gid)


def _server_env() -> dict[str, str]:
    """This environment without libpq's PG* variables (PGDATA, PGPORT... would change what the server and
    initdb do) and with a locale every system has."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PG")}
    env.update(LC_ALL="C", LANG="C")
    return env
