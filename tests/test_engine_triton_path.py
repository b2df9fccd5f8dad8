"""The engine's model forward on the Triton ops (interpreter on CPU) equals the reference path."""

from __future__ import annotations

import random

import pytest
import torch

from batchgen.worker import Engine, SamplingParams
from tests.test_engine_parity import engine_prompt_logits


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_ops_forward_equals_reference(toy_model, arch):
    path = toy_model(arch)
    triton = Engine.from_pretrained(
        path, num_kv_blocks=32, use_triton=True, max_num_batched_tokens=24
    )
    reference = Engine.from_pretrained(
        path, num_kv_blocks=32, use_triton=False, max_num_batched_tokens=24
    )
    assert triton.runner.model.ops.name == "triton"
    assert reference.runner.model.ops.name == "reference"
    rng = random.Random(0)
    tokens = [rng.randrange(16, 8192) for _ in range(40)]  # two chunks: prefill with cached context
    got, _ = engine_prompt_logits(triton, tokens)
    expected, _ = engine_prompt_logits(reference, tokens)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)

    prompts = [[rng.randrange(16, 8192) for _ in range(n)] for n in (5, 19)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    assert [o.token_ids for o in triton.generate(prompts, params)] == [
        o.token_ids for o in reference.generate(prompts, params)
    ]
