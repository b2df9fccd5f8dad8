"""Embeddings through the paged engine against HF transformers' final hidden states.

Each pooling a sentence-transformers config can ask for (mean, CLS, last token;
with and without Normalize) and the default (last token, L2-normalized, on every
architecture) equal HF ``AutoModel``'s ``last_hidden_state`` pooled the same
way; Matryoshka ``dimensions``; the same input gives the same vector whatever
it is batched with; KV blocks are freed as soon as an embedding's prompt is
computed; and embedding requests leave the generation requests they share
steps with unchanged.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from batchgen import Engine, RequestRejected, SamplingParams
from batchgen.toy import ARCHS
from tests.hf_reference import hf_last_hidden_state

ATOL = 1e-4  # fp32; hidden states are O(1)
MODES = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
         "last": "pooling_mode_lasttoken"}  # fmt: skip


def st_checkpoint(src: Path, out: Path, mode: str, normalize: bool, **extra: bool) -> Path:
    """``src``'s files (linked) plus a sentence-transformers config asking for ``mode``."""
    out.mkdir()
    for f in src.iterdir():
        (out / f.name).symlink_to(f)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]  # fmt: skip
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})  # fmt: skip
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    config = {"word_embedding_dimension": 256, **{k: False for k in MODES.values()}}
    config[MODES[mode]] = True
    config.update(extra)
    (out / "1_Pooling" / "config.json").write_text(json.dumps(config))
    return out


def hf_pooled(path: Path, token_ids: list[int], mode: str, normalize: bool) -> torch.Tensor:
    hidden = hf_last_hidden_state(path, token_ids)
    vec = {"mean": hidden.mean(dim=0), "cls": hidden[0], "last": hidden[-1]}[mode]
    return torch.nn.functional.normalize(vec, dim=0) if normalize else vec


def prompts(count: int, seed: int, lo: int = 1, hi: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 8192) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def cosine(a: list[float], b: list[float]) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=0))


@pytest.fixture(scope="module")
def llama(toy_model) -> Path:
    return toy_model("llama")


@pytest.fixture(scope="module")
def st_engines(llama, tmp_path_factory):
    """``st_engines(mode, normalize)``: an engine on a checkpoint with that ST config."""
    cache: dict[tuple[str, bool], Engine] = {}

    def make(mode: str, normalize: bool) -> Engine:
        if (mode, normalize) not in cache:
            root = tmp_path_factory.mktemp(f"st-{mode}-{normalize}")
            path = st_checkpoint(llama, root / "model", mode, normalize)
            # a 48-token budget: prompts up to 90 tokens are computed in chunks
            cache[mode, normalize] = Engine.from_pretrained(
                path, num_kv_blocks=128, max_num_batched_tokens=48
            )
        return cache[mode, normalize]

    return make


@pytest.mark.parametrize("normalize", [True, False], ids=["normalize", "raw"])
@pytest.mark.parametrize("mode", ["mean", "cls", "last"])
def test_st_pooling_equals_hf(llama, st_engines, mode, normalize):
    engine = st_engines(mode, normalize)
    inputs = prompts(6, seed=1) + [[5], [7, 9]]  # chunked, one-token and two-token prompts
    got = engine.embed(inputs)
    assert len(got) == len(inputs)
    for ids, vec in zip(inputs, got):
        ref = hf_pooled(llama, ids, mode, normalize)
        assert len(vec) == 256
        torch.testing.assert_close(torch.tensor(vec), ref, atol=ATOL, rtol=0)
    assert engine.block_manager.num_used_blocks == 0
    assert not engine.has_unfinished()


def test_default_is_last_token_normalized(llama):
    engine = Engine.from_pretrained(llama, num_kv_blocks=64)
    assert engine.runner.pooling.source == "default"
    text = "The quick brown fox jumps over the lazy dog"
    inputs: list[str | list[int]] = [text, *prompts(3, seed=2)]
    got = engine.embed(inputs)
    ids = [engine.tokenizer.encode(text, add_special_tokens=True), *inputs[1:]]
    for token_ids, vec in zip(ids, got):
        ref = hf_pooled(llama, list(token_ids), "last", normalize=True)
        torch.testing.assert_close(torch.tensor(vec), ref, atol=ATOL, rtol=0)
        assert abs(float(torch.tensor(vec).norm()) - 1.0) < 1e-5


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "llama"])
def test_default_pooling_on_every_architecture(toy_model, arch):
    path = toy_model(arch)
    engine = Engine.from_pretrained(path, num_kv_blocks=64, max_num_batched_tokens=32)
    inputs = prompts(3, seed=13, lo=20, hi=60)
    for ids, vec in zip(inputs, engine.embed(inputs)):
        ref = hf_pooled(path, ids, "last", normalize=True)
        torch.testing.assert_close(torch.tensor(vec), ref, atol=ATOL, rtol=0)


def test_dimensions_truncate_and_renormalize(llama, st_engines):
    ids = prompts(2, seed=3, lo=20, hi=40)
    default = Engine.from_pretrained(llama, num_kv_blocks=64)
    full, short = default.embed(ids[:1])[0], default.embed(ids[:1], dimensions=64)[0]
    assert len(short) == 64
    ref = hf_pooled(llama, ids[0], "last", normalize=False)[:64]
    torch.testing.assert_close(
        torch.tensor(short), torch.nn.functional.normalize(ref, dim=0), atol=ATOL, rtol=0
    )
    assert abs(float(torch.tensor(short).norm()) - 1.0) < 1e-5
    assert short != full[:64]  # re-normalized, not cut
    # a pooling that does not normalize: the head of the raw mean, as it is
    raw = st_engines("mean", False).embed(ids[1:], dimensions=10)[0]
    ref = hf_pooled(llama, ids[1], "mean", normalize=False)[:10]
    torch.testing.assert_close(torch.tensor(raw), ref, atol=ATOL, rtol=0)
    # at the hidden size: the full vector
    assert default.embed(ids[:1], dimensions=256)[0] == pytest.approx(full, abs=1e-6)


@pytest.mark.parametrize("bad", [0, 257, -1, True, 2.5])
def test_dimensions_outside_the_hidden_size_are_rejected(llama, bad):
    engine = Engine.from_pretrained(llama, num_kv_blocks=64)
    with pytest.raises(RequestRejected, match=r"dimensions must be an integer in \[1, 256\]"):
        engine.embed([[5, 6, 7], [8, 9]], dimensions=bad)
    assert not engine.has_unfinished()  # none of the batch stays behind


def test_bad_inputs_are_rejected(llama):
    engine = Engine.from_pretrained(llama, num_kv_blocks=64, max_model_len=128)
    with pytest.raises(RequestRejected, match="the prompt is empty"):
        engine.add_embedding("e", [])
    with pytest.raises(RequestRejected, match=r"token ids must be in \[0, 8192\)"):
        engine.add_embedding("e", [1, 8192])
    with pytest.raises(RequestRejected, match="a string or token ids"):
        engine.add_embedding("e", [{"role": "user", "content": "hi"}])  # type: ignore[list-item]
    with pytest.raises(RequestRejected, match=r"the input \(129 tokens\) exceeds"):
        engine.add_embedding("e", [5] * 129)
    engine.add_embedding("e", [5] * 128)  # exactly the context fits: nothing is generated
    with pytest.raises(RequestRejected, match="already in the engine"):
        engine.add_embedding("e", [5])
    assert engine.embed([[5] * 128])[0] == pytest.approx(
        hf_pooled(engine_path(engine), [5] * 128, "last", True).tolist(), abs=ATOL
    )


def engine_path(engine: Engine) -> Path:
    return Path(engine.tokenizer.name_or_path)


def run_mixed(engine: Engine, gen: list[list[int]], emb: list[list[int]], max_tokens: int):
    """Generation and embedding requests added together and stepped to the end;
    checks after every step that a finished embedding holds no KV block."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(gen):
        engine.add_request(f"g{i}", ids, params)
        if i < len(emb):
            engine.add_embedding(f"e{i}", emb[i])
    for i in range(len(gen), len(emb)):
        engine.add_embedding(f"e{i}", emb[i])
    outs = {}
    shared_steps = 0
    while engine.has_unfinished():
        plan_has_gen = any(r.embed is None for r in engine.scheduler.running)
        step = engine.step()
        for out in step:
            outs[out.request_id] = out
            if out.embedding is not None:
                shared_steps += plan_has_gen
        running = engine.scheduler.running
        assert all(r.embed is None or r.num_computed_tokens < r.num_tokens for r in running)
        assert engine.block_manager.num_used_blocks <= sum(len(r.block_table) for r in running)
    assert engine.block_manager.num_used_blocks == 0
    return outs, shared_steps


@pytest.mark.parametrize("mode", ["mean", "last"])
def test_same_vector_whatever_the_batch(llama, tmp_path, mode):
    path = st_checkpoint(llama, tmp_path / "model", mode, normalize=True)
    emb = prompts(5, seed=4, lo=30, hi=80)
    alone = Engine.from_pretrained(path, num_kv_blocks=128)
    ref = [alone.embed([ids])[0] for ids in emb]
    together = alone.embed(emb)  # all in one batch
    chunked = Engine.from_pretrained(path, num_kv_blocks=128, max_num_batched_tokens=16)
    in_chunks = chunked.embed(emb)
    mixed_engine = Engine.from_pretrained(path, num_kv_blocks=128, max_num_batched_tokens=40)
    outs, shared = run_mixed(mixed_engine, prompts(4, seed=5, lo=10, hi=40), emb, 12)
    assert shared >= 3  # the embeddings really ran in steps with generation work
    for i, r in enumerate(ref):
        for other in (together[i], in_chunks[i], outs[f"e{i}"].embedding):
            assert other is not None
            assert cosine(r, other) == pytest.approx(1.0, abs=1e-5)
            assert other == pytest.approx(r, abs=ATOL)


def test_embeddings_leave_generation_unchanged(llama, st_engines):
    gen = prompts(6, seed=6, lo=5, hi=60)
    emb = prompts(6, seed=7, lo=5, hi=90)
    for seeded in (False, True):
        params = SamplingParams(max_tokens=16, ignore_eos=True,
                                temperature=0.8 if seeded else 0.0, seed=3 if seeded else None)  # fmt: skip
        alone = Engine.from_pretrained(llama, num_kv_blocks=128, max_num_batched_tokens=48)
        ref = [o.token_ids for o in alone.generate(gen, params)]
        engine = st_engines("mean", True)
        for i, ids in enumerate(gen):
            engine.add_request(f"g{i}", ids, params)
            engine.add_embedding(f"e{i}", emb[i])
        outs = {}
        while engine.has_unfinished():
            outs.update({o.request_id: o for o in engine.step()})
        assert [outs[f"g{i}"].token_ids for i in range(len(gen))] == ref
        for i, ids in enumerate(emb):
            out = outs[f"e{i}"]
            assert (out.finish_reason, out.token_ids, out.text) == ("stop", [], "")
            assert out.num_prompt_tokens == len(ids) and out.prompt_token_ids == ids
            assert out.embedding is not None
            ref_vec = hf_pooled(llama, ids, "mean", normalize=True)
            torch.testing.assert_close(torch.tensor(out.embedding), ref_vec, atol=ATOL, rtol=0)
        assert engine.block_manager.num_used_blocks == 0


def test_mean_pooling_never_reads_cached_blocks(llama, st_engines):
    """A prompt whose blocks a generation request left in the prefix cache:
    mean and CLS pooling need every (the first) position, so they compute them."""
    ids = prompts(1, seed=8, lo=70, hi=70)[0]
    for mode in ("mean", "cls"):
        engine = st_engines(mode, True)
        engine.generate([ids], SamplingParams(max_tokens=2, ignore_eos=True))
        assert engine.block_manager.find_cached_prefix(ids)  # the blocks are there to read
        vec = engine.embed([ids])[0]
        ref = hf_pooled(llama, ids, mode, normalize=True)
        torch.testing.assert_close(torch.tensor(vec), ref, atol=ATOL, rtol=0)


def test_last_token_pooling_reads_cached_blocks(llama):
    engine = Engine.from_pretrained(llama, num_kv_blocks=64)
    ids = prompts(1, seed=9, lo=70, hi=70)[0]
    engine.generate([ids], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_embedding("e", ids)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[0].num_cached_tokens == 64  # 4 of its 5 blocks came from the cache
    ref = hf_pooled(llama, ids, "last", normalize=True)
    torch.testing.assert_close(torch.tensor(outs[0].embedding), ref, atol=ATOL, rtol=0)


def test_abort_and_drain_embeddings(llama, st_engines):
    engine = st_engines("mean", True)
    ids = prompts(3, seed=10, lo=80, hi=90)
    for i, p in enumerate(ids):
        engine.add_embedding(f"e{i}", p)
    engine.step()  # the 48-token budget: e0 part computed, e1 and e2 wait
    aborted = engine.abort("e0")
    assert aborted is not None
    assert (aborted.finish_reason, aborted.embedding) == ("abort", None)
    drained = engine.drain()
    assert sorted(o.request_id for o in drained) == ["e1", "e2"]
    assert all(o.embedding is None and o.finish_reason == "abort" for o in drained)
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished()
    # drained embeddings simply run again from the start
    again = engine.embed(ids)
    for p, vec in zip(ids, again):
        ref = hf_pooled(llama, p, "mean", normalize=True)
        torch.testing.assert_close(torch.tensor(vec), ref, atol=ATOL, rtol=0)


def test_preempted_embedding_restarts_its_pooling(llama, tmp_path):
    path = st_checkpoint(llama, tmp_path / "model", "mean", normalize=False)
    # 12 blocks of 16 and 8 tokens a step: while the long embeddings are computed
    # chunk by chunk, the generations outgrow the pool and preempt them
    engine = Engine.from_pretrained(path, num_kv_blocks=12, max_num_batched_tokens=8)
    emb = prompts(2, seed=11, lo=90, hi=100)
    outs, _ = run_mixed(engine, prompts(2, seed=12, lo=20, hi=30), emb, 60)
    assert sum(outs[f"e{i}"].num_preemptions for i in range(len(emb))) > 0
    for i, ids in enumerate(emb):
        vec = outs[f"e{i}"].embedding
        assert vec is not None
        ref = hf_pooled(llama, ids, "mean", normalize=False)
        torch.testing.assert_close(torch.tensor(vec), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("modules", "pooling", "reason"),
    [
        (None, {"pooling_mode_max_tokens": True}, "pooling_mode_max_tokens is not supported"),
        (None, {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True},
         "exactly one pooling mode, found 2"),
        ([{"path": "2_Dense", "type": "sentence_transformers.models.Dense"}], None,
         "'sentence_transformers.models.Dense' is not supported"),
        ("not json", None, "modules.json: Expecting property name"),
    ],
)  # fmt: skip
def test_unsupported_st_config_refuses_embeddings_only(llama, tmp_path, modules, pooling, reason):
    path = st_checkpoint(llama, tmp_path / "model", "mean", normalize=False)
    if pooling is not None:
        (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if modules == "not json":
        (path / "modules.json").write_text("{")
    elif modules is not None:
        listed = json.loads((path / "modules.json").read_text())
        (path / "modules.json").write_text(json.dumps(listed + modules))
    engine = Engine.from_pretrained(path, num_kv_blocks=32)
    with pytest.raises(RequestRejected, match="this model cannot embed: .*" + reason):
        engine.embed(["hello"])
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3
