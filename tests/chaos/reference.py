"""The fault-free run a fault test compares with: ``Engine.generate`` on the same
lines, greedy, one thread (as the workers run), and how to follow a near tie.

Two runs batch differently (a roomy pool of 64 against a storm of preemptions, one
sequence against many), so fp32 sums differ in the last bits and, where two tokens'
logits are closer than that, greedy may pick either. ``Reference.through_tie``
accepts such a divergence only when it is proven: HF's own fp32 logits put both
tokens on top within ``TIE_MARGIN``; then the row must equal the engine resuming
the request from the run's side of the tie.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class Reference:
    token_ids: list[list[int]]
    texts: list[str]
    # (row, the tokens a run got) -> (tokens, text) of the fault-free run made to take
    # the run's side of the row's first divergence; None unless that is a proven near tie
    through_tie: Callable[[int, list[int]], tuple[list[int], str] | None]


def sampling(line: dict) -> dict:
    """A native line's sampling fields (job defaults are greedy, max_tokens 16)."""
    return {k: v for k, v in line.items() if k not in ("id", "prompt", "metadata")}


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """As the workers run (OMP_NUM_THREADS=1)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def fault_free(engine: Any, model: Path, lines: list[dict]) -> Reference:
    """The lines through ``engine`` (loaded from ``model``) with no fault at all."""
    from batchgen import SamplingParams

    params = [SamplingParams(**{"max_tokens": 16, **sampling(line)}) for line in lines]
    with one_thread():
        outs = engine.generate([line["prompt"] for line in lines], params)
    prompts = [list(o.prompt_token_ids) for o in outs]
    token_ids = [list(o.token_ids) for o in outs]

    def through_tie(i: int, got: list[int]) -> tuple[list[int], str] | None:
        return _through_tie(engine, model, prompts[i], params[i], token_ids[i], got)

    return Reference(token_ids, [o.text for o in outs], through_tie)


def _through_tie(
    engine: Any, model: Path, prompt: list[int], params: Any, ref: list[int], got: list[int]
) -> tuple[list[int], str] | None:
    from tests.hf_reference import first_divergence_is_tie

    if not any(a != b for a, b in zip(ref, got)):
        return None  # one stopped earlier: a length, not a tie
    # both ways round: the margin is under TIE_MARGIN and each token is one of the top two
    if not (first_divergence_is_tie(model, prompt, ref, got)
            and first_divergence_is_tie(model, prompt, got, ref)):  # fmt: skip
        return None
    split = next(i for i, (a, b) in enumerate(zip(ref, got)) if a != b) + 1
    rid = f"through-tie-{len(prompt)}-{split}-{got[split - 1]}"
    with one_thread():  # as a worker resumes a handed-back request
        engine.add_request(rid, prompt, params, resume_token_ids=got[:split])
        while True:
            for out in engine.step():
                if out.request_id == rid:
                    return list(out.token_ids), out.text
