"""Every MoE architecture batchgen claims runs exactly as transformers does (``family_parity``):
Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, DeepSeek V2 and V3."""

from __future__ import annotations

import json
import re

import pytest
from safetensors.torch import load_file, save_file

from batchgen import Engine
from batchgen.worker.models import UnsupportedModelError
from tests.family_parity import assert_matches_hf
from tests.model_zoo import MOE, VOCAB
from tests.test_model_accounting import _copy, _edit_config


@pytest.mark.parametrize("name", MOE)
def test_moe_family_matches_hf(zoo_model, name):
    assert_matches_hf(zoo_model(name), VOCAB)


def test_an_expert_beyond_num_experts_is_refused_by_name(zoo_model, tmp_path):
    path = _copy(zoo_model, tmp_path, "qwen3_moe")
    tensors = load_file(path / "model.safetensors")
    extra = "model.layers.1.mlp.experts.8.down_proj.weight"  # the config says 8 experts: 0..7
    tensors[extra] = tensors["model.layers.1.mlp.experts.7.down_proj.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=re.escape(extra)):
        Engine.from_pretrained(path, num_kv_blocks=8)


@pytest.mark.parametrize(
    "name,switch,value",
    [
        ("deepseek_v3", "topk_method", "greedy"),  # transformers' V3 routes noaux_tc only
        ("deepseek_v3", "scoring_func", "softmax"),
        ("deepseek_v2", "mlp_bias", True),
        ("deepseek_v2", "moe_layer_freq", 2),
    ],
)
def test_a_routing_switch_transformers_does_not_compute_is_refused(
    zoo_model, tmp_path, name, switch, value
):
    path = _copy(zoo_model, tmp_path, name)
    _edit_config(path, **{switch: value})
    with pytest.raises(UnsupportedModelError, match=rf"config switch {switch}=.* is not supported"):
        Engine.from_pretrained(path, num_kv_blocks=8)


@pytest.mark.parametrize(
    "name,keys",
    [  # what the real checkpoints' config.json carry beyond transformers' config fields
        ("deepseek_v3", dict(topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1,
                             aux_loss_alpha=0.001, seq_aux=True, ep_size=1)),
        ("qwen3_moe", dict(max_window_layers=48, use_sliding_window=False)),
    ],
)  # fmt: skip
def test_real_checkpoints_bookkeeping_keys_load(zoo_model, tmp_path, name, keys):
    path = _copy(zoo_model, tmp_path, name)
    _edit_config(path, **keys)
    Engine.from_pretrained(path, num_kv_blocks=8)


def test_gpt_oss_with_fewer_stacked_experts_than_its_config_is_refused(zoo_model, tmp_path):
    path = _copy(zoo_model, tmp_path, "gpt_oss")
    _edit_config(path, num_local_experts=3, num_experts_per_tok=2)
    with pytest.raises(UnsupportedModelError, match=r"gate_up_proj.*4 experts, config says 3"):
        Engine.from_pretrained(path, num_kv_blocks=8)


def test_the_toy_qwen3_moe_matches_hf(toy_model):
    """``batchgen toy-model --arch qwen3_moe`` (the benchmark's MoE): 16 experts, 4 per token."""
    path = toy_model("qwen3_moe")
    config = json.loads((path / "config.json").read_text())
    experts = config.get("num_local_experts", config.get("num_experts"))
    assert (experts, config["num_experts_per_tok"]) == (16, 4)
    assert_matches_hf(path, 8192)
