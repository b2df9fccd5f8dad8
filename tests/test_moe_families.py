"""Every MoE architecture batchgen claims runs exactly as transformers does (``family_parity``):
Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, DeepSeek V2 and V3."""

from __future__ import annotations

import pytest

from tests.family_parity import assert_matches_hf
from tests.model_zoo import MOE, VOCAB


@pytest.mark.parametrize("name", MOE)
def test_moe_family_matches_hf(zoo_model, name):
    assert_matches_hf(zoo_model(name), VOCAB)
