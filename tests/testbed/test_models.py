"""The model and LoRA builders: deterministic, complete, loadable by the tokenizer the engine uses."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from vllm_stack_dev.testbed.models import SIZES, build_lora, build_model

from vllm_stack.cli import main


def _digest(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def test_build_is_deterministic(tmp_path: Path) -> None:
    first = build_model("tiny", tmp_path / "a")
    second = build_model("tiny", tmp_path / "b")
    assert _digest(first) == _digest(second)


@pytest.mark.parametrize("size", sorted(SIZES))
def test_model_shape_matches_size(tmp_path: Path, size: str) -> None:
    out = build_model(size, tmp_path / size)
    config = json.loads((out / "config.json").read_text())
    spec = SIZES[size]
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] == spec.hidden_size
    assert config["num_hidden_layers"] == spec.num_hidden_layers
    assert config["num_key_value_heads"] == spec.num_key_value_heads
    assert config["vocab_size"] == 2048


def test_tokenizer_has_chat_template_and_tool_tokens(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(build_model("tiny", tmp_path / "tiny")))
    assert len(tokenizer) <= 2048
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|begin_of_text|><|start|>user\nHello there<|end|>")
    assert prompt.endswith("<|start|>assistant\n")
    assert "<tool_call>" in tokenizer.get_vocab()
    text = "The router routes requests: 12 + 30 = 42."
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_rebuild_reuses_complete_directory(tmp_path: Path) -> None:
    out = build_model("tiny", tmp_path / "tiny")
    stamp = (out / "config.json").stat().st_mtime_ns
    build_model("tiny", out)
    assert (out / "config.json").stat().st_mtime_ns == stamp


def test_lora_adapter_is_peft_format(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    base = build_model("tiny", tmp_path / "tiny")
    adapter = build_lora(base, tmp_path / "lora")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    assert a.shape == (8, 128) and b.shape == (64, 8)
    assert abs(b).sum() > 0, "a zero B matrix would make the adapter a no-op"


def test_cli_builds_model_and_lora(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "build", "--size", "tiny", "--out", str(tmp_path / "m")]) == 0
    assert main(["model", "lora", "--base", str(tmp_path / "m"), "--out", str(tmp_path / "l")]) == 0
    assert (tmp_path / "l" / "adapter_model.safetensors").exists()
    assert str(tmp_path / "m") in capsys.readouterr().out
