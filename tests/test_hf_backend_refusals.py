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

from batchgen import Engine
from batchgen.worker.models import UnsupportedModelError
from tests.releases import needs_backend

pytestmark = needs_backend

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


def test_a_state_space_hybrid_is_refused_with_what_it_would_take(tmp_path):
    from transformers import JambaConfig

    path = _config_only(tmp_path, JambaConfig(**TINY), "JambaForCausalLM")
    message = _refusal(path)
    assert message.startswith("JambaForCausalLM cannot run: its layers 0, 1, 2, 3 are ")
    assert "'linear_attention'" in message and "recurrent state per sequence" in message
    assert "recomputed after preemption and hand-back" in message


def test_parallel_hybrid_layers_are_refused(tmp_path):
    from transformers import FalconH1Config

    path = _config_only(tmp_path, FalconH1Config(**TINY), "FalconH1ForCausalLM")
    assert "FalconH1ForCausalLM cannot run: its layers 0, 1, 2, 3 are 'hybrid'" in _refusal(path)


def test_encoder_decoder_is_refused(tmp_path):
    from transformers import T5Config

    path = _config_only(tmp_path, T5Config(d_model=64, num_layers=2), "T5ForConditionalGeneration")
    assert _refusal(path) == (
        "T5ForConditionalGeneration is an encoder-decoder model; batchgen runs decoder-only "
        "causal LMs"
    )


@pytest.mark.parametrize(
    "config,message",
    [
        ({"add_cross_attention": True}, "GPT2LMHeadModel has cross-attention layers"),
        ({"use_bidirectional_attention": True}, "GPT2LMHeadModel attends bidirectionally"),
        ({"quantization_config": {"quant_method": "fp8"}},
         "GPT2LMHeadModel is a quantized checkpoint"),
    ],
)  # fmt: skip
def test_switches_outside_the_modules_are_refused(tmp_path, config, message):
    from transformers import GPT2Config

    path = _config_only(tmp_path, GPT2Config(n_embd=64, n_layer=2, n_head=4, **config),
                        "GPT2LMHeadModel")  # fmt: skip
    assert _refusal(path, model_impl="transformers").startswith(message)


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
    assert _refusal(zoo_model("xglm-refused")) == (
        "XGLMModel's layers never call transformers' attention registry (its attention is "
        "written into the model, or it has no attention); batchgen cannot page its KV"
    )


def test_alibi_is_refused(zoo_model):
    assert _refusal(zoo_model("falcon-alibi")) == (
        "FalconForCausalLM adds ALiBi position biases to its attention scores (alibi); "
        "batchgen's paged kernels do not compute them"
    )


def test_state_space_model_is_refused(zoo_model):
    message = _refusal(zoo_model("mamba-refused"))
    assert message.startswith("MambaForCausalLM cannot run: its layers 0, 1 are 'linear_attention'")


def test_a_window_transformers_own_module_ignores_is_refused(zoo_model):
    message = _refusal(zoo_model("llama-sliding-refused"), model_impl="transformers")
    assert message == (
        "layer 0 (LlamaAttention) has sliding_window=16 in its config, which transformers' own "
        "LlamaAttention does not apply"
    )


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


class _Attention(torch.nn.Module):
    """A layer that attends through the registry with the arguments it is given."""

    def __init__(
        self, calls: bool = True, mask: bool = False, v_dim: int = 4, **kwargs: Any
    ) -> None:
        super().__init__()
        self.calls, self.mask, self.kwargs, self.is_causal = calls, mask, kwargs, True
        self.v_dim = v_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.calls:  # a layer that keeps to itself (a recurrent mixer, say)
            return x
        from batchgen.worker.models.hf_backend.registered_attention import (
            paged_attention_forward,
        )

        q = x.view(1, x.shape[1], 2, 4).transpose(1, 2)
        v = x.view(1, x.shape[1], -1, self.v_dim).transpose(1, 2)
        mask = torch.zeros(1, 1, x.shape[1], x.shape[1]) if self.mask else None
        out, _ = paged_attention_forward(self, q, q, v, mask, scaling=0.5, **self.kwargs)
        return out.reshape(1, x.shape[1], 8)


class _Base(torch.nn.Module):
    def __init__(self, *layers: _Attention) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        x = torch.ones(1, input_ids.shape[1], 8)
        for layer in self.layers:
            x = x + layer(x)
        return x


@pytest.mark.parametrize(
    "layers,message",
    [
        ((_Attention(), _Attention(calls=False)),
         "1 attention calls through transformers' registry for 2 layers in _Base"),
        ((_Attention(alibi_slopes=torch.ones(2)),),
         "layer 0 (_Attention) passes alibi_slopes to its attention, which batchgen's paged "
         "attention does not honour"),
        ((_Attention(mask=True),), "_Attention receives an attention mask its model built itself"),
        ((_Attention(s_aux=torch.zeros(2)),),
         "layer 0 (_Attention) passes s_aux to its attention, which batchgen's paged attention "
         "does not honour"),
        ((_Attention(v_dim=2),), "_Base's values (4 heads of 2) are not shaped like its keys"),
        ((_Attention(sliding_window=8),),
         "layer 0 (_Attention) passes sliding_window=8 but its config gives it None"),
    ],
)  # fmt: skip
def test_the_probe_refuses_what_the_paged_kernels_would_not_honour(layers, message):
    from batchgen.worker.models.hf_backend.probe import probe_layout

    with pytest.raises(UnsupportedModelError) as err:
        probe_layout(_Base(*layers), len(layers), [None] * len(layers), torch.device("cpu"))
    assert str(err.value).startswith(message)


def test_the_probe_plans_each_layer_by_its_arguments():
    from batchgen.kernels.batch import AttentionKind
    from batchgen.worker.models.hf_backend.probe import probe_layout

    first, second = _Attention(softcap=30.0), _Attention(sliding_window=16)
    layout = probe_layout(_Base(first, second), 2, [None, 16], torch.device("cpu"))
    assert (layout.num_kv_heads, layout.head_dim, layout.hidden_size) == (2, 4, 8)
    assert layout.layers[first].index == 0 and layout.layers[second].index == 1
    assert layout.layers[first].kind == AttentionKind(scale=0.5, softcap=30.0)
    assert layout.layers[second].kind == AttentionKind(scale=0.5, window=16)


def test_a_deltanet_mixer_that_takes_no_cache_argument_is_refused(zoo_model):
    """transformers before 5.24 called the mixer's cache argument ``cache_params``; handed
    ``cache``, such a forward swallowed it in **kwargs and every chunk started from a zero
    state (logits off by 14, no error). A forward without ``cache`` is refused instead."""
    from transformers import AutoModelForCausalLM

    from batchgen.worker.models.hf_backend.recurrent import keep_state_per_sequence

    model = AutoModelForCausalLM.from_pretrained(zoo_model("qwen3_next"), dtype=torch.float32)
    mixers = [m for m in model.modules() if type(m).__name__ == "Qwen3NextGatedDeltaNet"]
    cls = type(mixers[0])
    real = cls.forward

    def before_5_24(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        return real(self, hidden_states, cache=cache_params, attention_mask=attention_mask)

    # the real mixer under its own class name, with the signature 5.23 gave it
    mixers[1].__class__ = type(cls.__name__, (cls,), {"forward": before_5_24})
    with pytest.raises(UnsupportedModelError, match=r"Qwen3NextGatedDeltaNet.forward in "
                       r"transformers .* takes no cache argument.*cache_params"):  # fmt: skip
        keep_state_per_sequence(model.base_model)
