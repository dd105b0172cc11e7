"""The paged KV cache's allocator: a fixed pool of blocks, reference counts and a prefix cache.

Pure bookkeeping: the KV tensors live in the model runner; this module only decides which block
ids a sequence's positions map to. Only the scheduler calls it.

Prefix caching: a full block whose KV has been written is registered under a hash chained over
the token ids of its sequence up to and including that block (`chain_hashes`), so a later
sequence that starts with the same tokens takes a reference on it instead of computing it again.
A block nobody holds any more stays registered and sits in an LRU pool of cached-free blocks; it
counts as free (the pool hands it out when no uncached block is left, oldest first, and forgets
its hash then), so caching never costs capacity.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

BLOCK_SIZE = 16

# Folded into the first block's hash. Anything else that changes a block's KV besides its tokens
# (an adapter, a cache salt) would be folded in here; there is nothing such today.
ROOT_HASH = b"tether-kv-v1"


class OutOfBlocks(RuntimeError):
    pass


def chain_hashes(token_ids: Sequence[int], have: list[bytes], block_size: int,
                 num_blocks: int) -> list[bytes]:
    """Extend `have` (hashes of the first blocks of `token_ids`) to `num_blocks` full blocks.

    Each hash covers the block's tokens and its parent's hash, so equal hashes mean equal
    prefixes. SHA-256 rather than Python's hash: a collision would hand one client's KV to
    another, and crafted collisions of a 64-bit non-cryptographic hash are within reach.
    """
    parent = have[-1] if have else ROOT_HASH
    for i in range(len(have), num_blocks):
        block = array("I", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        parent = hashlib.sha256(parent + block).digest()
        have.append(parent)
    return have


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE,
                 enable_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, "
                             f"{block_size}")
        self.block_size = block_size
        self.num_total = num_blocks
        self.enable_caching = enable_caching
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # unreferenced, no hash
        # Unreferenced but registered, least recently freed first: evicted from the front.
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: uncached ones plus cached ones nobody holds."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one live sequence."""
        return self.num_total - self.num_free

    @property
    def num_cached_free(self) -> int:
        return len(self._cached_free)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- the prefix cache -----------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks holding the longest cached prefix of `hashes` (nothing is taken yet)."""
        hits: list[int] = []
        if not self.enable_caching:
            return hits
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_revived(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` (cache hits) an allocation would take out of the free pool."""
        return sum(1 for b in blocks if self._ref_counts[b] == 0)

    def share(self, table: list[int], blocks: Sequence[int]) -> None:
        """Append cache hits to an empty-so-far `table`, taking a reference on each."""
        for block in blocks:
            if self._ref_counts[block] == 0:
                del self._cached_free[block]
            self._ref_counts[block] += 1
            table.append(block)

    def commit(self, table: Sequence[int], hashes: Sequence[bytes], start: int,
               end: int) -> None:
        """Register the full blocks `table[start:end]` under `hashes[start:end]`: their KV is
        written (call it after the forward pass that wrote them, never before)."""
        if not self.enable_caching:
            return
        for i in range(start, end):
            block, h = table[i], hashes[i]
            if block in self._hash_of or h in self._block_of:
                continue  # a hit, a shared fork block, or a twin computed in the same tick
            self._block_of[h] = block
            self._hash_of[block] = h

    # --- allocation -----------------------------------------------------------------------------

    def may_append(self, table: list[int], num_tokens: int) -> None:
        """Grow `table` in place until it holds `num_tokens` positions (a no-op if it does)."""
        missing = self.num_blocks_for(num_tokens) - len(table)
        if missing > self.num_free:
            raise OutOfBlocks(f"need {missing} blocks, {self.num_free} free")
        for _ in range(missing):
            table.append(self._take())

    def fork(self, table: list[int], num_tokens: int,
             copy_block: Callable[[int, int], None]) -> list[int]:
        """A child table for the first `num_tokens` positions of `table`.

        Full blocks are shared by reference count: neither side ever writes to them again.
        A trailing partial block is copied now, since both sides will append into it.
        """
        num_full, partial = divmod(num_tokens, self.block_size)
        if partial and not self.num_free:
            raise OutOfBlocks("need 1 block to fork a partial block, 0 free")
        child = table[:num_full]
        for block in child:
            self._ref_counts[block] += 1
        if partial:
            dst = self._take()
            copy_block(table[num_full], dst)
            child.append(dst)
        return child

    def fork_cost(self, num_tokens: int) -> int:
        """Blocks a fork at `num_tokens` positions takes from the free list."""
        return 1 if num_tokens % self.block_size else 0

    def free(self, table: list[int]) -> None:
        """Drop one reference to each block of `table` and empty it.

        Last blocks first, so that under pressure a prefix loses its tail before its head.
        """
        for block in reversed(table):
            count = self._ref_counts[block]
            if count < 1:
                raise RuntimeError(f"block {block} freed more often than allocated")
            self._ref_counts[block] = count - 1
            if count == 1:
                if block in self._hash_of:
                    self._cached_free[block] = None
                else:
                    self._free.append(block)
        table.clear()

    def truncate(self, table: list[int], num_tokens: int) -> None:
        """Give back the blocks of `table` past its first `num_tokens` positions (those a
        speculative decode took for drafts that were rejected)."""
        keep = self.num_blocks_for(num_tokens)
        if len(table) > keep:
            tail = table[keep:]
            del table[keep:]
            self.free(tail)

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._cached_free.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
        self._ref_counts[block] = 1
        return block
