"""Whether a request can ever run on this engine: checked once, when it is added."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from batchgen.worker.engine.sampling_params import SamplingParams
from batchgen.worker.worker_errors import RequestRejected


@dataclass(frozen=True, slots=True)
class Capacity:
    """What bounds a request here: the vocabulary, the context and the KV pool."""

    vocab_size: int
    max_model_len: int
    blocks_needed: Callable[[int], int]  # tokens -> the most KV blocks such a request holds
    num_blocks: int


def longest_request(cap: Capacity) -> int:
    """The most tokens (prompt and output) one request can hold here: the context, or
    less when the KV pool holds less."""
    low, high = 0, cap.max_model_len
    while low < high:  # blocks_needed grows with the tokens
        mid = (low + high + 1) // 2
        low, high = (mid, high) if cap.blocks_needed(mid) <= cap.num_blocks else (low, mid - 1)
    return low


def check_fits(
    cap: Capacity,
    request_id: str,
    prompt: list[int],
    resumed: list[int],
    params: SamplingParams,
    generates: bool = True,
) -> SamplingParams:
    """``params`` as the request runs with them (max_tokens None: what is left of the
    longest request after the prompt), or RequestRejected when it can never run here."""
    if generates and params.max_tokens is None:
        room = max(longest_request(cap) - len(prompt), 1)
        params = dataclasses.replace(params, max_tokens=room)
    max_tokens = params.max_tokens or 0  # set for every request that generates
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
        total = len(prompt) + max_tokens
        if total > cap.max_model_len:
            raise RequestRejected(
                request_id,
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) = "
                f"{total} exceeds the model's context of {cap.max_model_len} tokens",
            )
    blocks = cap.blocks_needed(total)
    if blocks > cap.num_blocks:
        raise RequestRejected(
            request_id,
            f"needs {blocks} KV blocks but the pool has {cap.num_blocks}; "
            "give the engine more KV cache memory",
        )
    if generates and len(resumed) >= max_tokens:
        raise RequestRejected(request_id, "resumed tokens already reach max_tokens")
    if resumed and params.n > 1:
        raise RequestRejected(request_id, "only a request with n = 1 resumes from tokens")
    outside = [t for t, _ in params.bias_pairs if t >= vocab]
    if outside:
        raise RequestRejected(
            request_id,
            f"logit_bias token id {outside[0]} is outside the vocabulary [0, {vocab})",
        )
    return params
