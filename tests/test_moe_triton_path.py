"""The MoE families' forward on the Triton ops (interpreter on CPU) equals the CPU path:
the fused-MoE kernel, sinks with a sliding window (gpt-oss), MLA's shared latent cache."""

from __future__ import annotations

import random

import pytest
import torch

from batchgen import Engine, SamplingParams
from tests.family_parity import engine_prompt_logits
from tests.model_zoo import VOCAB


@pytest.mark.parametrize("name", ["gpt_oss", "deepseek_v3"])
def test_triton_ops_forward_equals_the_cpu_path(zoo_model, name):
    path = zoo_model(name)
    engines = [
        Engine.from_pretrained(path, num_kv_blocks=16, use_triton=use, max_num_batched_tokens=12)
        for use in (True, False)
    ]
    triton, cpu = engines
    assert triton.runner.model.ops.name == "triton"
    rng = random.Random(0)
    tokens = [rng.randrange(3, VOCAB) for _ in range(20)]  # two chunks, past gpt-oss's window 8
    got, _ = engine_prompt_logits(triton, tokens)
    expected, _ = engine_prompt_logits(cpu, tokens)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)

    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 11)]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    assert [o.token_ids for o in triton.generate(prompts, params)] == [
        o.token_ids for o in cpu.generate(prompts, params)
    ]
