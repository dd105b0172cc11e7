"""The paged KV cache's allocator: a fixed pool of blocks, a free list and reference counts.

Pure bookkeeping: the KV tensors live in the model runner; this module only decides which block
ids a sequence's positions map to. Only the scheduler calls it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

BLOCK_SIZE = 16


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, "
                             f"{block_size}")
        self.block_size = block_size
        self.num_total = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_total - len(self._free)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- allocation -----------------------------------------------------------------------------

    def may_append(self, table: list[int], num_tokens: int) -> None:
        """Grow `table` in place until it holds `num_tokens` positions (a no-op if it does)."""
        missing = self.num_blocks_for(num_tokens) - len(table)
        if missing > len(self._free):
            raise OutOfBlocks(f"need {missing} blocks, {len(self._free)} free")
        for _ in range(missing):
            table.append(self._take())

    def fork(self, table: list[int], num_tokens: int,
             copy_block: Callable[[int, int], None]) -> list[int]:
        """A child table for the first `num_tokens` positions of `table`.

        Full blocks are shared by reference count: neither side ever writes to them again.
        A trailing partial block is copied now, since both sides will append into it.
        """
        num_full, partial = divmod(num_tokens, self.block_size)
        if partial and not self._free:
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
        """Drop one reference to each block of `table` and empty it."""
        for block in reversed(table):
            count = self._ref_counts[block]
            if count < 1:
                raise RuntimeError(f"block {block} freed more often than allocated")
            self._ref_counts[block] = count - 1
            if count == 1:
                self._free.append(block)
        table.clear()

    def _take(self) -> int:
        block = self._free.popleft()
        self._ref_counts[block] = 1
        return block
