"""Quantized checkpoints on the CPU: resident weight bytes, decode speed and error against fp32.

    python benchmarks/quant_bench.py                     # the "small" toy llama (~100M)
    python benchmarks/quant_bench.py --size tiny --tokens 16
    python benchmarks/quant_bench.py --tokens 16 --only int8   # fp32 and the rows named *int8*

Writes the toy llama (``batchgen.toy``), then the same weights as block-wise FP8
(128 x 128, DeepSeek-V3's layout), compressed-tensors W4A16 (group 128) and W8A8 int8
(per channel, dynamic per-token int8 activations; both written by the
compressed-tensors library) and GPTQ (group 128, act-order) with the test
suite's writers (``tests/quant_checkpoints.py``), and the fp32 checkpoint quantized
at load (``quantization="fp8"`` or ``"int8"``, ``--quantization``). For each: the bytes the native
decoder's weights hold after load (every tensor it keeps, each storage once), the
bytes of its decoder projections against the same projections in bf16, and greedy
decode throughput of ``--prompts`` prompts of 16 tokens for ``--tokens`` new tokens
each (one warm-up call first), and its error against the fp32 checkpoint: the
largest and mean |logit error| over the teacher-forced positions of one 64-token
prompt, and greedy agreement, the share of fp32's generated tokens each output
repeats before it first differs. Prints JSON, then a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def held_bytes(weights: Any) -> int:
    """Bytes of every tensor reachable from the decoder's weights, each storage once."""
    import torch

    seen: dict[int, int] = {}

    def walk(obj: object) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.is_mkldnn:  # a weight packed for oneDNN: no storage to ask
                seen[id(obj)] = obj.numel() * obj.element_size()
            elif obj.device.type != "meta":
                seen[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item)
        elif dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name))

    walk(weights)
    return sum(seen.values())


def measure(
    name: str, path: Path, prompts: int, tokens: int, **settings: Any
) -> tuple[dict[str, Any], list[list[int]], Any]:
    """The row of one checkpoint, its greedy outputs and its logits of the probe prompt."""
    from batchgen import Engine, SamplingParams
    from batchgen.worker.models.quant import QuantizedLinear
    from tests.family_parity import engine_prompt_logits

    engine = Engine.from_pretrained(path, device="cpu", num_kv_blocks=256, **settings)
    weights = engine.runner.model.weights  # type: ignore[attr-defined]
    projections = [
        p for layer in weights.layers
        for p in (layer.attention.qkv, layer.attention.o, layer.mlp.up, layer.mlp.down)
    ]  # fmt: skip
    elements = sum(p.weight.shape[0] * p.weight.shape[1] for p in projections)
    held = sum(p.nbytes if isinstance(p, QuantizedLinear) else held_bytes(p) for p in projections)
    batch = [[3 + (i * 7 + j) % 200 for j in range(16)] for i in range(prompts)]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    engine.generate(batch[:1], SamplingParams(max_tokens=2, ignore_eos=True))
    start = time.perf_counter()
    outputs = [o.token_ids for o in engine.generate(batch, params)]
    seconds = time.perf_counter() - start
    probe = [3 + (i * 13) % 500 for i in range(64)]
    row = {
        "checkpoint": name,
        "weights_held_mb": round(held_bytes(weights) / 2**20, 2),
        "projections_mb": round(held / 2**20, 2),
        "projections_bf16_mb": round(2 * elements / 2**20, 2),
        "projections_vs_bf16": round(held / (2 * elements), 3),
        "decode_tok_s": round(prompts * tokens / seconds, 1),
    }
    return row, outputs, engine_prompt_logits(engine, probe)[0]


def against(row: dict[str, Any], outputs: list[list[int]], logits: Any,
            fp32: tuple[dict[str, Any], list[list[int]], Any]) -> dict[str, Any]:  # fmt: skip
    """The row with its error against the fp32 checkpoint's logits and greedy tokens."""
    error = (logits - fp32[2]).abs()
    shared = 0
    for ours, theirs in zip(outputs, fp32[1]):
        differ = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
        shared += differ[0] if differ else len(theirs)
    return {
        **row,
        "logit_error_max": round(float(error.max()), 4),
        "logit_error_mean": round(float(error.mean()), 5),
        "fp32_logit_std": round(float(fp32[2].std()), 3),
        "greedy_agreement": round(shared / sum(len(t) for t in fp32[1]), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", help="a batchgen.toy size (tiny, small)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument(
        "--only", help="comma-separated parts of the rows' names to measure (fp32 always is)"
    )
    args = parser.parse_args()

    from batchgen.toy import write_toy_checkpoint
    from tests.quant_checkpoints import compress, quantize_fp8_block, quantize_gptq

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        plain = write_toy_checkpoint(root / "fp32", "llama", args.size)
        # each written only when measured
        checkpoints: dict[str, tuple[Callable[[], Path], dict[str, Any]]] = {
            "fp32": (lambda: plain, {}),
            "fp32 + --quantization fp8": (lambda: plain, {"quantization": "fp8"}),
            "fp32 + --quantization int8": (lambda: plain, {"quantization": "int8"}),
            "fp8 block 128x128": (lambda: quantize_fp8_block(plain, root / "fp8", (128, 128)), {}),
            "compressed-tensors w4a16 g128": (lambda: compress(plain, root / "w4", "w4a16-g128"), {}),
            "compressed-tensors w8a8 int8": (lambda: compress(plain, root / "w8a8", "w8a8-int8"), {}),
            "gptq 4-bit g128 act-order": (lambda: quantize_gptq(
                plain, root / "gptq", root / "gptq-plain", group=128, act_order=True
            )[0], {}),
        }  # fmt: skip
        only = [w for w in (args.only or "").split(",") if w]
        measured = [
            measure(n, write(), args.prompts, args.tokens, **settings)
            for n, (write, settings) in checkpoints.items()
            if n == "fp32" or not only or any(w in n for w in only)
        ]
        results = [measured[0][0]] + [against(*m, measured[0]) for m in measured[1:]]
    print(json.dumps(results, indent=1))
    for r in results:
        print(
            f"{r['checkpoint']:32} held {r['weights_held_mb']:8.2f} MB  projections "
            f"{r['projections_mb']:8.2f} MB = {r['projections_vs_bf16']:.3f} of bf16 "
            f"({r['projections_bf16_mb']:.2f} MB)  decode {r['decode_tok_s']:7.1f} tok/s"
            + (f"  logit error max {r['logit_error_max']} mean {r['logit_error_mean']} greedy "
               f"agreement {r['greedy_agreement']}" if "logit_error_max" in r else "")
        )  # fmt: skip


if __name__ == "__main__":
    main()
