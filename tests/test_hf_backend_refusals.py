"""What the transformers backend refuses, by the architecture's name and the reason.

Config-level refusals need no weights (config.json alone: they come before
the tokenizer and the weights load); the rest are tiny checkpoints whose
weights or modules show what the backend cannot run exactly.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen.worker import Engine
from batchgen.worker.models import UnsupportedModelError

TINY: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, vocab_size=512
)


def _config_only(tmp_path: Path, config, arch: str) -> Path:
    config.architectures = [arch]
    config.save_pretrained(tmp_path)
    return tmp_path


def _refusal(path: Path, **settings) -> str:
    with pytest.raises(UnsupportedModelError) as err:
        Engine.from_pretrained(path, num_kv_blocks=16, **settings)
    return str(err.value)


def test_qwen3_next_gated_deltanet_is_refused_with_what_it_would_take(tmp_path):
    from transformers import Qwen3NextConfig

    path = _config_only(tmp_path, Qwen3NextConfig(**TINY, num_key_value_heads=2),
                        "Qwen3NextForCausalLM")  # fmt: skip
    message = _refusal(path)
    assert message.startswith("Qwen3NextForCausalLM cannot run: its layers 0, 1, 2 are ")
    assert "'linear_attention'" in message and "recurrent state per sequence" in message
    assert "preemption and hand-back save or recompute" in message


def test_qwen3_5_hybrid_is_refused(tmp_path):
    from transformers import Qwen3_5TextConfig

    path = _config_only(tmp_path, Qwen3_5TextConfig(**TINY, num_key_value_heads=2),
                        "Qwen3_5ForCausalLM")  # fmt: skip
    assert "Qwen3_5ForCausalLM cannot run" in (message := _refusal(path))
    assert "'linear_attention'" in message


def test_encoder_decoder_is_refused(tmp_path):
    from transformers import T5Config

    path = _config_only(tmp_path, T5Config(d_model=64, num_layers=2), "T5ForConditionalGeneration")
    assert _refusal(path) == (
        "T5ForConditionalGeneration is an encoder-decoder model; batchgen runs decoder-only "
        "causal LMs"
    )


def test_remote_code_is_refused(tmp_path):
    from transformers import GPTNeoXConfig

    config = GPTNeoXConfig(**TINY)
    config.auto_map = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    path = _config_only(tmp_path, config, "GPTNeoXForCausalLM")
    message = _refusal(path, model_impl="transformers")
    assert "GPTNeoXForCausalLM needs its own code from the checkpoint" in message


def test_longrope_context_ends_where_its_short_factors_do(zoo_model):
    """Past original_max_position_embeddings transformers picks the long factors per batch
    (from its longest sequence): within it the short ones are exact, so that is the context."""
    path = zoo_model("phi3-longrope")
    engine = Engine.from_pretrained(path, num_kv_blocks=8, model_impl="transformers")
    assert engine.max_model_len == 256
    assert _refusal(path, model_impl="transformers", max_model_len=512) == (
        "max_model_len 512 exceeds what the model supports (256)"
    )


def test_attention_outside_the_registry_is_refused(zoo_model):
    assert _refusal(zoo_model("falcon-refused"), model_impl="transformers") == (
        "transformers cannot build FalconForCausalLM with batchgen's attention (its attention "
        "does not go through transformers' attention registry)"
    )


def test_state_space_model_is_refused(zoo_model):
    message = _refusal(zoo_model("mamba-refused"))
    assert message.startswith("MambaForCausalLM cannot run: its layers 0, 1 are 'linear_attention'")


def _rewrite_weights(src: Path, dst: Path, change) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    change(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_a_tensor_the_model_never_reads_is_refused(zoo_model, tmp_path):
    def add(tensors):
        tensors["transformer.h.0.attn.extra.weight"] = torch.ones(4)

    path = _rewrite_weights(zoo_model("gptj"), tmp_path / "m", add)
    message = _refusal(path)
    assert message.endswith(
        "holds tensors GPTJForCausalLM never reads: 'transformer.h.0.attn.extra.weight'"
    )


def test_a_missing_tensor_is_refused(zoo_model, tmp_path):
    def drop(tensors):
        del tensors["transformer.h.1.mlp.fc_out.bias"]

    path = _rewrite_weights(zoo_model("gptj"), tmp_path / "m", drop)
    assert _refusal(path).endswith("lacks 'transformer.h.1.mlp.fc_out.bias'")


def test_native_asked_for_an_architecture_batchgen_has_no_code_for(zoo_model):
    message = _refusal(zoo_model("gptj"), model_impl="native")
    assert message.startswith("architecture GPTJForCausalLM in ")
    assert "is not supported" in message
