"""Shared fixtures: locally built models and real vLLM engines (CPU build), started once per session.

Engines are expensive (about a minute each on one free core), so they start in two waves when the first
test needs any: the two chat engines and the embedding engine, which the first engine tests use, then,
once those answer (or as soon as a test asks for one of them), the spare and priority engines. The
disaggregated-prefill pair (two engines sharing a KV folder through vLLM's ExampleConnector) starts
only when a test asks for it, once the second wave is up, and runs until the session ends.
Starting all five at once on two cores made every one of them slow: on a loaded CI machine a chat
engine was still starting after 420 s. Each fixture waits only for the engines it returns. Every
engine is stopped at the end of the session; a failed test that used engines gets their log tails
attached to its report.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from vllm_stack_dev.paths import cache_dir, engine_python
from vllm_stack_dev.testbed.engines import (
    Engine,
    EngineGroup,
    EngineSpec,
    EngineStartError,
    default_cpus,
    launch,
    wait_ready,
)
from vllm_stack_dev.testbed.models import build_lora, build_model

CHAT_MODEL = "tiny-llama"
EMBED_MODEL = "tiny-embed"
READY_TIMEOUT = float(os.environ.get("VLLM_STACK_ENGINE_READY_TIMEOUT", "420"))


def pytest_configure(config: pytest.Config) -> None:
    """Every engine this session starts, in-process or through `vllm-stack up`, gets a 256 MiB KV cache
    (see default_kv_cache_mib): seven and more engines live at once here, on 24 GiB without swap."""
    os.environ.setdefault("VLLM_STACK_ENGINE_KV_CACHE_MIB", "256")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return build_model("tiny", cache_dir() / "models" / "tiny")


@pytest.fixture(scope="session")
def lora_adapter_dir(tiny_model_dir: Path) -> Path:
    return build_lora(tiny_model_dir, cache_dir() / "models" / "tiny-lora")


class SessionEngines:
    """Launches the session's engines in two waves on first use; hands each fixture its own."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.chat: EngineGroup | None = None
        self.embed: EngineGroup | None = None
        self.spare: Engine | None = None  # the one tests may kill, stop or restart
        self.priority: Engine | None = None  # two sequences at once, scheduled by priority
        self._spare_spec: EngineSpec | None = None
        self.used: list[Engine] = []
        self._cpus = default_cpus(2)  # one core each, round-robin over the cores this process may use
        self._hurry = threading.Event()  # a test wants a second-wave engine now
        self._closing = threading.Event()
        self._second_wave_started = threading.Event()
        self._second_wave: threading.Thread | None = None

    def _launch_all(self) -> None:
        if self.chat is not None:
            return
        if not engine_python().exists():
            pytest.fail(f"engine environment missing ({engine_python()}); run `make install` first")
        # KV events with replay, and the dev endpoints (POST /reset_prefix_cache) for the prefix tests.
        chat = EngineSpec(self.model_dir, CHAT_MODEL, kv_replay=True, env={"VLLM_SERVER_DEV_MODE": "1"})
        embed = EngineSpec(self.model_dir, EMBED_MODEL, runner="pooling", convert="embed", enable_lora=False)
        self.chat = EngineGroup(
            launch(chat, name=f"chat-{i}", cpu=self._cpus[i], log_dir=self.log_dir) for i in range(2)
        )
        self.embed = EngineGroup([launch(embed, name="embed-0", cpu=self._cpus[0], log_dir=self.log_dir)])
        self._second_wave = threading.Thread(target=self._launch_second_wave, name="second-wave", daemon=True)
        self._second_wave.start()

    def _launch_second_wave(self) -> None:
        """Wait for the first wave (or a test that wants the rest now), start the rest, then stay until
        the session closes: an engine dies with the thread that started it (PR_SET_PDEATHSIG)."""
        assert self.chat is not None and self.embed is not None
        first = [*self.chat, *self.embed]
        deadline = time.monotonic() + READY_TIMEOUT
        while not (self._hurry.is_set() or self._closing.is_set() or time.monotonic() > deadline):
            if all(engine.is_ready() or not engine.is_running() for engine in first):
                break
            self._hurry.wait(1.0)
        if self._closing.is_set():
            self._second_wave_started.set()
            return
        # It also parses tool calls.
        self._spare_spec = EngineSpec(
            self.model_dir,
            CHAT_MODEL,
            kv_events=False,
            extra_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
        )
        self.spare = launch(self._spare_spec, name="spare", cpu=self._cpus[1], log_dir=self.log_dir)
        # Saturates at once (two sequences run, the rest wait) and orders its queue by vLLM priority.
        priority = EngineSpec(
            self.model_dir,
            CHAT_MODEL,
            kv_events=False,
            enable_lora=False,
            max_model_len=4096,  # room for the long requests that hold its two sequences in a test
            extra_args=["--max-num-seqs", "2", "--scheduling-policy", "priority"],
        )
        self.priority = launch(priority, name="priority", cpu=self._cpus[0], log_dir=self.log_dir)
        self._second_wave_started.set()
        self._closing.wait()

    def _second_wave_engine(self, pick: Callable[[], Engine | None]) -> Engine:
        self._launch_all()
        self._hurry.set()
        self._second_wave_started.wait()
        engine = pick()
        if engine is None:
            raise EngineStartError("the second wave of session engines was not started (session closing)")
        return engine

    def chat_engines(self) -> EngineGroup:
        self._launch_all()
        assert self.chat is not None
        self.used.extend(self.chat)
        wait_ready(self.chat.engines, READY_TIMEOUT)
        return self.chat

    def embedding_engine(self) -> Engine:
        self._launch_all()
        assert self.embed is not None
        self.used.extend(self.embed)
        wait_ready(self.embed.engines, READY_TIMEOUT)
        return self.embed[0]

    def priority_engine(self) -> Engine:
        """The engine with ``--max-num-seqs 2 --scheduling-policy priority``, ready."""
        engine = self._second_wave_engine(lambda: self.priority)
        self.used.append(engine)
        wait_ready([engine], READY_TIMEOUT)
        return engine

    def spare_engine(self) -> Engine:
        """The spare engine, ready (unless a test killed it; see :meth:`restart_spare`)."""
        engine = self._second_wave_engine(lambda: self.spare)
        self.used.append(engine)
        if engine.is_running():
            wait_ready([engine], READY_TIMEOUT)
        return engine

    def restart_spare(self) -> Engine:
        """Start the spare again at its port (its process must be gone); does not wait for it."""
        assert self.spare is not None and self._spare_spec is not None and not self.spare.is_running()
        port = self.spare.port
        self.spare = launch(
            self._spare_spec, name="spare-restarted", cpu=self.spare.cpu, log_dir=self.log_dir, port=port
        )
        self.used.append(self.spare)
        return self.spare

    def stop(self) -> None:
        for group in (self.chat, self.embed):
            if group is not None:
                group.stop()
        for engine in (self.spare, self.priority):
            if engine is not None:
                engine.stop()
        # Only now may the second wave's thread end (its engines would die with it).
        self._closing.set()
        if self._second_wave is not None:
            self._second_wave.join()


def pd_engine_spec(model_dir: Path, role: str, folder: Path) -> EngineSpec:
    """A chat engine with ExampleConnector in ``role`` (kv_producer or kv_consumer) on ``folder``: what
    ``vllm-stack engines -- --kv-transfer-config ...`` starts (tutorials/05-disaggregated-prefill.md)."""
    config = {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(folder)},
    }
    return EngineSpec(model_dir, CHAT_MODEL, extra_args=["--kv-transfer-config", json.dumps(config)])


@pytest.fixture(scope="session")
def pd_engines(
    session_engines: SessionEngines,
    tiny_model_dir: Path,
    engine_logs_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineGroup]:
    """A prefill engine (kv_producer) and a decode engine (kv_consumer) sharing one KV folder; started
    once the session's second wave is up (seven engines starting at once on two cores time out)."""
    session_engines.priority_engine()  # the second wave is ready, so the first one too
    folder = tmp_path_factory.mktemp("kv-shared")
    cpus = default_cpus(2)
    group = EngineGroup(
        [
            launch(
                pd_engine_spec(tiny_model_dir, "kv_producer", folder),
                name="pd-prefill",
                cpu=cpus[0],
                log_dir=engine_logs_dir,
            ),
            launch(
                pd_engine_spec(tiny_model_dir, "kv_consumer", folder),
                name="pd-decode",
                cpu=cpus[1],
                log_dir=engine_logs_dir,
            ),
        ]
    )
    try:
        wait_ready(group.engines, READY_TIMEOUT)
        yield group
    finally:
        group.stop()


@pytest.fixture(scope="session")
def engine_logs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="session")
def session_engines(tiny_model_dir: Path, engine_logs_dir: Path) -> Iterator[SessionEngines]:
    pool = SessionEngines(tiny_model_dir, engine_logs_dir)
    yield pool
    pool.stop()


@pytest.fixture(scope="session")
def engines(session_engines: SessionEngines) -> EngineGroup:
    """Two real vLLM engines serving `tiny-llama` (prefix caching, LoRA runtime loading, KV events)."""
    return session_engines.chat_engines()


@pytest.fixture(scope="session")
def priority_engine(session_engines: SessionEngines) -> Engine:
    """One real vLLM engine serving `tiny-llama` with two sequences at once and priority scheduling."""
    return session_engines.priority_engine()


@pytest.fixture(scope="session")
def embedding_engine(session_engines: SessionEngines) -> Engine:
    """One real vLLM engine with the pooling runner, serving `tiny-embed` on /v1/embeddings."""
    return session_engines.embedding_engine()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    """Attach the engines' log tails to the report of a failed test that used engines."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    # funcargs holds every fixture resolved for the test, including ones requested indirectly: the
    # session's engines and any a module started for itself (e.g. the NIXL pair).
    engines: dict[str, Engine] = {}
    for value in getattr(item, "funcargs", {}).values():
        if isinstance(value, SessionEngines):
            engines.update((engine.name, engine) for engine in value.used)
        elif isinstance(value, EngineGroup):
            engines.update((engine.name, engine) for engine in value)
        elif isinstance(value, Engine):
            engines[value.name] = value
    for engine in engines.values():
        report.sections.append((f"engine {engine.name} log tail", engine.log_tail(80)))


# Markers whose tests run only when `-m` names them.
OPT_IN_MARKERS = ("stacks", "image_builds", "node_full", "cluster_full")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`stacks` tests (every example stack brought up, `make test-stacks`) run only when asked for
    with ``-m stacks``: they take a quarter of an hour, on top of `make test`'s own stacks. The same for
    `image_builds` (`make test-images`): they build images (the CPU engine image, ~7 GB; a router rebuild)."""
    # `node_full` (`make test-node`): the node tier's whole matrix; `make test` runs its `node` tests.
    # `cluster_full` (`make test-cluster`): the cluster tier's whole Helm matrix; `make test` runs a half.
    markexpr = config.getoption("markexpr") or ""
    skipped = [marker for marker in OPT_IN_MARKERS if marker not in markexpr]
    kept = [item for item in items if not any(item.get_closest_marker(m) for m in skipped)]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
