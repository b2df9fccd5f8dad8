"""The KV block pool: allocation, ref counts and the prefix cache (mechanism only).

A block that fills up gets a chained hash of (parent block's hash, its
tokens); a later request whose prompt has the same full blocks reuses them.
Freed blocks keep their hash and stay findable until the pool needs them
(lazy eviction, least recently freed first). This class never picks a
victim: the scheduler does.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass


def block_hash(parent: bytes | None, tokens: list[int] | tuple[int, ...]) -> bytes:
    """Stable across processes and runs (never Python's hash())."""
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    tokens: tuple[int, ...] | None = None  # kept to verify a hash hit


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # ref_count == 0 blocks, oldest-freed first; cached ones stay findable
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # hash -> block id

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------
    def find_cached_prefix(self, token_ids: list[int]) -> list[int]:
        """Block ids holding the longest cached run of ``token_ids``' full blocks.

        At most (len - 1) // block_size blocks: the last token is always
        computed, so there are logits to sample from. Takes no references.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        parent: bytes | None = None
        for start in range(0, (len(token_ids) - 1) // bs * bs, bs):
            tokens = tuple(token_ids[start : start + bs])
            h = block_hash(parent, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].tokens != tokens:
                break
            hits.append(block_id)
            parent = h
        return hits

    def cache_full_blocks(
        self, block_table: list[int], token_ids: list[int], num_computed: int, num_hashed: int
    ) -> int:
        """Registers a sequence's newly full, computed blocks in the prefix cache.

        ``num_hashed`` blocks at the head of the table are hashed already;
        returns the new count, which the caller keeps for next time.
        """
        full = num_computed // self.block_size
        if not self.enable_prefix_caching or full <= num_hashed:
            return num_hashed
        bs = self.block_size
        parent = self.blocks[block_table[num_hashed - 1]].hash if num_hashed else None
        for i in range(num_hashed, full):
            block = self.blocks[block_table[i]]
            if block.hash is None:
                tokens = tuple(token_ids[i * bs : (i + 1) * bs])
                block.hash = block_hash(parent, tokens)
                block.tokens = tokens
                # an identical block computed twice: the first one stays the cached one
                self.cached.setdefault(block.hash, block.block_id)
            parent = block.hash
        return full

    # -- allocation ---------------------------------------------------------
    def can_allocate(self, num_blocks: int, reserve: int = 0) -> bool:
        return len(self.free) - reserve >= num_blocks

    def take_cached(self, block_ids: list[int]) -> None:
        """Adds a reference to each prefix-cache hit, pulling it off the free list."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1

    def allocate(self, num_blocks: int) -> list[int]:
        """Fresh blocks (ref count 1), evicting the least recently freed cached ones."""
        if num_blocks > len(self.free):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self.free)} free")
        out = []
        for _ in range(num_blocks):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:
                if self.cached.get(block.hash) == block_id:
                    del self.cached[block.hash]
                block.hash = None
                block.tokens = None
            block.ref_count = 1
            out.append(block_id)
        return out

    def release(self, block_table: list[int]) -> None:
        """Drops one reference to each block, tail first, so a sequence's head
        blocks (the most shareable) are the last to be evicted."""
        for block_id in reversed(block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} released twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
