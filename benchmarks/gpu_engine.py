"""gpu_check section 5: batchgen's engine against HF continuous batching on a
random Llama-3.2-1B-shaped bf16 checkpoint, and the engine on the same checkpoint
quantized to block-wise FP8 (``quant_method: fp8``, 128 x 128 blocks, as
DeepSeek-V3 and the Qwen3 -FP8 releases store it) on its Triton ops, whose
projections then run the w8a8 GEMM (``kernels/triton/fp8_gemm.py``)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
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
        hf = (
            hf_continuous_batching(model_dir, prompts, s.max_new_tokens, b.device, *sized)
            if b.device.type != "cpu" or importlib.util.find_spec("psutil")
            # transformers sizes its CPU cache from psutil's figures, 0 bytes without it
            else {"skipped": "psutil absent: transformers sizes its CPU cache from it"}
        )
        ours = engine_throughput(model_dir, prompts, s.max_new_tokens, b.device)
        block = (32, 32) if s is DRY_RUN else (128, 128)
        fp8_dir = write_fp8_block(model_dir, Path(tmp) / "fp8", block)
        fp8 = engine_throughput(fp8_dir, prompts, s.max_new_tokens, b.device, use_triton=True)
    speedup = ours["output_tok_s"] / hf["output_tok_s"] if "output_tok_s" in hf else None
    return {
        "hf_continuous_batching": hf,
        "engine": ours,
        "engine_fp8_block": fp8,
        "speedup": speedup,
        "target_met": None if speedup is None else speedup >= TARGET_SPEEDUP,
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


PROJECTION = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")


def write_fp8_block(src: Path, out: Path, block: tuple[int, int]) -> Path:
    """``src`` with every decoder projection stored as block FP8: ``weight`` e4m3 (N, K) and
    ``weight_scale_inv`` fp32, amax / 448 per (bn, bk) block (the last blocks partial)."""
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    tensors: dict[str, Any] = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not PROJECTION.match(name):
            tensors[name] = w
            continue
        (n, k), (bn, bk) = w.shape, block
        grid = (math.ceil(n / bn), math.ceil(k / bk))
        padded = torch.zeros(grid[0] * bn, grid[1] * bk)
        padded[:n, :k] = w.float()
        blocks = padded.view(grid[0], bn, grid[1], bk)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        q = (blocks / scale[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        tensors[name] = q.view(grid[0] * bn, grid[1] * bk)[:n, :k].contiguous()
        tensors[name.removesuffix(".weight") + ".weight_scale_inv"] = scale
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for file in src.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name != "config.json":
            (out / file.name).write_bytes(file.read_bytes())
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


def engine_throughput(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int, device: Any,
    use_triton: bool | None = None,
) -> dict[str, Any]:  # fmt: skip
    """batchgen's engine on the same workload: greedy, EOS ignored, bf16, Triton
    kernels and CUDA-graph decode on a GPU (the references on the dry run, unless
    ``use_triton``: then the Triton ops, under the interpreter there)."""
    import torch

    from batchgen import Engine, SamplingParams
    from batchgen.worker.models.quant import QuantizedLinear

    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()  # the HF peer's weights and cache are gone by now
    t_load = time.perf_counter()
    engine = Engine.from_pretrained(
        model_dir, device=str(device), dtype="bfloat16", max_num_seqs=256,
        num_kv_blocks=None if str(device).startswith("cuda") else 256, use_triton=use_triton,
        # the interpreter's warm-up prefill at the CPU default of 2048 tokens takes a minute
        max_num_batched_tokens=64 if use_triton and not str(device).startswith("cuda") else None,
    )  # fmt: skip
    weights = getattr(engine.runner.model, "weights", None)
    layers = getattr(weights, "layers", [])
    quantized = [p for x in layers for p in (x.attention.qkv, x.attention.o, x.mlp.up, x.mlp.down)
                 if isinstance(p, QuantizedLinear)]  # fmt: skip
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
        # projections held quantized, and those of them on the op set's GEMMs
        "quantized_projections": len(quantized),
        "on_quant_gemms": sum(p.kernels is not None for p in quantized),
        "quantized_mib": sum(p.nbytes for p in quantized) / 2**20,
    }  # fmt: skip
