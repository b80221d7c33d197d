"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts, and the prefix cache.

A full block is keyed by a chained hash of its tokens (the previous block's hash, its token ids and
any extra content such as image hashes), so two requests that share a prefix share its blocks. Freed
blocks keep their hash and stay findable until they are handed out again, oldest-freed first (LRU).
Invariant: a block is in `free` exactly when its reference count is zero.

Blocks in flight: the full prompt blocks an admitted sequence is about to compute are known by their
hashes before they exist. A new sequence whose first uncached block is one of them holds back
(`allocate_prefix` says so) and finds it cached a step or so later, instead of computing the same K/V
again: n samples of one prompt, or many requests behind one system prompt, compute their shared prefix once.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from unified.engine.sequence import Sequence


def block_hash(parent: bytes, token_ids: list[int], extra: bytes = b"") -> bytes:
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    digest.update(extra)
    return digest.digest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: list[int] = []


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.in_flight: dict[bytes, Sequence] = {}  # hash of a prompt block being computed -> its sequence
        self.hit_tokens = 0
        self.queried_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs so that its first `num_tokens` tokens have slots."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]
        block.hash, block.token_ids, block.ref_count = None, [], 1
        return block_id

    def _chain_hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        hashes, parent, size = [], b"", self.block_size
        for i in range(num_full_blocks):
            span = (i * size, (i + 1) * size)
            parent = block_hash(parent, seq.token_ids[span[0]:span[1]], seq.block_extra(*span))
            hashes.append(parent)
        return hashes

    def allocate_prefix(self, seq: Sequence) -> int | None:
        """Gives a new sequence the cached blocks of its longest cached prefix; returns tokens covered, or
        None (holding no block) when the first block it misses is in flight, computed by an admitted sequence.

        At least one prompt token is always left to compute, so the step produces logits.
        """
        assert not seq.block_table
        seq.blocks_to_publish = []
        if not self.prefix_caching or seq.params.prompt_logprobs is not None:  # those need every prompt token's logits
            return 0
        size = self.block_size
        candidates = (seq.num_tokens - 1) // size
        hashes = self._chain_hashes(seq, candidates)
        hit = 0
        for i, h in enumerate(hashes):
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != seq.token_ids[i * size:(i + 1) * size]:
                break
            hit += 1
        if hit < len(hashes) and hashes[hit] in self.in_flight:
            return None
        for block_id in (self.cached[h] for h in hashes[:hit]):
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_hashed_blocks = hit
        seq.blocks_to_publish = hashes[hit:]
        self.queried_tokens += candidates * size
        self.hit_tokens += hit * size
        seq.num_computed_tokens = seq.num_cached_prompt_tokens = hit * size
        return hit * size

    def mark_in_flight(self, seq: Sequence) -> None:
        """`seq` was admitted: the prompt blocks it will compute are in flight until published or freed."""
        if seq.publishes_blocks:
            for h in seq.blocks_to_publish:
                self.in_flight.setdefault(h, seq)

    def _land(self, seq: Sequence) -> None:
        for h in seq.blocks_to_publish:
            if self.in_flight.get(h) is seq:
                del self.in_flight[h]
        seq.blocks_to_publish = []

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Makes sure `seq` has slots for its first `num_tokens` tokens."""
        needed = self.blocks_needed(seq, num_tokens)
        assert needed <= self.num_free_blocks
        seq.block_table.extend(self._take_free() for _ in range(needed))

    def trim(self, seq: Sequence) -> None:
        """Frees the blocks past those `seq`'s tokens need (held for speculative drafts that were rejected; their
        slots were never computed for good, so they carry no prefix-cache hash)."""
        keep = -(-seq.num_tokens // self.block_size)
        for block_id in seq.block_table[keep:]:
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.hash is None
            self.free[block_id] = None
        del seq.block_table[keep:]

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publishes the blocks whose tokens are all computed, so later requests can reuse them."""
        if not self.prefix_caching or not seq.publishes_blocks:
            return
        size = self.block_size
        done = seq.num_hashed_blocks
        parent = self.blocks[seq.block_table[done - 1]].hash if done else b""
        for i in range(done, seq.num_computed_tokens // size):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.token_ids = seq.token_ids[i * size:(i + 1) * size]
                block.hash = block_hash(parent, block.token_ids, seq.block_extra(i * size, (i + 1) * size))
                self.cached.setdefault(block.hash, block.block_id)
            parent = block.hash
            seq.num_hashed_blocks = i + 1
            if self.in_flight.get(block.hash) is seq:
                del self.in_flight[block.hash]

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (after a warm-up or a weight swap, their K/V are stale)."""
        self.cached.clear()
        self.in_flight.clear()
        for block_id in self.free:
            self.blocks[block_id].hash, self.blocks[block_id].token_ids = None, []
        self.hit_tokens = self.queried_tokens = 0

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def free_sequence(self, seq: Sequence) -> None:
        # Tail blocks first, so under memory pressure the shared prefixes are evicted last.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.num_hashed_blocks = 0
        self._land(seq)
