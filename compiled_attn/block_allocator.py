"""Block ids of a paged KV cache: per-sequence block tables, reference counts and the prefix cache.

Token ``p`` of a sequence lives in block ``block_table[p // block_size]`` at offset
``p % block_size``; its *slot* is ``block_id * block_size + offset`` (vLLM's
``slot_mapping``), computed by :func:`slot_of`, the one home of that formula (the decode
step's on-device advance calls it on tensors).

Automatic prefix caching (vLLM V1's design): a *full* block is identified by the hash of its
parent block's hash and its own token ids, so equal hashes mean equal prefixes. Full blocks
are registered under their hash once their tokens are computed (:meth:`BlockAllocator.cache_full_blocks`);
a new sequence takes the registered blocks of its longest cached prefix
(:meth:`BlockAllocator.allocate_prefix`) and computes only the rest. Blocks are reference
counted: a block shared by several sequences is freed when the last one lets go, and a
freed block that holds a registered prefix stays cached, evicted least recently used only
when a free block is needed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Iterator, Sequence

import torch

from .ops.arith import cdiv


class OutOfBlocksError(RuntimeError):
    """Raised when the allocator cannot satisfy a request; names what was asked and what is free."""


def slot_of(block_table, position, block_size: int):
    """Cache slot of token ``position`` given its sequence's ``block_table``: ints (a list
    of block ids and an int) on the host, or tensors on the device (``[B, W]`` tables and
    ``[B]`` positions, gathered per row)."""
    if isinstance(position, torch.Tensor):
        column = (position // block_size).clamp_max(block_table.shape[1] - 1)
        block = block_table.gather(1, column[:, None]).squeeze(1).long()
        return block * block_size + position % block_size
    return block_table[position // block_size] * block_size + position % block_size


def block_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """SHA-256 of a full block's parent hash (``None`` for the first block) and its token
    ids: equal digests mean equal prefixes (a collision of Python's ``hash`` would reuse
    another prompt's K/V; vLLM moved to SHA-256 for that reason, CVE-2025-25183)."""
    return _chained(parent, array("q", token_ids).tobytes())


def block_hashes(parent: bytes | None, token_ids: Sequence[int], block_size: int) -> Iterator[bytes]:
    """The chained :func:`block_hash` digests of the full blocks of ``token_ids`` (whose
    first block follows ``parent``), lazily; the ids become bytes once, not per block."""
    data, step = memoryview(array("q", token_ids).tobytes()), 8 * block_size
    for start in range(0, len(token_ids) // block_size * step, step):
        parent = _chained(parent, data[start:start + step])
        yield parent


def _chained(parent: bytes | None, data) -> bytes:
    """:func:`block_hash` of a block whose token ids are ``data`` (int64 bytes)."""
    digest = hashlib.sha256(parent or b"")
    digest.update(data)
    return digest.digest()


class BlockAllocator:
    """Hands out block ids, keeps each sequence's block table and caches full blocks by prefix.

    Args:
        num_blocks: blocks in the cache (ids ``0 .. num_blocks - 1``).
        block_size: tokens per block.
        prefix_caching: register full blocks and reuse them across sequences.

    Raises:
        ValueError: non-positive sizes.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0, 1, ...
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # block id -> hash, for registered blocks
        self._block_of: dict[bytes, int] = {}  # hash -> block id
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free registered blocks, oldest first
        self.block_tables: dict[int, list[int]] = {}
        self._hashes: dict[int, list[bytes]] = {}  # seq id -> hashes of its leading full blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (in use or evictable)."""
        return len(self._block_of)

    def num_hashed(self, seq_id: int) -> int:
        """Leading full blocks of ``seq_id`` already hashed (registered or matched)."""
        return len(self._hashes.get(seq_id, ()))

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """Extra blocks that sequence ``seq_id`` needs to hold ``num_tokens`` tokens in all."""
        have = len(self.block_tables.get(seq_id, ()))
        return max(0, cdiv(num_tokens, self.block_size) - have)

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # evict the least recently freed cached block
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
        self._refs[block] = 1
        return block

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Make room for ``num_tokens`` tokens in all for ``seq_id``; returns its block table.

        Raises:
            OutOfBlocksError: not enough free blocks (nothing is allocated then).
        """
        need = self.blocks_needed(seq_id, num_tokens)
        if need > self.num_free_blocks:
            raise OutOfBlocksError(
                f"sequence {seq_id} needs {need} more blocks of {self.block_size} tokens for "
                f"{num_tokens} tokens, but only {self.num_free_blocks} of {self.num_blocks} are free; "
                "raise num_blocks or lower the batch or max_new_tokens"
            )
        table = self.block_tables.setdefault(seq_id, [])
        table.extend(self._take() for _ in range(need))
        return table

    def allocate_prefix(self, seq_id: int, token_ids: Sequence[int]) -> int:
        """Give a new sequence the cached blocks of the longest cached prefix of
        ``token_ids``; returns how many tokens they hold (a multiple of ``block_size``).

        The block holding the last token is never taken: that token is computed, so its
        logits exist to sample from. Nothing is taken without ``prefix_caching``.
        """
        if not self.prefix_caching or seq_id in self.block_tables:
            return 0
        table, hashes = [], []
        for parent in block_hashes(None, token_ids[:-1], self.block_size):
            block = self._block_of.get(parent)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
            table.append(block)
            hashes.append(parent)
        self.block_tables[seq_id] = table
        self._hashes[seq_id] = hashes
        return len(table) * self.block_size

    def cache_full_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the full blocks among the first ``num_computed`` tokens of ``seq_id``
        (whose ids are ``token_ids``) in the prefix cache. A block whose hash is already
        registered (an equal prefix computed by another sequence) keeps the first one."""
        if not self.prefix_caching:
            return
        table, hashes = self.block_tables[seq_id], self._hashes.setdefault(seq_id, [])
        full = min(num_computed, len(token_ids)) // self.block_size
        new = token_ids[len(hashes) * self.block_size: full * self.block_size]
        for index, digest in enumerate(block_hashes(hashes[-1] if hashes else None, new, self.block_size),
                                       len(hashes)):
            hashes.append(digest)
            block = table[index]
            if digest not in self._block_of and block not in self._hash_of:
                self._block_of[digest] = block
                self._hash_of[block] = digest

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give ``child_id`` the blocks of ``parent_id``, shared (reference counted): a
        block is copied only when one of them writes it (:meth:`copy_on_write`)."""
        table = self.block_tables[parent_id]
        for block in table:
            self._refs[block] += 1
        self.block_tables[child_id] = list(table)
        self._hashes[child_id] = list(self._hashes.get(parent_id, ()))

    def copy_on_write(self, seq_id: int, position: int) -> tuple[int, int] | None:
        """Before ``seq_id`` writes token ``position``: if its block there is shared, give
        ``seq_id`` a block of its own and return ``(src, dst)`` for
        :func:`compiled_attn.ops.copy_blocks` (the caller copies the contents); else ``None``.

        Raises:
            OutOfBlocksError: no free block for the copy.
        """
        table = self.block_tables[seq_id]
        index = position // self.block_size
        if index >= len(table) or self._refs[table[index]] == 1:
            return None
        if not self.num_free_blocks:
            raise OutOfBlocksError(f"copy-on-write of sequence {seq_id} needs a free block, none is left")
        src, dst = table[index], self._take()
        self._refs[src] -= 1
        table[index] = dst
        return src, dst

    def free(self, seq_id: int) -> None:
        """Let go of all blocks of ``seq_id`` (no-op for unknown ids): a block no sequence
        holds any more is free again, kept in the prefix cache if registered."""
        self._hashes.pop(seq_id, None)
        for block in reversed(self.block_tables.pop(seq_id, [])):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def reset_prefix_cache(self) -> None:
        """Forget every registered block (free ones become plain free blocks)."""
        self._free.extend(reversed(self._evictable))
        self._evictable.clear()
        self._block_of.clear()
        self._hash_of.clear()
        for hashes in self._hashes.values():
            hashes.clear()
