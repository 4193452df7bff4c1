"""The test bed's engine command lines: the KV cache size is asked for in bytes, and nothing overrides it."""

from __future__ import annotations

import pytest
from vllm_stack_dev.testbed.engines import EngineSpec, default_kv_cache_mib, engine_env, server_args


def test_the_kv_cache_size_goes_on_the_command_line_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_STACK_ENGINE_KV_CACHE_MIB", "256")
    spec = EngineSpec("/models/tiny")
    assert spec.kv_cache_mib == 256
    args = server_args(spec, 8000, None)
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(256 * 1024 * 1024)


def test_the_default_is_one_gib_outside_the_test_session(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_STACK_ENGINE_KV_CACHE_MIB", raising=False)
    assert default_kv_cache_mib() == 1024
    assert EngineSpec("/models/tiny", kv_cache_mib=512).kv_cache_mib == 512


def test_a_callers_vllm_cpu_kvcache_space_does_not_override_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU platform lets VLLM_CPU_KVCACHE_SPACE (whole GiB) win over --kv-cache-memory-bytes."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    assert "VLLM_CPU_KVCACHE_SPACE" not in engine_env(EngineSpec("/models/tiny"), cpu=0)
    own = EngineSpec("/models/tiny", env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    assert engine_env(own, cpu=0)["VLLM_CPU_KVCACHE_SPACE"] == "2"  # a rendered chart's own setting stays


def test_rendered_arguments_keep_their_own_kv_cache_size() -> None:
    rendered = EngineSpec("/models/tiny", args=["--model", "/m", "--kv-cache-memory-bytes", "1000"])
    assert server_args(rendered, 8000, None).count("--kv-cache-memory-bytes") == 1
    plain = EngineSpec("/models/tiny", args=["--model", "/m"], kv_cache_mib=128)
    args = server_args(plain, 8000, None)
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(128 * 1024 * 1024)
