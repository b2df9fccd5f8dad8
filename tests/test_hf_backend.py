"""The transformers backend against HF transformers (``family_parity``: teacher-forced
logits over chunked prefill, greedy tokens of batch mates vs HF generate, the same
tokens under preemption and after a prefix-cache hit), on architectures batchgen has
no code for and, with ``model_impl="transformers"``, on some it may have; on Llama it
gives the native engine's tokens; logprobs and structured output work through it."""

from __future__ import annotations

import math
import re

import pytest
import torch

from batchgen import Engine, SamplingParams
from batchgen.jobs.schema.constraints import StructuredOutput
from batchgen.kernels.batch import AttentionBatch, HostBatch
from batchgen.worker.models import UnsupportedModelError
from batchgen.worker.models.hf_backend import HfCausalLM
from batchgen.worker.models.hf_backend.recurrent import SequenceStates
from tests.family_parity import (
    LOGIT_ATOL,
    assert_matches_hf,
    engine_prompt_logits,
    random_prompts,
)
from tests.hf_reference import hf_last_hidden_state, hf_logits
from tests.model_zoo import VOCAB
from tests.releases import needs_backend
from tests.test_model_families import TIGHT_BLOCKS

pytestmark = needs_backend

BACKEND_ONLY = ["gptj", "opt", "gpt_bigcode", "persimmon", "olmo", "nemotron"]
# native too; through the backend: every layer sliding (blocks released), local and global
# layers with both soft-caps (Gemma 2), a logit scale (Cohere)
ALSO_NATIVE = ["mistral", "gemma2", "cohere"]


@pytest.mark.parametrize("name", BACKEND_ONLY)
def test_auto_runs_it_through_the_backend_exactly(zoo_model, name):
    path = zoo_model(name)
    assert isinstance(Engine.from_pretrained(path, num_kv_blocks=4).runner.model, HfCausalLM)
    assert_matches_hf(path, VOCAB)


def test_auto_runs_a_switch_the_native_family_refuses_through_the_backend(zoo_model):
    path = zoo_model("gpt2-layer-scaled")  # GPT-2 with a scale per layer
    with pytest.raises(UnsupportedModelError, match="scale_attn_by_inverse_layer_idx"):
        Engine.from_pretrained(path, num_kv_blocks=4, model_impl="native")
    assert isinstance(Engine.from_pretrained(path, num_kv_blocks=4).runner.model, HfCausalLM)
    assert_matches_hf(path, VOCAB)


@pytest.mark.parametrize("name", ALSO_NATIVE)
def test_the_backend_runs_it_exactly(zoo_model, name):
    tight = TIGHT_BLOCKS.get(name, 6)  # the native families' pools: the same KV per token
    assert_matches_hf(zoo_model(name), VOCAB, tight_blocks=tight, model_impl="transformers")


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_hybrid_deltanet_models_run_exactly_with_a_state_per_sequence(zoo_model, name):
    """Gated DeltaNet layers carry a state per sequence across chunked prefill, batch mates
    and preemption (recomputed from position 0); prefix caching is off for them. The prompt
    logits, computed in chunks of 24, equal transformers' over the same chunks (measured
    4e-6); chunks reorder the delta rule's sums, so against one whole pass they differ by
    up to 1.2e-3 (Qwen3-Next), and with the state lost between chunks by 14."""
    path = zoo_model(name)
    engine = Engine.from_pretrained(path, num_kv_blocks=4)
    model = engine.runner.model
    assert isinstance(model, HfCausalLM) and model.config.keeps_state
    assert not engine.block_manager.enable_prefix_caching
    assert_matches_hf(path, VOCAB, cached_prefix=0, recurrent=True)


def test_a_hybrid_handed_back_midway_resumes_exactly(zoo_model):
    """drain hands requests back with their tokens so far; resumed (here on the same engine,
    on reused blocks) their DeltaNet state is recomputed from position 0."""
    engine = Engine.from_pretrained(zoo_model("qwen3_5"), num_kv_blocks=32)
    prompts = random_prompts(VOCAB, (15, 40), seed=7)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    full = [o.token_ids for o in engine.generate(prompts, params)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"d{i}", prompt, params)
    for _ in range(6):
        engine.step()
    partial = {o.request_id: o.token_ids for o in engine.drain()}
    assert all(0 < len(partial[f"d{i}"]) < 12 for i in range(2))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params, resume_token_ids=partial[f"d{i}"])
    resumed = {}
    while engine.has_unfinished():
        resumed.update({o.request_id: o.token_ids for o in engine.step()})
    assert [resumed[f"r{i}"] for i in range(2)] == full


def test_backend_on_llama_gives_the_native_engines_tokens(zoo_model):
    path = zoo_model("llama")
    native = Engine.from_pretrained(path, num_kv_blocks=64)
    backend = Engine.from_pretrained(path, num_kv_blocks=64, model_impl="transformers")
    assert not isinstance(native.runner.model, HfCausalLM)
    assert isinstance(backend.runner.model, HfCausalLM)
    prompts = random_prompts(VOCAB, (1, 17, 40, 75), seed=4)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    ours, theirs = native.generate(prompts, params), backend.generate(prompts, params)
    assert [o.token_ids for o in theirs] == [o.token_ids for o in ours]
    (tokens,) = random_prompts(VOCAB, (40,), seed=5)
    torch.testing.assert_close(
        engine_prompt_logits(backend, tokens)[0], engine_prompt_logits(native, tokens)[0],
        atol=LOGIT_ATOL, rtol=0,
    )  # fmt: skip


@pytest.mark.parametrize("name", ["gptj", "gemma2"])
def test_the_backend_on_the_triton_kernels_equals_the_cpu_path(zoo_model, name):
    """Triton under the interpreter; Gemma 2: local/global layers with soft-capping."""
    path = zoo_model(name)
    engines = [
        Engine.from_pretrained(path, num_kv_blocks=16, use_triton=flag, max_num_batched_tokens=24,
                               model_impl="transformers")
        for flag in (True, False)
    ]  # fmt: skip
    assert [e.runner.model.ops.name for e in engines] == ["triton", "cpu"]
    (tokens,) = random_prompts(VOCAB, (40,), seed=8)  # two chunks, past the window of 16
    got, expected = (engine_prompt_logits(e, tokens)[0] for e in engines)
    torch.testing.assert_close(got, expected, atol=LOGIT_ATOL, rtol=0)
    prompts = random_prompts(VOCAB, (7, 30), seed=9)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    triton, cpu = ([o.token_ids for o in e.generate(prompts, params)] for e in engines)
    assert triton == cpu


def test_an_embedding_is_the_models_last_hidden_state(zoo_model):
    """OPT projects its last hidden state to a smaller width (32 of 64): that is the vector
    (last-token pooling, normalised, the default)."""
    path = zoo_model("opt")
    engine = Engine.from_pretrained(path, num_kv_blocks=16)
    assert engine.runner.model.config.hidden_size == 32
    tokens = [5, 6, 7, 8]
    (vector,) = engine.embed([tokens])
    expected = torch.nn.functional.normalize(hf_last_hidden_state(path, tokens)[-1], dim=0)
    torch.testing.assert_close(torch.tensor(vector), expected, atol=1e-5, rtol=0)


def test_logprobs_are_hfs_log_softmax(zoo_model):
    path = zoo_model("opt")
    engine = Engine.from_pretrained(path, num_kv_blocks=64)
    (prompt,) = random_prompts(VOCAB, (20,), seed=6)
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=6, logprobs=2, ignore_eos=True))
    reference = torch.log_softmax(hf_logits(path, prompt + out.token_ids), dim=-1)
    assert out.logprobs is not None and len(out.logprobs) == 6
    for i, (token, top) in enumerate(zip(out.token_ids, out.logprobs)):
        row = reference[len(prompt) - 1 + i]
        assert set(top) == set(row.topk(2).indices.tolist()) | {token}
        assert math.isclose(top[token], float(row[token]), abs_tol=1e-4)


def test_structured_output_runs_through_the_backend(zoo_model):
    engine = Engine.from_pretrained(zoo_model("gptj"), num_kv_blocks=64)
    pattern = r"[0-9]{3}-[a-z]{4}"
    params = SamplingParams(max_tokens=20, structured_output=StructuredOutput(regex=pattern))
    outputs = engine.generate(["Item one:", "Item two:"], params)
    assert all(re.fullmatch(pattern, o.text) for o in outputs), [o.text for o in outputs]


def test_a_steps_sequences_are_read_from_the_host_arrays():
    """SequenceStates reads the step's sequences from the batch's host arrays: here the
    device tensors are on the meta device, which cannot be read at all (before: three
    .tolist() of device tensors in every forward, each a wait for the GPU)."""
    import numpy as np
    import transformers

    meta = torch.empty(0, device="meta")
    host = HostBatch(
        positions=np.array([10, 5, 0, 1, 2, 4, 5], dtype=np.int64),
        decode_block_tables=np.array([[3, 4], [7, 7]], dtype=np.int32),
        prefill_block_tables=np.array([[9, 9], [11, 12]], dtype=np.int32),
        prefill_query_start_loc=np.array([0, 3, 5], dtype=np.int32),
    )
    batch = AttentionBatch(meta, 2, meta, meta, 11, meta, meta, meta, 3, 6, host=host)
    states = SequenceStates(transformers.Qwen3NextConfig(num_hidden_layers=4))
    kept = {block: object() for block in (3, 7, 11, 12)}  # 12: a finished sequence's
    states.caches.update(kept)
    segments = states.segments(batch)
    assert [(s.start, s.end) for s in segments] == [(0, 1), (1, 2), (2, 5), (5, 7)]
    assert [s.cache for s in segments[:2]] == [kept[3], kept[7]]
    assert segments[3].cache is kept[11]
    assert isinstance(segments[2].cache, transformers.DynamicCache)  # starts at position 0
    assert set(states.caches) == {3, 7, 9, 11}  # 12 is inside sequence 11's table: dropped
    with pytest.raises(RuntimeError, match="needs the batch's host arrays"):
        states.segments(AttentionBatch(meta, 2, meta, meta, 11, meta, meta, meta, 3, 6))
