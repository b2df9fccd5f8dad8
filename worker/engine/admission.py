"""Whether a request can ever run on this engine: checked once, when it is added."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from batchgen.worker.engine.request import RequestRejected
from batchgen.worker.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Capacity:
    """What bounds a request here: the vocabulary, the context and the KV pool."""

    vocab_size: int
    max_model_len: int
    blocks_needed: Callable[[int], int]  # tokens -> the most KV blocks such a request holds
    num_blocks: int


def check_fits(
    cap: Capacity,
    request_id: str,
    prompt: list[int],
    resumed: list[int],
    params: SamplingParams,
    generates: bool = True,
) -> None:
    if not prompt:
        raise RequestRejected(request_id, "the prompt is empty")
    vocab = cap.vocab_size
    if any(t < 0 or t >= vocab for t in prompt + resumed):
        raise RequestRejected(request_id, f"token ids must be in [0, {vocab})")
    if not generates:
        total = len(prompt)
        if total > cap.max_model_len:
            raise RequestRejected(
                request_id,
                f"the input ({total} tokens) exceeds the model's context of "
                f"{cap.max_model_len} tokens",
            )
    else:
        total = len(prompt) + params.max_tokens
        if total > cap.max_model_len:
            raise RequestRejected(
                request_id,
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{total} exceeds the model's context of {cap.max_model_len} tokens",
            )
    blocks = cap.blocks_needed(total)
    if blocks > cap.num_blocks:
        raise RequestRejected(
            request_id,
            f"needs {blocks} KV blocks but the pool has {cap.num_blocks}; "
            "give the engine more KV cache memory",
        )
    if generates and len(resumed) >= params.max_tokens:
        raise RequestRejected(request_id, "resumed tokens already reach max_tokens")
    if resumed and params.n > 1:
        raise RequestRejected(request_id, "only a request with n = 1 resumes from tokens")
    outside = [t for t, _ in params.bias_pairs if t >= vocab]
    if outside:
        raise RequestRejected(
            request_id,
            f"logit_bias token id {outside[0]} is outside the vocabulary [0, {vocab})",
        )
