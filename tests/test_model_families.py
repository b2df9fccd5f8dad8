"""Every dense architecture batchgen claims runs exactly as transformers does (``family_parity``)."""

from __future__ import annotations

import pytest

from tests.family_parity import assert_matches_hf
from tests.model_zoo import VOCAB

DENSE = ["llama", "llama-dynamic", "llama-biases", "qwen3", "qwen3-bias", "mistral", "qwen2", "gemma", "gemma2",
         "gemma3", "phi", "phi3", "phi3-longrope", "gpt_neox", "stablelm", "granite", "cohere", "olmo2", "olmo3",
         "exaone4", "smollm3", "glm", "glm4", "starcoder2", "gpt2"]  # fmt: skip
# every layer slides: the pool hands blocks back as sequences grow, so a smaller
# one is needed before anything is preempted
TIGHT_BLOCKS = {"mistral": 5, "phi3": 5, "starcoder2": 5}


@pytest.mark.parametrize("name", DENSE)
def test_family_matches_hf(zoo_model, name):
    assert_matches_hf(zoo_model(name), VOCAB, tight_blocks=TIGHT_BLOCKS.get(name, 6))


def test_longrope_context_ends_where_its_short_factors_do(zoo_model):
    """Past original_max_position_embeddings transformers switches every position to the
    long factors mid-sequence; within it the short ones are exact, so that is the context."""
    from batchgen import Engine

    engine = Engine.from_pretrained(zoo_model("phi3-longrope"), num_kv_blocks=8)
    assert engine.max_model_len == 256
