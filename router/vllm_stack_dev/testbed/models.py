"""Build small Llama-architecture model directories and LoRA adapters locally.

No weights can be downloaded on the machines this project is developed and tested on, so the test bed
serves models whose *architecture* is real (vLLM runs the full Llama compute path) while the weights are
random (`--load-format dummy`). The directory holds a config, a byte-level BPE tokenizer trained here on
built-in text, and a chat template. Output is deterministic: the same size always yields the same files,
so caches keyed on the directory (and prefix-cache behaviour in tests) are reproducible.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start|>",
    "<|end|>",
    "<tool_call>",
    "</tool_call>",
]
BOS, EOS = SPECIAL_TOKENS[0], SPECIAL_TOKENS[1]

# A small Llama-3-style template; `<tool_call>` tokens exist so vLLM's hermes tool parser can load.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class ModelSize:
    """Shape of a generated model; values from FACTS.md (measured to run well on 2 CPU cores)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    vocab_size: int = 2048

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(128, 2, 4, 2, 256, max_position_embeddings=4096),
    "mid": ModelSize(512, 4, 8, 4, 1408, max_position_embeddings=8192),
}


def _corpus() -> list[str]:
    text = resources.files("vllm_stack_dev.testbed").joinpath("corpus.txt").read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line.strip()]
    # Repeat with small variations so BPE learns merges for common words and numbers.
    return lines * 8 + [f"{a} {b} {a + b}" for a in range(64) for b in range(0, 64, 7)]


def _quiet_transformers() -> None:
    """transformers warns at import that PyTorch is absent; the builders never need it."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    _quiet_transformers()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=SPECIAL_TOKENS[2:],
        model_max_length=1_000_000,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def _write_config(out: Path, size: ModelSize, bos_id: int, eos_id: int) -> None:
    _quiet_transformers()
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=size.vocab_size,
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_hidden_layers,
        num_attention_heads=size.num_attention_heads,
        num_key_value_heads=size.num_key_value_heads,
        head_dim=size.head_dim,
        max_position_embeddings=size.max_position_embeddings,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(str(out))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": False}, indent=2) + "\n"
    )


def build_model(size: str, out: Path | str, *, force: bool = False) -> Path:
    """Write a model directory for `size` ("tiny" or "mid") to `out`; reuse it when already complete.

    A marker file is written last, so an interrupted build is redone instead of served half-written.
    """
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {sorted(SIZES)}")
    out = Path(out)
    marker = out / ".vllm-stack-model"
    if marker.exists() and marker.read_text() == size and not force:
        return out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    spec = SIZES[size]
    _write_tokenizer(out, spec.vocab_size)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    _write_config(out, spec, bos_id=vocab.get(BOS, 0), eos_id=vocab.get(EOS, 1))
    marker.write_text(size)
    return out


def build_lora(
    base: Path | str, out: Path | str, *, rank: int = 8, seed: int = 0, force: bool = False
) -> Path:
    """Write a PEFT LoRA adapter (r=`rank` on q_proj and v_proj) for the model at `base`.

    The weights are seeded random values, non-zero in both A and B, so the adapter really changes the
    model's output (a zero B would make routing bugs invisible in tests).
    """
    import numpy as np
    from safetensors.numpy import save_file

    base, out = Path(base), Path(out)
    marker = out / ".vllm-stack-lora"
    if marker.exists() and not force:
        return out
    config = json.loads((base / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    out_dims = {
        "q_proj": config["num_attention_heads"] * head_dim,
        "v_proj": config["num_key_value_heads"] * head_dim,
    }
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(config["num_hidden_layers"]):
        for module, out_dim in out_dims.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.02, (rank, hidden)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.02, (out_dim, rank)).astype(np.float32)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "base_model_name_or_path": str(base),
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": sorted(out_dims),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    marker.write_text("lora")
    return out
