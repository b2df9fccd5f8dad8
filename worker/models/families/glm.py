"""GLM and GLM-4: Llama with gate/up as one matrix, q/k/v biases and rotary on interleaved
pairs of the first half of each head; GLM-4 adds norms after attention and the MLP."""

from __future__ import annotations

from batchgen.worker.models.dense_weights import CheckpointLayout, weights_for
from batchgen.worker.models.families.decoder_config import Shape, reader_for
from batchgen.worker.models.family import Family
from batchgen.worker.models.model_config import BlockSpec

GLM = Family(
    "glm",
    ("GlmForCausalLM",),
    reader_for(Shape(o_bias=False, mlp_bias=False)),
    weights_for(CheckpointLayout(gate_up="mlp.gate_up_proj", rope_interleaved=True)),
)
GLM4 = Family(
    "glm4",
    ("Glm4ForCausalLM",),
    reader_for(Shape(o_bias=False, mlp_bias=False, block=BlockSpec(post_norms=True))),
    weights_for(
        CheckpointLayout(
            gate_up="mlp.gate_up_proj", rope_interleaved=True,
            post_attn_norm="post_self_attn_layernorm", post_mlp_norm="post_mlp_layernorm",
        )
    ),
)  # fmt: skip
