"""The systems a benchmark compares, each run the same way: load, warm up, time.

Each returns a dict with wall time, token counts and the generated ids, and
is meant to run alone in its own process (so peak RSS is its own).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.workloads import Workload


def run_batchgen(path: Path, wl: Workload, **engine_kwargs: Any) -> dict[str, Any]:
    """Also times the run's matmuls alone (benchmarks/matmul_floor.py), after the run."""
    from batchgen import Engine, SamplingParams
    from batchgen.worker.models.hf_backend import HfCausalLM
    from benchmarks.matmul_floor import matmul_floor_s, record_step_shapes

    engine = Engine.from_pretrained(path, **engine_kwargs)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in wl.max_tokens]
    engine.generate(wl.prompts[:4], params[:4])  # warm-up
    if engine.block_manager.enable_prefix_caching:
        engine.block_manager.cached.clear()  # no hits from the warm-up
    steps_before = engine.stats().num_steps
    shapes = record_step_shapes(engine)
    start = time.perf_counter()
    outputs = engine.generate(wl.prompts, params)
    wall = time.perf_counter() - start
    stats = engine.stats()
    model = engine.runner.model
    # the floor is timed on batchgen's own weights (None for MoE); the backend has none
    floor = None if isinstance(model, HfCausalLM) else matmul_floor_s(model, shapes)
    return {
        "wall_s": wall,
        **({} if floor is None else {"matmul_floor_s": floor}),
        "output_tokens": sum(len(o.token_ids) for o in outputs),
        "steps": stats.num_steps - steps_before,
        "preemptions": stats.num_preemptions,
        "prefix_cache_hit_rate": round(stats.prefix_cache_hit_rate, 3),
        "token_ids": [o.token_ids for o in outputs],
    }


def run_batchgen_transformers(path: Path, wl: Workload, **engine_kwargs: Any) -> dict[str, Any]:
    """batchgen's engine on transformers' own modules (``model_impl="transformers"``)."""
    return run_batchgen(path, wl, **engine_kwargs, model_impl="transformers")


def _hf_model(path: Path, attn: str = "sdpa", dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, dtype), attn_implementation=attn
        )
    except ValueError:  # no SDPA for this architecture (Gemma 2's soft-capping): eager
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, dtype), attn_implementation="eager"
        )
    model.eval()
    model.generation_config.eos_token_id = None  # EOS off: else generate fills in the config's
    return model


def run_hf_static(
    path: Path, wl: Workload, batch_size: int = 16, dtype: str = "float32"
) -> dict[str, Any]:
    """HF generate on static batches of 16, left padded; each batch runs to its longest output."""
    from transformers import GenerationConfig

    model = _hf_model(path, dtype=dtype)
    pad = 0

    def batch_generate(prompts: list[list[int]], max_new: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        config = GenerationConfig(
            max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=pad,
            eos_token_id=None,
        )  # fmt: skip
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, generation_config=config)
        return out[:, width:].tolist()

    batch_generate(wl.prompts[:2], 4)  # warm-up
    start = time.perf_counter()
    useful = 0
    token_ids: list[list[int]] = []
    for i in range(0, len(wl.prompts), batch_size):
        prompts = wl.prompts[i : i + batch_size]
        wants = wl.max_tokens[i : i + batch_size]
        outs = batch_generate(prompts, max(wants))
        token_ids += [o[:n] for o, n in zip(outs, wants)]
        useful += sum(wants)  # tokens past a request's own length are waste, not output
    return {"wall_s": time.perf_counter() - start, "output_tokens": useful, "token_ids": token_ids}


def run_hf_continuous(
    path: Path, wl: Workload, block_size: int = 16, dtype: str = "float32"
) -> dict[str, Any]:
    """HF's own continuous batching with a max_new_tokens per request."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = _hf_model(path, dtype=dtype)
    num_blocks = sum(-(-(len(p) + n) // block_size) for p, n in zip(wl.prompts, wl.max_tokens))
    cb_config = ContinuousBatchingConfig(
        block_size=block_size,
        num_blocks=num_blocks + 64,
        max_batch_tokens=2048,
        allow_block_sharing=False,  # keeps submission order
    )
    gen_config = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=512)

    def run(prompts: list[list[int]], lens: list[int]) -> list[list[int]]:
        results: dict[str, list[int]] = {}
        with model.continuous_batching_context_manager(
            generation_config=gen_config, continuous_batching_config=cb_config
        ) as manager:
            for i, (p, n) in enumerate(zip(prompts, lens)):
                manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
            while len(results) < len(prompts):
                out = manager.get_result(timeout=600)
                if out is None:
                    raise RuntimeError("HF continuous batching stopped early")
                if out.is_finished():
                    results[out.request_id] = list(out.generated_tokens)
        return [results[f"r{i}"] for i in range(len(prompts))]

    run(wl.prompts[:2], [4, 4])  # warm-up
    start = time.perf_counter()
    token_ids = run(wl.prompts, wl.max_tokens)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "output_tokens": sum(len(t) for t in token_ids), "token_ids": token_ids}


PEERS: dict[str, Callable[..., dict[str, Any]]] = {
    "batchgen": run_batchgen,
    "batchgen-transformers": run_batchgen_transformers,
    "hf-static": run_hf_static,
    "hf-continuous": run_hf_continuous,
}
