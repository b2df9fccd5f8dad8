"""What the engine hands back: a finished (or aborted) request's output, and its
counters (``Engine.stats()``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchgen.worker.engine.request import EngineFinishReason, EngineRequest, RequestOutput, Sample


@dataclass(slots=True)
class EngineStats:
    num_steps: int
    prompt_tokens: int  # prompt tokens of admitted requests
    generation_tokens: int
    num_preemptions: int
    prefix_cache_hit_rate: float  # cached prompt tokens / prompt tokens
    kv_usage: float  # used blocks / all blocks
    num_running: int
    num_waiting: int
    cuda_graph_replays: int  # decode steps replayed from a captured CUDA graph


def build_output(request_id: str, samples: list[EngineRequest], tokenizer: Any) -> RequestOutput:
    """One output for a request's n samples; the top-level fields are the first's."""
    done = []
    for s in samples:
        text = s.stop_text
        if text is None:
            text = tokenizer.decode(
                s.output_token_ids, skip_special_tokens=s.params.skip_special_tokens
            )
        reason = s.finish_reason or EngineFinishReason.ABORT
        done.append(Sample(s.output_token_ids, text, reason.value, s.logprobs))
    first = samples[0]
    return RequestOutput(
        request_id=request_id,
        prompt_token_ids=first.token_ids[: first.num_prompt_tokens],
        token_ids=done[0].token_ids,
        text=done[0].text,
        finish_reason=done[0].finish_reason,
        num_prompt_tokens=first.num_prompt_tokens,
        num_cached_tokens=first.num_cached_tokens,
        num_preemptions=sum(s.num_preemptions for s in samples),
        logprobs=done[0].logprobs,
        samples=done,
        embedding=first.embed.vector if first.embed is not None else None,
    )
