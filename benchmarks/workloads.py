"""Seeded synthetic workloads shared by the benchmarks: random token ids, greedy, EOS off."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    @property
    def max_len(self) -> int:
        return max(len(p) + n for p, n in zip(self.prompts, self.max_tokens))


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    # skip the low ids, where the toy tokenizers keep their special tokens
    return [rng.randrange(16, vocab) for _ in range(n)]


def mixed(num_requests: int, vocab: int, seed: int = 0) -> Workload:
    """Prompts uniform 16..256 tokens; outputs 70% uniform 16..64, 30% uniform 256..512."""
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(num_requests):
        prompts.append(_ids(rng, rng.randint(16, 256), vocab))
        outs.append(rng.randint(16, 64) if rng.random() < 0.7 else rng.randint(256, 512))
    return Workload("mixed", prompts, outs)


def shared_prefix(num_requests: int, vocab: int, seed: int = 0, prefix_len: int = 512) -> Workload:
    """Every prompt is one 512-token prefix plus 16..64 tokens of its own; 32 output tokens."""
    rng = random.Random(seed)
    prefix = _ids(rng, prefix_len, vocab)
    prompts = [prefix + _ids(rng, rng.randint(16, 64), vocab) for _ in range(num_requests)]
    return Workload("shared-prefix", prompts, [32] * num_requests)


def decode_heavy(batch: int, vocab: int, seed: int = 0) -> Workload:
    """batch requests of 64-token prompts and 128 outputs each (per-step overhead probe)."""
    rng = random.Random(seed)
    return Workload("decode", [_ids(rng, 64, vocab) for _ in range(batch)], [128] * batch)


WORKLOADS = {"mixed": mixed, "shared-prefix": shared_prefix, "decode": decode_heavy}
