"""What handing back slid-out KV blocks saves on long generations.

    python benchmarks/sliding_window_bench.py            # toy mistral-v0.1 tiny, window 256

A model whose every layer slides (toy ``mistral-v0.1``: window 256, 4096
positions) generates long outputs (prompt 64, 4000 new tokens, greedy, EOS
off), once as batchgen runs it (blocks that left the window go back to the
pool after each step, ``worker/engine/kv_window.py``) and once with that
policy taken out (every block held to the end), alternating for --rounds.
Reported per run: the most KV blocks in use at once and their bytes, per
sequence, and output tok/s; the tokens of all runs must be identical.
Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run(model: Path, release: bool, num_seqs: int, prompt_len: int, new_tokens: int) -> dict:
    import torch

    from batchgen import Engine, SamplingParams
    from batchgen.worker.engine.runner.kv_cache import bytes_per_block

    pool = num_seqs * -(-(prompt_len + new_tokens) // 16)  # enough to hold everything
    engine = Engine.from_pretrained(model, num_kv_blocks=pool, max_num_seqs=num_seqs)
    if not release:
        engine.scheduler.sliding_release = None  # the policy taken out: blocks held to the end
    used: list[int] = []
    schedule = engine.scheduler.schedule

    def recording() -> Any:
        plan = schedule()
        used.append(engine.block_manager.num_used_blocks)
        return plan

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(0)
    vocab = engine.runner.model.config.vocab_size
    prompts = [torch.randint(16, vocab, (prompt_len,), generator=gen).tolist()
               for _ in range(num_seqs)]  # fmt: skip
    start = time.perf_counter()
    outputs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    wall = time.perf_counter() - start
    per_block = bytes_per_block(engine.runner.model.config, 16, torch.float32)
    return {
        "release": release,
        "peak_blocks": max(used),
        "peak_kv_mib": max(used) * per_block / 2**20,
        "peak_blocks_per_seq": max(used) / num_seqs,
        "output_tok_s": sum(len(o.token_ids) for o in outputs) / wall,
        "token_ids": [o.token_ids for o in outputs],
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", default="tiny")
    p.add_argument("--num-seqs", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()

    from batchgen.toy import TOY_WINDOW, write_toy_checkpoint

    model = write_toy_checkpoint(Path(tempfile.mkdtemp()) / "m", "mistral-v0.1", args.size)
    # alternating, so neither mode always runs first (compiles, warms caches)
    runs = [
        run(model, release, args.num_seqs, args.prompt_len, args.new_tokens)
        for _ in range(args.rounds)
        for release in (False, True)
    ]
    outputs = [r.pop("token_ids") for r in runs]
    on = [r for r in runs if r["release"]]
    off = [r for r in runs if not r["release"]]
    report = {
        "window": TOY_WINDOW,
        "sequence_tokens": args.prompt_len + args.new_tokens,
        "num_seqs": args.num_seqs,
        "runs": runs,
        "outputs_identical": all(o == outputs[0] for o in outputs),
        "kv_saved": 1 - on[0]["peak_blocks"] / off[0]["peak_blocks"],
        "output_tok_s_release": [round(r["output_tok_s"]) for r in on],
        "output_tok_s_held": [round(r["output_tok_s"]) for r in off],
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
