"""Shared fixtures: locally built models and real vLLM engines (CPU build), started once per session.

Engines are expensive (about a minute to start on two cores), so the first test that needs any engine
launches all of the session's engines at once (two chat engines and one embedding engine) and each
fixture then waits only for the ones it returns. Every engine is stopped at the end of the session; a
failed test that used engines gets their log tails attached to its report.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_stack_dev.paths import cache_dir, engine_python
from vllm_stack_dev.testbed.engines import Engine, EngineGroup, EngineSpec, default_cpus, launch, wait_ready
from vllm_stack_dev.testbed.models import build_lora, build_model

CHAT_MODEL = "tiny-llama"
EMBED_MODEL = "tiny-embed"
READY_TIMEOUT = float(os.environ.get("VLLM_STACK_ENGINE_READY_TIMEOUT", "420"))


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return build_model("tiny", cache_dir() / "models" / "tiny")


@pytest.fixture(scope="session")
def lora_adapter_dir(tiny_model_dir: Path) -> Path:
    return build_lora(tiny_model_dir, cache_dir() / "models" / "tiny-lora")


class SessionEngines:
    """Launches the session's engines together on first use; hands each fixture its own."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.chat: EngineGroup | None = None
        self.embed: EngineGroup | None = None
        self.spare: Engine | None = None  # the one tests may kill, stop or restart
        self.priority: Engine | None = None  # two sequences at once, scheduled by priority
        self._spare_spec: EngineSpec | None = None
        self.used: list[Engine] = []

    def _launch_all(self) -> None:
        if self.chat is not None:
            return
        if not engine_python().exists():
            pytest.fail(f"engine environment missing ({engine_python()}); run `make install` first")
        # KV events with replay, and the dev endpoints (POST /reset_prefix_cache) for the prefix tests.
        chat = EngineSpec(self.model_dir, CHAT_MODEL, kv_replay=True, env={"VLLM_SERVER_DEV_MODE": "1"})
        embed = EngineSpec(self.model_dir, EMBED_MODEL, runner="pooling", convert="embed", enable_lora=False)
        cpus = default_cpus(4)  # one core each, round-robin over the cores this process may use
        self.chat = EngineGroup(
            launch(chat, name=f"chat-{i}", cpu=cpus[i], log_dir=self.log_dir) for i in range(2)
        )
        self.embed = EngineGroup([launch(embed, name="embed-0", cpu=cpus[2], log_dir=self.log_dir)])
        # Started with the others so its start-up overlaps theirs; it also parses tool calls.
        self._spare_spec = EngineSpec(
            self.model_dir,
            CHAT_MODEL,
            kv_events=False,
            extra_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
        )
        self.spare = launch(self._spare_spec, name="spare", cpu=cpus[1], log_dir=self.log_dir)
        # Saturates at once (two sequences run, the rest wait) and orders its queue by vLLM priority.
        priority = EngineSpec(
            self.model_dir,
            CHAT_MODEL,
            kv_events=False,
            enable_lora=False,
            max_model_len=512,
            extra_args=["--max-num-seqs", "2", "--scheduling-policy", "priority"],
        )
        self.priority = launch(priority, name="priority", cpu=cpus[3], log_dir=self.log_dir)

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
        self._launch_all()
        assert self.priority is not None
        self.used.append(self.priority)
        wait_ready([self.priority], READY_TIMEOUT)
        return self.priority

    def spare_engine(self) -> Engine:
        """The spare engine, ready (unless a test killed it; see :meth:`restart_spare`)."""
        self._launch_all()
        assert self.spare is not None
        self.used.append(self.spare)
        if self.spare.is_running():
            wait_ready([self.spare], READY_TIMEOUT)
        return self.spare

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
    # funcargs holds every fixture resolved for the test, including ones requested indirectly.
    pool = getattr(item, "funcargs", {}).get("session_engines")
    if isinstance(pool, SessionEngines):
        for engine in pool.used:
            report.sections.append((f"engine {engine.name} log tail", engine.log_tail(80)))
