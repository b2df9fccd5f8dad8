"""The transformers backend against HF transformers, on architectures batchgen has no code for.

Greedy tokens equal HF ``generate`` (fp32) for prompts of several lengths run
together as batch mates; teacher-forced logits equal HF's forward across
chunked-prefill boundaries and after prefix-cache hits; preemption changes
nothing; on Llama the backend gives the native engine's tokens; logprobs and
structured output work through it like through the native models.
"""

from __future__ import annotations

import math
import random
import re

import pytest
import torch

from batchgen.jobs.schema.constraints import StructuredOutput
from batchgen.worker import Engine, SamplingParams
from batchgen.worker.models.hf_backend import HfCausalLM
from batchgen.worker.models.llama import LlamaModel
from tests.backend_checkpoints import BACKEND_ARCHS, VOCAB
from tests.hf_reference import first_divergence_is_tie, hf_greedy, hf_logits
from tests.test_engine_parity import LOGIT_ATOL, engine_prompt_logits

PROMPT_LENGTHS = (1, 7, 16, 17, 40, 90)  # inside a block, at its edge, across several
NEW_TOKENS = 12


def _prompts(seed: int, lengths=PROMPT_LENGTHS, vocab: int = VOCAB) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def _assert_greedy_matches_hf(path, prompts, outputs) -> None:
    ties = 0
    for prompt, out in zip(prompts, outputs):
        ref = hf_greedy(path, prompt, NEW_TOKENS, stop_at_eos=False)
        if out.token_ids != ref:
            assert first_divergence_is_tie(path, prompt, ref, out.token_ids), (prompt, ref, out)
            ties += 1
    assert ties <= 1
    assert len({tuple(o.token_ids) for o in outputs}) == len(outputs)  # varied, not one token


@pytest.mark.parametrize("arch", BACKEND_ARCHS)
def test_greedy_tokens_equal_hf_generate_beside_batch_mates(backend_model, arch):
    path = backend_model(arch)
    engine = Engine.from_pretrained(path, num_kv_blocks=128)
    assert isinstance(engine.runner.model, HfCausalLM)  # auto: no native family matches
    prompts = _prompts(seed=1)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    _assert_greedy_matches_hf(path, prompts, outputs)


@pytest.mark.parametrize("arch", BACKEND_ARCHS)
def test_logits_equal_hf_across_chunked_prefill(backend_model, arch):
    path = backend_model(arch)
    # chunks of 7 tokens: boundaries fall inside blocks and across them
    engine = Engine.from_pretrained(path, num_kv_blocks=64, max_num_batched_tokens=7)
    (tokens,) = _prompts(seed=2, lengths=(60,))
    logits, first = engine_prompt_logits(engine, tokens)
    assert first == 0
    torch.testing.assert_close(logits, hf_logits(path, tokens), atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox"])
def test_logits_equal_hf_after_prefix_cache_hit(backend_model, arch):
    path = backend_model(arch)
    engine = Engine.from_pretrained(path, num_kv_blocks=64)
    prefix = list(range(300, 350))  # 50 tokens: 3 full blocks of 16
    engine.generate([prefix + [7, 8, 9]], SamplingParams(max_tokens=2))
    tokens = prefix + [11, 12, 13, 14, 15]
    logits, first = engine_prompt_logits(engine, tokens)
    assert first == 48  # three cached blocks were not recomputed
    torch.testing.assert_close(logits, hf_logits(path, tokens)[48:], atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["gpt2", "cohere"])
def test_preemption_leaves_tokens_unchanged(backend_model, arch):
    path = backend_model(arch)
    prompts = _prompts(seed=3, lengths=(30, 45, 20, 60, 33, 50))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    roomy = Engine.from_pretrained(path, num_kv_blocks=128).generate(prompts, params)
    tight = Engine.from_pretrained(path, num_kv_blocks=12)  # 192 slots for ~400 tokens
    outputs = tight.generate(prompts, params)
    assert tight.stats().num_preemptions > 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in roomy]


def test_backend_on_llama_gives_the_native_engines_tokens(toy_model):
    path = toy_model("llama")
    native = Engine.from_pretrained(path, num_kv_blocks=128)
    backend = Engine.from_pretrained(path, num_kv_blocks=128, model_impl="transformers")
    assert isinstance(native.runner.model, LlamaModel)
    assert isinstance(backend.runner.model, HfCausalLM)
    prompts = _prompts(seed=4, vocab=8192)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    ours, theirs = native.generate(prompts, params), backend.generate(prompts, params)
    assert [o.token_ids for o in theirs] == [o.token_ids for o in ours]
    (tokens,) = _prompts(seed=5, lengths=(40,), vocab=8192)
    torch.testing.assert_close(
        engine_prompt_logits(backend, tokens)[0], engine_prompt_logits(native, tokens)[0],
        atol=LOGIT_ATOL, rtol=0,
    )  # fmt: skip


def test_logprobs_are_hfs_log_softmax(backend_model):
    path = backend_model("phi")
    engine = Engine.from_pretrained(path, num_kv_blocks=64)
    (prompt,) = _prompts(seed=6, lengths=(20,))
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=6, logprobs=2, ignore_eos=True))
    reference = torch.log_softmax(hf_logits(path, prompt + out.token_ids), dim=-1)
    assert out.logprobs is not None and len(out.logprobs) == 6
    for i, (token, top) in enumerate(zip(out.token_ids, out.logprobs)):
        row = reference[len(prompt) - 1 + i]
        assert token in top
        assert set(top) == set(row.topk(2).indices.tolist()) | {token}
        assert math.isclose(top[token], float(row[token]), abs_tol=1e-4)


def test_structured_output_runs_through_the_backend(backend_model):
    engine = Engine.from_pretrained(backend_model("stablelm"), num_kv_blocks=64)
    pattern = r"[0-9]{3}-[a-z]{4}"
    params = SamplingParams(max_tokens=20, structured_output=StructuredOutput(regex=pattern))
    outputs = engine.generate(["Item one:", "Item two:"], params)
    assert all(re.fullmatch(pattern, o.text) for o in outputs), [o.text for o in outputs]
