"""batchgen's greedy tokens in bf16 against HF transformers in bf16 and in fp32.

    python benchmarks/bf16_agreement.py --model DIR --num-requests 16 --max-tokens 64

batchgen generates the "mixed" workload's prompts greedily (EOS off, each
request ``--max-tokens`` long) in bfloat16 and in float32. Each output is then
scored by HF transformers (SDPA) in one forward over prompt + output: at every
position HF's greedy choice given batchgen's own prefix, so one difference does
not drag every later token along with it. A position agrees when batchgen's
token is HF's argmax; a difference is a near-tie when HF's logit for batchgen's
token is within ``--tie`` of its top logit (bf16 rounds a logit of size ~10 by
~0.06, so two engines' sums in different orders may pick either of two tokens
that close). Reports, for each (batchgen dtype, HF dtype) pair: positions,
agreement rate, differences, those that are near-ties, and the largest gap.
Prints JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def generate(model: Path, prompts: list[list[int]], n: int, dtype: str) -> list[list[int]]:
    from batchgen import Engine, SamplingParams

    engine = Engine.from_pretrained(model, dtype=dtype)
    params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
    return [o.token_ids for o in engine.generate(prompts, [params] * len(prompts))]


def score(model: Any, prompts: list[list[int]], outs: list[list[int]], tie: float) -> dict:
    import torch

    positions = agree = ties = 0
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt + out])
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # predicts out[i]
        chosen = torch.tensor(out)
        top = logits.max(dim=-1).values
        gap = top - logits.gather(1, chosen[:, None])[:, 0]  # 0 where batchgen took HF's top
        differs = logits.argmax(dim=-1) != chosen
        positions += len(out)
        agree += int((~differs).sum())
        ties += int((differs & (gap <= tie)).sum())
        worst = max(worst, float(gap.max()))
    return {
        "positions": positions,
        "agreement": round(agree / positions, 4),
        "differences": positions - agree,
        "near_ties": ties,
        "largest_gap": round(worst, 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--vocab", type=int, default=None, help="ids drawn below (default: config)")
    p.add_argument("--tie", type=float, default=0.125, help="logit gap that counts as a tie")
    args = p.parse_args()
    importlib.import_module("batchgen")  # before torch, as the worker has it
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.workloads import mixed

    model = Path(args.model)
    vocab = args.vocab or AutoConfig.from_pretrained(model).vocab_size
    prompts = mixed(args.num_requests, vocab).prompts
    report: dict[str, Any] = {"model": str(model), "tie": args.tie, "pairs": {}}
    with torch.inference_mode():
        outs = {d: generate(model, prompts, args.max_tokens, d) for d in ("bfloat16", "float32")}
        same = sum(a == b for a, b in zip(outs["bfloat16"], outs["float32"]))
        report["batchgen_bf16_vs_fp32_requests_identical"] = f"{same}/{len(prompts)}"
        for hf_dtype in ("bfloat16", "float32"):
            hf = AutoModelForCausalLM.from_pretrained(
                model, dtype=getattr(torch, hf_dtype), attn_implementation="sdpa"
            ).eval()
            for ours, ids in outs.items():
                report["pairs"][f"batchgen {ours} vs HF {hf_dtype}"] = score(
                    hf, prompts, ids, args.tie
                )
            del hf
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
