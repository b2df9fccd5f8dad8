"""GPT-NeoX (Pythia) and StableLM: LayerNorms, partial rotary, attention and MLP in parallel
or in sequence as use_parallel_residual says. GPT-NeoX stores q/k/v as one matrix laid out
head by head and has a plain MLP; StableLM is Llama-shaped with optional per-head q/k norms."""

from __future__ import annotations

from batchgen.worker.models.config_keys import ConfigReader
from batchgen.worker.models.dense_weights import CheckpointLayout, weights_for
from batchgen.worker.models.families.decoder_config import Shape, decoder_config, parallel_block
from batchgen.worker.models.family import Family
from batchgen.worker.models.model_config import BlockSpec, ModelConfig, NormKind, QKNormScope


def _read_gpt_neox(r: ConfigReader, architecture: str) -> ModelConfig:
    parallel = bool(r.get("use_parallel_residual", True))
    shape = Shape(
        mlp_bias=True, gated_mlp=False, norm=NormKind.LAYER, norm_bias=True,
        norm_eps_key="layer_norm_eps",
        block=parallel_block(shared_norm=False) if parallel else BlockSpec(),
    )  # fmt: skip
    return decoder_config(r, architecture, shape)


def _read_stablelm(r: ConfigReader, architecture: str) -> ModelConfig:
    parallel = bool(r.get("use_parallel_residual", False))
    shape = Shape(
        qkv_bias=bool(r.get("use_qkv_bias", False)), o_bias=False, mlp_bias=False,
        norm=NormKind.LAYER, norm_bias=True, norm_eps_key="layer_norm_eps",
        qk_norm=QKNormScope.HEAD if r.get("qk_layernorm", False) else None,
        block=parallel_block(shared_norm=True) if parallel else BlockSpec(),
    )  # fmt: skip
    return decoder_config(r, architecture, shape)


GPT_NEOX = Family(
    "gpt_neox",
    ("GPTNeoXForCausalLM",),
    _read_gpt_neox,
    weights_for(
        CheckpointLayout(
            prefix="gpt_neox.", embed="embed_in", final_norm="final_layer_norm",
            lm_head="embed_out", qkv="attention.query_key_value", qkv_per_head=True,
            o="attention.dense", up="mlp.dense_h_to_4h", down="mlp.dense_4h_to_h",
        )
    ),
)  # fmt: skip
STABLELM = Family(
    "stablelm",
    ("StableLmForCausalLM",),
    _read_stablelm,
    weights_for(
        CheckpointLayout(
            q_norm="self_attn.q_layernorm", k_norm="self_attn.k_layernorm",
            qk_norm_modules=True,
        )
    ),
)  # fmt: skip
