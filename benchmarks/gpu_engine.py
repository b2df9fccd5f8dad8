"""gpu_check section 3: batchgen's engine against HF continuous batching on a
random Llama-3.2-1B-shaped bf16 checkpoint."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_bench import DRY_RUN, TARGET_SPEEDUP, Bench


def engine(b: Bench) -> dict[str, Any]:
    try:
        from batchgen import Engine  # noqa: F401  (the engine issue's entry point)
    except ImportError as exc:
        return {"engine": "not available on this branch", "reason": repr(exc)}
    from batchgen.toy import write_toy_checkpoint
    from batchgen.toy.checkpoint import ToySize

    s = b.shapes
    # Llama-3.2-1B's shape (head_dim 64, tied embeddings); a small tokenizer is
    # enough since prompts are random token ids.
    size = ToySize(2048, 16, 32, 8, 8192, 128256, 8192, tokenizer_vocab_size=8192)
    if s is DRY_RUN:
        size = ToySize(64, 2, 4, 2, 128, 512, 1024, tokenizer_vocab_size=512)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_toy_checkpoint(tmp, arch="llama", size=size, dtype="bfloat16")
        gen = b.torch.Generator().manual_seed(0)
        lens = b.torch.randint(*s.prompt_lens, (s.num_prompts,), generator=gen).tolist()
        vocab = size.tokenizer_vocab_size or size.vocab_size
        prompts = [b.torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]
        # HF sizes its paged cache and a max_batch_tokens-square attention mask from free
        # memory; on the dry run: gigabytes filled for 16 tokens, 29 s of system time
        sized = (16, 64) if s is DRY_RUN else (None, None)
        hf = hf_continuous_batching(model_dir, prompts, s.max_new_tokens, b.device, *sized)
        ours = engine_throughput(model_dir, prompts, s.max_new_tokens, b.device)
    return {
        "hf_continuous_batching": hf,
        "engine": ours,
        "speedup": ours["output_tok_s"] / hf["output_tok_s"],
        "target_met": ours["output_tok_s"] >= TARGET_SPEEDUP * hf["output_tok_s"],
    }


def hf_continuous_batching(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int, device: Any,
    num_blocks: int | None = None, max_batch_tokens: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """HF transformers' generate_batch on the workload: greedy, EOS ignored.

    generate_batch warms up (captures CUDA graphs) inside every call, before it
    admits the requests, so the rate is measured from the first request's
    creation to the last one's end, not over the whole call. ``num_blocks`` and
    ``max_batch_tokens`` size its cache; None: HF infers them from free memory.
    """
    import torch
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)
    batching = ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)
    model.generate_batch(inputs=prompts[:4], generation_config=config,
                         continuous_batching_config=batching)  # compile, allocate  # fmt: skip
    t0 = time.perf_counter()
    outputs = list(model.generate_batch(inputs=prompts, generation_config=config,
                                        continuous_batching_config=batching).values())  # fmt: skip
    wall = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in outputs)
    window = max(o.lifespan[1] for o in outputs) - min(o.created_time for o in outputs)
    errors = [o.error for o in outputs if o.error is not None]
    return {
        "requests": len(outputs), "errors": errors[:3], "output_tokens": tokens,
        "seconds": window, "wall_seconds": wall, "output_tok_s": tokens / window,
    }  # fmt: skip


def engine_throughput(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int, device: Any
) -> dict[str, Any]:
    """batchgen's engine on the same workload: greedy, EOS ignored, bf16, Triton
    kernels and CUDA-graph decode on a GPU (the references on the dry run)."""
    import torch

    from batchgen import Engine, SamplingParams

    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()  # the HF peer's weights and cache are gone by now
    t_load = time.perf_counter()
    engine = Engine.from_pretrained(
        model_dir, device=str(device), dtype="bfloat16", max_num_seqs=256,
        num_kv_blocks=None if str(device).startswith("cuda") else 256,
    )  # fmt: skip
    load_s = time.perf_counter() - t_load
    params = SamplingParams(max_tokens=max_new_tokens, ignore_eos=True)
    engine.generate(prompts[:4], params)  # compile the kernels outside the timing
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outputs = engine.generate(prompts, params)
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outputs)
    stats = engine.stats()
    return {
        "requests": len(outputs), "output_tokens": tokens, "seconds": wall,
        "output_tok_s": tokens / wall, "load_seconds": load_s, "ops": engine.runner.model.ops.name,
        "cuda_graphs": engine.runner.graphs is not None, "num_kv_blocks": engine.limits.num_kv_blocks,
        "steps": stats.num_steps, "preemptions": stats.num_preemptions,
        "cuda_graph_replays": stats.cuda_graph_replays,
    }  # fmt: skip
