"""MLA KV cache blocks: allocation, reference counts and the prefix-cache block map.

A block id names one physical block of P = ``block_size`` tokens on every dcp rank, so a
block holds one logical block of A = P * dcp consecutive tokens of a sequence (DESIGN
section 5 says which rank and local row each token lives at). A request's block table
lists one block per logical block.

The prefix cache works on the finer grid of P-token chunks (the lookup unit): chunk j is
named by the chained hash of tokens [0, (j + 1) * P) (``serving.block_hash``). The map
sends a chunk hash to a block that holds valid KV for its logical block from the block's
first token up to the end of that chunk. Consequences:

- For a prefix of k chunks, the block for logical block b is the one the hash of its last
  chunk inside the prefix maps to; earlier chunks of b may map to another block with the
  same KV (a copy, or a request that computed the same tokens), which is fine.
- A prefix ending inside a logical block (k not a multiple of dcp) covers only part of its
  last block, whose other rows belong to whoever wrote them. A request resuming there
  must copy that block into one of its own before writing (copy-on-write); blocks it
  shares whole it only reads.
"""

from collections.abc import Iterable, Sequence

from serving.lru_pool import LruPool, PoolUsage


class BlockAllocator:
    """Reference-counted KV blocks with a chunk-hash map and LRU eviction of unused blocks.

    A cached block (one with chunk hashes) whose last reference is released stays in the
    map until allocation needs it; then the least recently released goes first. A block
    with references is never evicted.
    """

    def __init__(self, num_blocks: int, *, block_size: int = 512, dcp: int = 1):
        """A pool of ``num_blocks`` block ids (per-rank physical blocks of ``block_size``).

        Raises:
          ValueError: naming a non-positive block count or block size, or a dcp other
            than 1, 2, 4.
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if dcp not in (1, 2, 4):
            raise ValueError(f"dcp must be one of (1, 2, 4), got {dcp}")
        self._pool = LruPool(num_blocks)
        self.block_size = block_size
        self.dcp = dcp

    @property
    def num_blocks(self) -> int:
        """Block ids in the pool."""
        return self._pool.size

    @property
    def tokens_per_block(self) -> int:
        """Tokens of a sequence one block id holds across the dcp ranks: P * dcp."""
        return self.block_size * self.dcp

    @property
    def num_allocatable(self) -> int:
        """Blocks ``allocate`` can hand out now, evicting cached ones if it must."""
        return self._pool.num_allocatable

    @property
    def num_evictions(self) -> int:
        """Cached blocks evicted so far."""
        return self._pool.num_evictions

    def blocks_needed(self, num_tokens: int) -> int:
        """Logical blocks covering ``num_tokens`` tokens of a sequence."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.tokens_per_block)

    def allocate(self, count: int) -> list[int]:
        """``count`` blocks with one reference each; evicts cached blocks, LRU first.

        Raises:
          PoolExhaustedError: when fewer than ``count`` blocks are allocatable (then
            none is allocated).
        """
        return self._pool.allocate(count)

    def pin(self, block_ids: Iterable[int]) -> None:
        """Adds a reference to each block, e.g. cached blocks a prefix hit shares."""
        self._pool.acquire(block_ids)

    def free(self, block_ids: Sequence[int]) -> None:
        """Drops a reference from each block of a block table.

        The table is released back to front so that, among its cached blocks, the deepest
        ones are evicted first: evicting the first block would cut the chain and make the
        rest of the prefix unreachable anyway.
        """
        self._pool.release(reversed(block_ids))

    def refcount(self, block_id: int) -> int:
        """References held on ``block_id``."""
        return self._pool.refcount(block_id)

    def register(self, chunk_hashes: Sequence[bytes], block_table: Sequence[int]) -> int:
        """Records that ``block_table`` holds valid KV for the chunks ``chunk_hashes`` name.

        Chunk j maps to ``block_table[j // dcp]``. Call only once the KV of all those
        chunks is written (or copied) and the table's blocks are still referenced. A chunk
        hash already mapped (to this or another block) keeps its mapping.

        Returns:
          How many chunk hashes were newly mapped.

        Raises:
          ValueError: if the table has too few blocks for the chunks, or names an
            unreferenced block.
        """
        needed = -(-len(chunk_hashes) // self.dcp)
        if len(block_table) < needed:
            raise ValueError(
                f"{len(chunk_hashes)} chunks need {needed} blocks, block table has "
                f"{len(block_table)}"
            )
        for block_id in block_table[:needed]:
            if self._pool.refcount(block_id) == 0:
                raise ValueError(f"block {block_id} is unreferenced; register while holding it")
        return sum(
            self._pool.add_key(block_table[chunk // self.dcp], chunk_hash)
            for chunk, chunk_hash in enumerate(chunk_hashes)
            if self._pool.find(chunk_hash) is None
        )

    def cached_chunks(self, chunk_hashes: Sequence[bytes]) -> list[int]:
        """The block each leading chunk maps to, stopping at the first chunk not cached.

        Pure: adds no reference and does not touch the LRU.
        """
        blocks = []
        for chunk_hash in chunk_hashes:
            block_id = self._pool.find(chunk_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def prefix_block_table(self, chunk_blocks: Sequence[int]) -> tuple[int, ...]:
        """The block table for a cached prefix, from its ``cached_chunks`` result.

        One block per logical block: the block that the prefix's last chunk inside that
        logical block maps to, which holds valid KV for the whole covered part.
        """
        return tuple(
            chunk_blocks[min(start + self.dcp, len(chunk_blocks)) - 1]
            for start in range(0, len(chunk_blocks), self.dcp)
        )

    def usage(self) -> PoolUsage:
        """Total, referenced and cached block counts."""
        return self._pool.usage()
