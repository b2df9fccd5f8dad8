"""BlockManager: exact block ids and ref counts, and a state machine over random use."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from batchgen.worker.engine.block_manager import BlockManager, block_hash


def test_allocate_release_and_lazy_eviction_order():
    bm = BlockManager(num_blocks=4, block_size=2)
    table = bm.allocate(3)
    assert table == [0, 1, 2]
    assert [b.ref_count for b in bm.blocks] == [1, 1, 1, 0]
    tokens = [5, 6, 7, 8, 9, 10]
    assert bm.cache_full_blocks(table, tokens, num_computed=6, num_hashed=0) == 3
    bm.release(table)
    assert bm.num_free_blocks == 4
    # freed tail first: block 2, then 1, then 0 join the free queue after never-used 3
    assert list(bm.free) == [3, 2, 1, 0]
    # the prefix is still findable until those blocks are reused
    assert bm.find_cached_prefix([5, 6, 7, 8, 99]) == [0, 1]
    assert bm.allocate(2) == [3, 2]  # evicts block 2's cached (9, 10)
    assert bm.find_cached_prefix(tokens + [11]) == [0, 1]
    assert bm.cached == {
        block_hash(None, (5, 6)): 0,
        block_hash(block_hash(None, (5, 6)), (7, 8)): 1,
    }


def test_hit_shares_blocks_with_ref_counts():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = bm.allocate(3)
    bm.cache_full_blocks(a, [1, 2, 3, 4, 5], num_computed=5, num_hashed=0)
    hits = bm.find_cached_prefix([1, 2, 3, 4, 6, 7])
    assert hits == a[:2]
    bm.take_cached(hits)
    assert [bm.blocks[i].ref_count for i in a] == [2, 2, 1]
    bm.release(a)
    assert [bm.blocks[i].ref_count for i in a] == [1, 1, 0]
    assert bm.num_free_blocks == 4


def test_last_token_always_recomputed():
    bm = BlockManager(num_blocks=4, block_size=2)
    t = bm.allocate(2)
    bm.cache_full_blocks(t, [1, 2, 3, 4], num_computed=4, num_hashed=0)
    # all 4 tokens are cached, but the last must be computed for logits
    assert bm.find_cached_prefix([1, 2, 3, 4]) == [t[0]]


def test_hash_collision_is_caught_by_token_check():
    bm = BlockManager(num_blocks=4, block_size=2)
    t = bm.allocate(1)
    bm.cache_full_blocks(t, [1, 2], num_computed=2, num_hashed=0)
    bm.blocks[t[0]].tokens = (9, 9)  # pretend the hash collided with other tokens
    assert bm.find_cached_prefix([1, 2, 3]) == []


def test_disabled_prefix_cache_never_hits():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    t = bm.allocate(2)
    assert bm.cache_full_blocks(t, [1, 2, 3, 4], num_computed=4, num_hashed=0) == 0
    assert bm.find_cached_prefix([1, 2, 3, 4, 5]) == []


class BlockPool(RuleBasedStateMachine):
    """Sequences come and go, grow and share prefixes; the pool's books must balance."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=2)
        self.seqs: dict[int, tuple[list[int], list[int], int]] = {}  # id -> (tokens, table, hashed)
        self.next_id = 0

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def admit(self, tokens):
        hits = self.bm.find_cached_prefix(tokens)
        # a hit holds exactly the same tokens
        for i, b in enumerate(hits):
            assert self.bm.blocks[b].tokens == tuple(tokens[2 * i : 2 * i + 2])
        need = self.bm.blocks_needed(len(tokens)) - len(hits)
        fresh_from_free = sum(1 for b in hits if self.bm.blocks[b].ref_count == 0)
        if not self.bm.can_allocate(need + fresh_from_free):
            return
        self.bm.take_cached(hits)
        table = hits + self.bm.allocate(need)
        hashed = self.bm.cache_full_blocks(table, tokens, len(tokens), len(hits))
        self.seqs[self.next_id] = (tokens, table, hashed)
        self.next_id += 1

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(0, 2))
    def grow(self, data, token):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens, table, hashed = self.seqs[sid]
        tokens = [*tokens, token]
        if self.bm.blocks_needed(len(tokens)) > len(table):
            if not self.bm.can_allocate(1):
                return
            table = table + self.bm.allocate(1)
        hashed = self.bm.cache_full_blocks(table, tokens, len(tokens), hashed)
        self.seqs[sid] = (tokens, table, hashed)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        _, table, _ = self.seqs.pop(sid)
        self.bm.release(table)

    @invariant()
    def books_balance(self):
        refs = Counter(b for _, table, _ in self.seqs.values() for b in table)
        for block in self.bm.blocks:
            assert block.ref_count == refs.get(block.block_id, 0)
            assert (block.block_id in self.bm.free) == (block.ref_count == 0)
        assert self.bm.num_free_blocks + len(refs) == self.bm.num_blocks
        for h, b in self.bm.cached.items():
            assert self.bm.blocks[b].hash == h

    def teardown(self):
        for _, table, _ in self.seqs.values():
            self.bm.release(table)
        assert self.bm.num_free_blocks == self.bm.num_blocks  # nothing leaked


TestBlockPool = BlockPool.TestCase
TestBlockPool.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
