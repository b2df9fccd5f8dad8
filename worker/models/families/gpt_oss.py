"""gpt-oss: Llama-shaped attention with biases and a learned sink per head, alternating
sliding-window and full layers, yarn rope, and routed experts with biases and a clamped SwiGLU.

Its router takes the top-k of its (biased) logits and softmaxes those; its
experts' gate and up columns are interleaved in the checkpoint and read into
the gate-then-up halves every expert kernel takes (``moe_weights.py``).
"""

from __future__ import annotations

import dataclasses

from batchgen.worker.models.config_keys import ConfigReader
from batchgen.worker.models.dense_weights import CheckpointLayout
from batchgen.worker.models.families import switches
from batchgen.worker.models.families.decoder_config import Shape, Windows, decoder_config
from batchgen.worker.models.families.llama_moe import moe_weights, num_experts, with_moe
from batchgen.worker.models.family import Family
from batchgen.worker.models.model_config import ModelConfig, MoeSpec, RouterKind
from batchgen.worker.models.moe_weights import MoeLayout

# transformers' values where config.json has none (OpenAI's gpt-oss checkpoints give
# only swiglu_limit); 5.17's experts use these constants whatever the config says, 5.23's
# read the config
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def _read_gpt_oss(r: ConfigReader, architecture: str) -> ModelConfig:
    # hidden_act is read for the MLP spec; transformers' gpt-oss experts do not
    # use it (their activation is the clamped SwiGLU below)
    config = decoder_config(r, architecture, Shape(mlp_bias=False, windows=Windows.LAYER_TYPES))
    spec = MoeSpec(
        num_experts=num_experts(r),
        top_k=switches.positive_int(r, "num_experts_per_tok"),
        intermediate_size=config.mlp.intermediate_size,
        router=RouterKind.TOPK_SOFTMAX,
        router_bias=True,
        expert_bias=True,
        clamped_swiglu=(float(r.get("swiglu_alpha", SWIGLU_ALPHA)),
                        float(r.get("swiglu_limit", SWIGLU_LIMIT))),
    )  # fmt: skip
    config = dataclasses.replace(
        config, attention=dataclasses.replace(config.attention, sinks=True)
    )
    return with_moe(config, spec, [True] * config.num_layers, r)


GPT_OSS = Family(
    "gpt_oss", ("GptOssForCausalLM",), _read_gpt_oss,
    moe_weights(CheckpointLayout(), MoeLayout(router="router", stacked=True)),
)  # fmt: skip
