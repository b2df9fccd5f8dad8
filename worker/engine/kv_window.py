"""Which of a sequence's KV blocks no layer will read again (policy; the pool is the mechanism).

When every layer of a model attends within a sliding window, the keys of a
sequence older than the widest window are read by no layer again. After each
step the scheduler asks ``releasable`` how many of the sequence's head blocks
that covers and hands them back to the pool (``BlockManager.release``: a
reference dropped, the block reusable, and still findable in the prefix
cache until the pool needs it). The block table keeps their ids, so a token's
block is still ``block_table[pos // block_size]``; the attention kernels
never read below the window, so a stale id is never followed.

A model with any full-attention layer releases nothing: that layer reads
every key to the end.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SlidingRelease:
    window: int  # the widest window of the model's layers (all of them slide)
    block_size: int
    keep_last_hashed: bool  # prefix caching chains each block's hash onto the previous one's

    def releasable(self, num_computed: int, num_hashed: int) -> int:
        """How many head blocks of a sequence with ``num_computed`` tokens in the cache
        (``num_hashed`` of its blocks hashed) no later query reads: the next token, at
        position num_computed, sees keys num_computed - window + 1 and on."""
        blocks = max(0, num_computed - self.window + 1) // self.block_size
        if self.keep_last_hashed:
            # the next full block's hash starts from this one's: it stays ours until then
            blocks = min(blocks, max(num_hashed - 1, 0))
        return blocks

    def peak_blocks(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks a sequence of num_tokens holds at once: its window, a step's
        worth of new tokens, a partial block at each end and the kept hashed block."""
        whole = -(-num_tokens // self.block_size)
        return min(whole, -(-(self.window + max_step_tokens) // self.block_size) + 2)
