"""Chained hashes of fixed-size token blocks: the keys of the prefix cache."""

import array
import hashlib
from collections.abc import Sequence


def chained_block_hashes(
    token_ids: Sequence[int], block_size: int, *, max_blocks: int | None = None
) -> list[bytes]:
    """SHA-256 chain over the full ``block_size``-token blocks of ``token_ids``.

    Hash j is sha256(hash j-1 || token ids of block j), with nothing before block 0, so it
    identifies the whole prefix [0, (j + 1) * block_size), not only block j: equal hashes
    mean equal prefixes. The hash is cryptographic because a collision would resume a
    request from another prompt's KV and state, which gives silently wrong text.

    Args:
      token_ids: the sequence; ids must fit in int64.
      block_size: tokens per block (>= 1). A partial last block is not hashed.
      max_blocks: hash at most this many leading blocks (None: every full block).

    Returns:
      One 32-byte digest per hashed block, in order.

    Raises:
      ValueError: for a block size below 1 or a negative ``max_blocks``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        if max_blocks < 0:
            raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
        num_blocks = min(num_blocks, max_blocks)
    hashes = []
    parent = b""
    for block in range(num_blocks):
        tokens = array.array("q", token_ids[block * block_size : (block + 1) * block_size])
        parent = hashlib.sha256(parent + tokens.tobytes()).digest()
        hashes.append(parent)
    return hashes
