"""HF transformers as the oracle: greedy generations and teacher-forced logits."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

# fp32 logits of two different tokens closer than this are a near tie: summation
# order alone may decide greedy between them (HF and the engine sum differently)
TIE_MARGIN = 1e-4
# transformers' attention as each model's code writes it out: its default (SDPA) may skip
# a step the model has (5.17's Gemma 2 under SDPA drops the attention soft-cap)
EAGER = "eager"


@functools.lru_cache(maxsize=8)
def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=EAGER
    )
    model.eval()
    return model


def hf_logits(path: Path, token_ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """(len, vocab) logits of one forward over token_ids, or of forwards over
    ``chunk`` tokens at a time through transformers' own cache (a recurrent
    model's chunked prefill: the same sums in the same order as batchgen's)."""
    from transformers import DynamicCache

    model = hf_model(path)
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        if chunk is None:
            return model(ids).logits[0].float()
        cache = DynamicCache(config=model.config)
        parts = [
            model(ids[:, s : s + chunk], cache=cache, use_cache=True,
                  position_ids=torch.arange(s, min(s + chunk, ids.shape[1]))[None]).logits[0]
            for s in range(0, ids.shape[1], chunk)
        ]  # fmt: skip
        return torch.cat(parts).float()


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int, stop_at_eos: bool) -> list[int]:
    """HF generate, one prompt at a time (no padding in play)."""
    from transformers import GenerationConfig

    model = hf_model(path)
    # transformers fills EOS in from the model's generation config: clear it to ignore EOS
    eos = model.generation_config.eos_token_id if stop_at_eos else None
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0
    )
    saved = model.generation_config.eos_token_id
    if not stop_at_eos:
        model.generation_config.eos_token_id = None
    try:
        with torch.no_grad():
            ids = torch.tensor([prompt])
            # explicit mask: generate would otherwise mask prompt tokens equal to pad_token_id
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    finally:
        model.generation_config.eos_token_id = saved
    return out[0, len(prompt) :].tolist()


def first_divergence_is_tie(path: Path, prompt: list[int], ref: list[int], got: list[int]) -> bool:
    """True when the first differing token is a near tie in HF's own logits."""
    i = next(i for i, (a, b) in enumerate(zip(ref, got)) if a != b)
    logits = hf_logits(path, prompt + ref[:i])[-1]
    top2 = logits.topk(2).values
    return float(top2[0] - top2[1]) < TIE_MARGIN and float(logits[got[i]]) >= float(top2[1])


@functools.lru_cache(maxsize=4)
def hf_base_model(path: Path):
    """The model without its LM head (``AutoModel``), as sentence-transformers loads it."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32, attn_implementation=EAGER)
    model.eval()
    return model


def hf_last_hidden_state(path: Path, token_ids: list[int]) -> torch.Tensor:
    """(len, hidden) ``last_hidden_state`` (after the final norm) of one forward."""
    with torch.no_grad():
        return hf_base_model(path)(torch.tensor([token_ids])).last_hidden_state[0].float()
