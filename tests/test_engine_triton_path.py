"""The engine's model forward on the Triton ops (interpreter on CPU) equals the CPU path."""

from __future__ import annotations

import random

import pytest
import torch

from batchgen import Engine, SamplingParams
from tests.family_parity import engine_prompt_logits


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_ops_forward_equals_the_cpu_path(toy_model, arch):
    path = toy_model(arch)
    triton = Engine.from_pretrained(
        path, num_kv_blocks=32, use_triton=True, max_num_batched_tokens=24
    )
    cpu = Engine.from_pretrained(
        path, num_kv_blocks=32, use_triton=False, max_num_batched_tokens=24
    )
    assert triton.runner.model.ops.name == "triton"
    assert cpu.runner.model.ops.name == "cpu"
    rng = random.Random(0)
    tokens = [rng.randrange(16, 8192) for _ in range(40)]  # two chunks: prefill with cached context
    got, _ = engine_prompt_logits(triton, tokens)
    expected, _ = engine_prompt_logits(cpu, tokens)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)

    prompts = [[rng.randrange(16, 8192) for _ in range(n)] for n in (5, 19)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    assert [o.token_ids for o in triton.generate(prompts, params)] == [
        o.token_ids for o in cpu.generate(prompts, params)
    ]


def test_attention_arguments_are_checked_once_per_step_not_per_layer(toy_model, monkeypatch):
    from batchgen.kernels.triton import arg_checks

    engine = Engine.from_pretrained(toy_model("llama"), num_kv_blocks=32, use_triton=True)
    assert len(engine.runner.kv_caches) == 4  # layers
    checked: list[int] = []  # the q rows of each check
    check = arg_checks.check_paged_attention

    def counting(q, *args, **kwargs):
        checked.append(q.shape[0])
        return check(q, *args, **kwargs)

    monkeypatch.setattr(arg_checks, "check_paged_attention", counting)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request("a", list(range(100, 105)), params)
    engine.step()  # a's prompt
    engine.add_request("b", list(range(200, 219)), params)
    engine.step()  # a decodes, b's prompt
    engine.step()  # both decode
    assert checked == [5, 1, 19, 2]


# local/global layers with soft-capping, a window on every layer (blocks handed back),
# partial rotary in a parallel block, learned positions without rotary, MLA's latent cache
@pytest.mark.parametrize("name", ["gemma2", "mistral", "phi", "gpt2", "deepseek_v3"])
def test_triton_ops_run_the_families_switches_like_the_cpu_path(zoo_model, name):
    path = zoo_model(name)
    engines = [
        Engine.from_pretrained(path, num_kv_blocks=16, use_triton=flag, max_num_batched_tokens=24)
        for flag in (True, False)
    ]
    rng = random.Random(1)
    tokens = [rng.randrange(3, 512) for _ in range(40)]  # two chunks, past the window of 16
    got, expected = (engine_prompt_logits(e, tokens)[0] for e in engines)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (7, 30)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    triton, cpu = ([o.token_ids for o in e.generate(prompts, params)] for e in engines)
    assert triton == cpu
