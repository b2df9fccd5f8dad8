"""When a request is done: EOS, stop token ids, stop strings, max_tokens, context."""

from __future__ import annotations

from batchgen.worker.engine.request import EngineFinishReason, EngineRequest


def stop_reason(
    req: EngineRequest, eos_token_ids: tuple[int, ...], max_model_len: int
) -> EngineFinishReason | None:
    """Checked after each new token; None while the request goes on.

    EOS and stop token ids count only once min_tokens are out; a stop string
    cuts the text before it (``req.stop_text``) and keeps the token ids. A
    constrained request also stops where its grammar ends.
    """
    p = req.params
    token = req.token_ids[-1]
    if req.num_output_tokens >= p.min_tokens:
        if not p.ignore_eos and token in eos_token_ids:
            return EngineFinishReason.STOP
        if token in p.stop_token_ids:
            return EngineFinishReason.STOP
    if req.stop_matcher is not None:
        cut = req.stop_matcher.feed(req.output_token_ids)
        if cut is not None:
            req.stop_text = cut
            return EngineFinishReason.STOP
    if req.matcher is not None and req.matcher.is_stopped():
        return EngineFinishReason.STOP  # the constraint is complete and cannot go on
    limit = p.max_tokens  # set when the request was added (admission.check_fits)
    if (limit is not None and req.num_output_tokens >= limit) or req.num_tokens >= max_model_len:
        return EngineFinishReason.LENGTH
    return None
