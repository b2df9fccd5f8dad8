"""The Python API: stops, n > 1, logprobs, abort/drain/resume, rejections, loading errors."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from batchgen import Engine, RequestRejected, SamplingParams
from batchgen.worker.models import UnsupportedModelError


@pytest.fixture(scope="module")
def engine(toy_model) -> Engine:
    return Engine.from_pretrained(toy_model("qwen2"), num_kv_blocks=256)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 8192) for _ in range(n)]


def test_strings_and_messages_are_accepted(engine):
    text_out, chat_out = engine.generate(
        ["The quick brown fox", [{"role": "user", "content": "hello"}]],
        SamplingParams(max_tokens=5, ignore_eos=True),
    )
    assert text_out.prompt_token_ids == engine.tokenizer.encode("The quick brown fox")
    chat_ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )  # fmt: skip
    assert chat_out.prompt_token_ids == list(chat_ids)
    assert chat_out.text == engine.tokenizer.decode(chat_out.token_ids, skip_special_tokens=True)


def test_stop_string_cuts_text_and_stops(engine):
    prompt = _prompt(20, 1)
    free = engine.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    # pick a stop string from the middle of the free-running text
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    out = engine.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert out.token_ids == free.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < len(free.token_ids)


def test_stop_token_ids_and_max_tokens(engine):
    prompt = _prompt(10, 2)
    free = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    target = free.token_ids[5]
    first = free.token_ids.index(target)
    out = engine.generate(
        [prompt], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[target])
    )[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[: first + 1]  # the stop token is kept in the ids


def test_n_samples_share_prompt_blocks(engine):
    prompt = _prompt(70, 3)  # 4 full blocks
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3)
    out = engine.generate([prompt], params)[0]
    assert len(out.samples) == 3
    assert out.token_ids == out.samples[0].token_ids
    assert len({tuple(s.token_ids) for s in out.samples}) > 1  # seeded per sample, not cloned
    again = engine.generate([prompt], params)[0]
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in out.samples]


def test_siblings_reuse_the_first_samples_prompt_blocks(toy_model):
    engine = Engine.from_pretrained(toy_model("qwen2"), num_kv_blocks=64)
    prompt = _prompt(70, 3)
    engine.add_request("x", prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=1, n=3))
    engine.step()  # prefill of the first sample
    engine.step()  # siblings admitted with its 4 full blocks
    samples = {r.request_id: r for r in engine.scheduler.running}
    first, second, third = (samples[f"x#{i}"] for i in range(3))
    assert second.num_cached_tokens == third.num_cached_tokens == 64
    assert second.block_table[:4] == first.block_table[:4] == third.block_table[:4]
    assert [engine.block_manager.blocks[b].ref_count for b in first.block_table[:4]] == [3] * 4
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_free_blocks == 64


def test_logprobs_are_returned_per_token(engine):
    out = engine.generate(
        [_prompt(8, 4)], SamplingParams(max_tokens=4, logprobs=3, ignore_eos=True)
    )[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) in (3, 4)
        assert max(entry.values()) == entry[token]  # greedy picks the top logprob


def test_abort_drain_and_resume_continue_exactly(engine):
    prompts = [_prompt(15, 5), _prompt(40, 6)]
    full = engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    seeded = SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True)
    full_seeded = engine.generate(prompts, seeded)

    for params, expected in (
        (SamplingParams(max_tokens=20, ignore_eos=True), full),
        (seeded, full_seeded),
    ):
        for i, p in enumerate(prompts):
            engine.add_request(f"d{i}", p, params)
        for _ in range(8):
            engine.step()
        handed_back = {o.request_id: o for o in engine.drain()}
        assert not engine.has_unfinished()
        assert engine.block_manager.num_free_blocks == 256
        for i, p in enumerate(prompts):
            partial = handed_back[f"d{i}"]
            assert partial.finish_reason == "abort"
            assert 0 < len(partial.token_ids) < 20
            assert partial.token_ids == expected[i].token_ids[: len(partial.token_ids)]
            engine.add_request(f"r{i}", p, params, resume_token_ids=partial.token_ids)
        resumed = {}
        while engine.has_unfinished():
            resumed.update({o.request_id: o for o in engine.step()})
        for i in range(len(prompts)):
            assert resumed[f"r{i}"].token_ids == expected[i].token_ids
            assert resumed[f"r{i}"].text == expected[i].text


def test_abort_unknown_returns_none_and_duplicate_id_is_rejected(engine):
    assert engine.abort("nope") is None
    engine.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(RequestRejected, match="already in the engine"):
        engine.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=2))
    engine.abort("dup")


def test_requests_that_can_never_fit_are_rejected(toy_model):
    engine = Engine.from_pretrained(toy_model("qwen2"), num_kv_blocks=4, max_model_len=100)
    with pytest.raises(RequestRejected) as err:
        engine.add_request("long", list(range(90)), SamplingParams(max_tokens=20))
    assert err.value.reason == (
        "prompt (90 tokens) + max_tokens (20) = 110 exceeds the model's context of 100 tokens"
    )
    with pytest.raises(RequestRejected, match="needs 5 KV blocks but the pool has 4"):
        engine.add_request("big", list(range(60)), SamplingParams(max_tokens=20))
    with pytest.raises(RequestRejected, match="the prompt is empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(RequestRejected, match=r"token ids must be in \[0, 8192\)"):
        engine.add_request("oov", [1, 99999], SamplingParams())
    assert not engine.has_unfinished()


def test_no_max_tokens_runs_to_the_context_or_what_the_pool_holds(toy_model):
    """max_tokens None (a chat line's default): up to the context, or to the most tokens
    the KV pool holds for one request when that is less (here 4 blocks of 16 = 64)."""
    unbounded = SamplingParams(max_tokens=None, ignore_eos=True)
    for blocks, limit in ((16, 100), (4, 64)):
        engine = Engine.from_pretrained(toy_model("qwen2"), num_kv_blocks=blocks,
                                        max_model_len=100)  # fmt: skip
        out = engine.generate([_prompt(30, 1)], unbounded)[0]
        assert (out.finish_reason, len(out.token_ids)) == ("length", limit - 30)
    with pytest.raises(RequestRejected, match="needs 5 KV blocks but the pool has 4"):
        engine.add_request("full", list(range(64)), unbounded)  # not one token of room


def test_stats_and_free_capacity(toy_model):
    engine = Engine.from_pretrained(toy_model("qwen2"), num_kv_blocks=64, max_num_seqs=4)
    assert engine.free_capacity() == 6  # 4 running + a queue of 2 behind them
    for i in range(3):
        engine.add_request(str(i), _prompt(20, i), SamplingParams(max_tokens=3, ignore_eos=True))
    assert engine.free_capacity() == 3
    engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_steps) == (3, 0, 1)
    assert stats.prompt_tokens == 60 and stats.generation_tokens == 3
    assert stats.kv_usage == 6 / 64
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().generation_tokens == 9


def test_sharded_checkpoint_loads_the_same_model(tmp_path, toy_model):
    from batchgen.toy import write_toy_checkpoint

    sharded = write_toy_checkpoint(tmp_path / "sharded", arch="qwen2", max_shard_size="5MB")
    assert (sharded / "model.safetensors.index.json").is_file()
    single = Engine.from_pretrained(toy_model("qwen2"), num_kv_blocks=32)
    split = Engine.from_pretrained(sharded, num_kv_blocks=32)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    assert (
        split.generate([_prompt(9, 7)], params)[0].token_ids
        == single.generate([_prompt(9, 7)], params)[0].token_ids
    )


def test_loading_errors_name_the_problem(tmp_path, toy_model):
    src = toy_model("llama")
    with pytest.raises(UnsupportedModelError, match="does not exist"):
        Engine.from_pretrained(tmp_path / "missing")
    bad = tmp_path / "unknown"
    shutil.copytree(src, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedModelError, match=r"architecture NoSuchModelForCausalLM .* is not supported"
    ):
        Engine.from_pretrained(bad, model_impl="native")
    with pytest.raises(  # auto: nor does transformers build such a class for model_type llama
        UnsupportedModelError,
        match=r"^NoSuchModelForCausalLM is not the causal LM transformers builds for model_type "
        r"'llama' \(LlamaForCausalLM\)$",
    ):
        Engine.from_pretrained(bad)
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(src, gpt2)
    config = json.loads((gpt2 / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    config["model_type"] = "gpt2"
    (gpt2 / "config.json").write_text(json.dumps(config))
    native = r"sets .*, which batchgen's native gpt2 implementation does not read"
    with pytest.raises(UnsupportedModelError, match=native):
        Engine.from_pretrained(gpt2, model_impl="native")
    # auto falls back to the transformers backend, which finds Llama's tensors, not GPT-2's
    with pytest.raises(
        UnsupportedModelError,
        match=native + r".*; through transformers: checkpoint .* lacks 'lm_head.weight', .* "
        r"never reads: 'model.embed_tokens.weight'",
    ):
        Engine.from_pretrained(gpt2)
    noweights = tmp_path / "noweights"
    shutil.copytree(src, noweights)
    (noweights / "model.safetensors").unlink()
    with pytest.raises(UnsupportedModelError, match=r"has no model\.safetensors"):
        Engine.from_pretrained(noweights)
    shard_missing = tmp_path / "shard"
    shutil.copytree(src, shard_missing)
    (shard_missing / "model.safetensors").unlink()
    (shard_missing / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(UnsupportedModelError, match="missing shard"):
        Engine.from_pretrained(shard_missing)


def test_rope_scaling_spelled_the_old_way_loads_the_same(tmp_path, toy_model):
    src = toy_model("llama")
    old = tmp_path / "old"
    shutil.copytree(src, old)
    config = json.loads((old / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    (old / "config.json").write_text(json.dumps(config))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    a = Engine.from_pretrained(src, num_kv_blocks=32).generate([_prompt(40, 8)], params)
    b = Engine.from_pretrained(old, num_kv_blocks=32).generate([_prompt(40, 8)], params)
    assert a[0].token_ids == b[0].token_ids


def test_generate_is_the_same_plain_under_no_grad_and_under_inference_mode(engine):
    # benchmark harnesses and most users wrap inference in inference_mode; the
    # step's tensors are then inference tensors, which have no version counter
    prompts = [_prompt(n, 20 + n) for n in (5, 17, 40, 70)]
    params = [
        SamplingParams(max_tokens=12, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.9, seed=4, ignore_eos=True),
        SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, seed=5, n=2, ignore_eos=True),
    ]

    def tokens() -> list[list[list[int]]]:
        return [[s.token_ids for s in o.samples] for o in engine.generate(prompts, params)]

    plain = tokens()
    with torch.no_grad():
        no_grad = tokens()
    with torch.inference_mode():
        inference = tokens()
    assert no_grad == plain and inference == plain
    assert [len(s) for o in plain for s in o] == [12, 9, 12, 7, 7]
