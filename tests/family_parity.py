"""One architecture against HF transformers, through the real engine: the checks every family passes.

``assert_matches_hf(path)``:
- teacher-forced logits of a prompt computed in chunks (boundaries inside and
  across KV blocks, and past any sliding window) equal HF's forward;
- greedy tokens of prompts of several lengths, run as batch mates with
  chunked prefill, equal HF ``generate`` one prompt at a time (a first
  difference must be a near tie in HF's own logits);
- the same prompts in a pool too small for them (preemption) and after a
  shared prefix was cached give the same tokens.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from batchgen import Engine, SamplingParams
from tests.hf_reference import first_divergence_is_tie, hf_greedy, hf_logits

LOGIT_ATOL = 2e-4  # fp32; logits are O(10)
CHUNK = 24  # the prefill chunk of assert_matches_hf's engine (tokens a step)
PROMPT_LENGTHS = (1, 6, 17, 40, 75)


def engine_prompt_logits(engine: Engine, token_ids: list[int]) -> tuple[torch.Tensor, int]:
    """Logits at every computed position of token_ids and where they start
    (after prefix-cache hits), through the real scheduler and runner.

    Drives one request step by step (so chunking and prefix hits apply) and
    reads the logits of every row the step computed for it.
    """
    rid = f"tf-{random.random()}"
    engine.add_request(rid, token_ids, SamplingParams(max_tokens=1, ignore_eos=True))
    rows: list[torch.Tensor] = []
    first = None
    done = False
    while not done:
        plan = engine.scheduler.schedule()
        (req,) = plan.prefills + plan.decodes  # the one request in the engine
        if first is None:
            first = req.num_computed_tokens  # prefix-cache hits are not recomputed
        inputs = engine.runner.prepare(plan)
        model = engine.runner.model
        hidden = model.forward(
            inputs.input_ids, inputs.positions, inputs.batch, engine.runner.kv_caches
        )
        rows.append(model.compute_logits(hidden))
        sampled = [0] * len(inputs.sampling)
        engine.scheduler.update(plan, sampled)
        done = req.num_computed_tokens == len(token_ids)
    engine.abort(rid)
    assert first is not None
    return torch.cat(rows)[: len(token_ids) - first], first


def random_prompts(vocab: int, lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def assert_matches_hf(
    path: Path,
    vocab: int,
    max_tokens: int = 8,
    tight_blocks: int = 6,
    cached_prefix: int = 64,
    recurrent: bool = False,
    **engine_kwargs: object,
) -> None:
    """tight_blocks: a pool that holds the longest sequence alone (fewer where a
    model whose every layer slides hands blocks back as it goes). cached_prefix: the tokens a prefix-cache hit skips (0 where
    the model turns prefix caching off). recurrent: a model with a recurrent state
    (linear attention), whose prompt logits are compared with transformers' run in
    the engine's chunks (chunks reorder the state's sums: against one whole pass
    the logits differ by up to 1.2e-3 on the Qwen3-Next toy)."""
    # chunks of 24 tokens over blocks of 16: boundaries inside and across blocks
    engine = Engine.from_pretrained(
        path, num_kv_blocks=96, max_num_batched_tokens=CHUNK, **engine_kwargs
    )
    (tokens,) = random_prompts(vocab, (90,), seed=11)
    logits, first = engine_prompt_logits(engine, tokens)
    assert first == 0
    reference = hf_logits(path, tokens, chunk=CHUNK if recurrent else None)
    torch.testing.assert_close(logits, reference, atol=LOGIT_ATOL, rtol=0)

    prompts = random_prompts(vocab, PROMPT_LENGTHS, seed=12)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    got = [o.token_ids for o in engine.generate(prompts, params)]
    ties = 0
    for prompt, out in zip(prompts, got):
        ref = hf_greedy(path, prompt, max_tokens, stop_at_eos=False)
        if out != ref:
            assert first_divergence_is_tie(path, prompt, ref, out), (len(prompt), ref, out)
            ties += 1
    assert ties <= 1, f"{ties} near-tie divergences out of {len(prompts)}"
    assert len({tuple(o) for o in got}) > 1  # varied, not one token repeated everywhere

    # preemption: blocks for the longest of these sequences alone
    tight = Engine.from_pretrained(
        path, num_kv_blocks=tight_blocks, max_num_batched_tokens=24, **engine_kwargs
    )
    assert [o.token_ids for o in tight.generate(prompts, params)] == got
    assert tight.stats().num_preemptions > 0
    # prefix cache: the longest prompt again after a request that shares its first 64 tokens
    tight.generate([prompts[-1][:64] + [5, 6, 7]], SamplingParams(max_tokens=1))
    again = tight.generate([prompts[-1]], params)[0]
    assert again.num_cached_tokens == cached_prefix
    assert again.token_ids == got[-1]
