"""From logits to one token per request: penalties, greedy or seeded sampling.

Random draws use inverse-CDF sampling with one uniform number per token. For
a seeded request that number is a hash of (seed, position), so its output does
not depend on its batch mates, on preemption or on which worker ran it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.worker.engine.constrained import apply_masks
from batchgen.worker.engine.request import EngineRequest

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, position: int, sample_index: int = 0) -> float:
    """A uniform number in [0, 1) that depends only on (seed, position, sample)."""
    key = _splitmix64(_splitmix64(seed & _MASK64) ^ sample_index)
    bits = _splitmix64(key ^ position)
    return (bits >> 11) * (1.0 / (1 << 53))


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    # per row: {token id: logprob} for the top-k and the sampled token, or None
    logprobs: list[dict[int, float] | None]


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...], seed: int | None = None) -> None:
        self.eos_token_ids = eos_token_ids
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, requests: list[EngineRequest], masks: torch.Tensor | None = None
    ) -> SampleResult:
        """logits (num_requests, vocab) fp32, one row per request about to get a token;
        ``masks``: True where a constrained request may not take a token (``TokenMasks``).
        Logprobs are those of the model, before penalties and masks."""
        raw = logits
        if masks is None and not any(self._needs_processing(r) for r in requests):
            tokens = logits.argmax(dim=-1).tolist()
        else:
            logits = logits.clone()
            if masks is not None:
                apply_masks(logits, masks)
            self._apply_penalties(logits, requests)
            self._apply_logit_bias(logits, requests)
            self._suppress_stop_before_min_tokens(logits, requests)
            tokens = self._pick(logits, requests)
        return SampleResult(tokens, self._logprobs(raw, requests, tokens))

    @staticmethod
    def _needs_processing(r: EngineRequest) -> bool:
        p = r.params
        return (
            not p.greedy
            or p.has_penalties
            or p.logit_bias is not None
            or r.num_output_tokens < p.min_tokens
        )

    # -- logit processors -----------------------------------------------------
    def _apply_penalties(self, logits: torch.Tensor, requests: list[EngineRequest]) -> None:
        rows = [i for i, r in enumerate(requests) if r.params.has_penalties]
        if not rows:
            return
        vocab = logits.shape[1]
        for i in rows:
            r, p = requests[i], requests[i].params
            row = logits[i]
            dev = logits.device
            output = torch.tensor(r.output_token_ids, dtype=torch.long, device=dev)
            counts = torch.bincount(output, minlength=vocab)[:vocab].float()
            if p.repetition_penalty != 1.0:
                seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
                seen[torch.tensor(r.token_ids, dtype=torch.long, device=dev)] = True
                penalised = torch.where(
                    row > 0, row / p.repetition_penalty, row * p.repetition_penalty
                )
                row.copy_(torch.where(seen, penalised, row))
            if p.frequency_penalty:
                row -= p.frequency_penalty * counts
            if p.presence_penalty:
                row -= p.presence_penalty * (counts > 0).float()

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, requests: list[EngineRequest]) -> None:
        for i, r in enumerate(requests):
            pairs = r.params.bias_pairs
            if pairs:
                ids = torch.tensor([t for t, _ in pairs], device=logits.device)
                bias = torch.tensor([b for _, b in pairs], device=logits.device)
                logits[i].index_add_(0, ids, bias.to(logits.dtype))

    def _suppress_stop_before_min_tokens(
        self, logits: torch.Tensor, requests: list[EngineRequest]
    ) -> None:
        for i, r in enumerate(requests):
            p = r.params
            if r.num_output_tokens < p.min_tokens:
                stops = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
                if stops:
                    logits[i, stops] = float("-inf")

    # -- choice ---------------------------------------------------------------
    def _pick(self, logits: torch.Tensor, requests: list[EngineRequest]) -> list[int]:
        tokens = logits.argmax(dim=-1)
        rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if rows:
            index = torch.tensor(rows, device=logits.device)
            probs = self._filtered_probs(logits[index], [requests[i] for i in rows])
            uniforms = torch.tensor(
                [self._uniform(requests[i]) for i in rows],
                dtype=torch.float64,
                device=logits.device,
            )
            cdf = probs.double().cumsum(dim=-1)  # (rows, vocab), vocab order
            targets = (uniforms * cdf[:, -1]).unsqueeze(1)
            picked = torch.searchsorted(cdf, targets, right=True).squeeze(1)
            tokens[index] = picked.clamp_(max=logits.shape[1] - 1)
        return tokens.tolist()

    def _uniform(self, r: EngineRequest) -> float:
        if r.params.seed is None:
            return float(torch.rand((), generator=self.generator, dtype=torch.float64))
        # position of the token being drawn: the same after preemption or resumption
        return seeded_uniform(r.params.seed, r.num_tokens, r.sample_index)

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, requests: list[EngineRequest]) -> torch.Tensor:
        """Temperature, top-k, top-p and min-p; returns (rows, vocab) probabilities."""
        dev = logits.device
        temps = torch.tensor([r.params.temperature for r in requests], device=dev).unsqueeze(1)
        logits = logits / temps
        top_ks = [r.params.top_k for r in requests]
        if any(top_ks):
            vocab = logits.shape[1]
            k = torch.tensor([t if 0 < t < vocab else vocab for t in top_ks], device=dev)
            k = k.unsqueeze(1)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, k - 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        top_ps = torch.tensor([r.params.top_p for r in requests], device=dev).unsqueeze(1)
        if (top_ps < 1).any():
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
            drop_sorted = before >= top_ps  # the top token always stays
            drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        min_ps = torch.tensor([r.params.min_p for r in requests], device=dev).unsqueeze(1)
        if (min_ps > 0).any():
            threshold = probs.max(dim=-1, keepdim=True).values * min_ps
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, requests: list[EngineRequest], tokens: list[int]
    ) -> list[dict[int, float] | None]:
        out: list[dict[int, float] | None] = [None] * len(requests)
        rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        if not rows:
            return out
        logp = torch.log_softmax(raw[torch.tensor(rows, device=raw.device)], dim=-1)
        for j, i in enumerate(rows):
            k = requests[i].params.logprobs or 0
            entry: dict[int, float] = {}
            if k:
                values, ids = logp[j].topk(k)
                entry = dict(zip(ids.tolist(), values.tolist()))
            entry[tokens[i]] = float(logp[j, tokens[i]])
            out[i] = entry
        return out
