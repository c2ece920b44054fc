"""Paged KV cache: a block allocator and the per-layer cache tensors.

Layout (one for every layer, as vLLM's): ``key_cache, value_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_size]``. Token ``p`` of a sequence lives in
block ``block_table[p // block_size]`` at offset ``p % block_size``; its slot is
``block_id * block_size + offset`` (vLLM's ``slot_mapping``).

Cache tensors are *static addresses* (:func:`allocate_kv_caches`): allocated once and marked
with ``torch._dynamo.mark_static_address``, so that Inductor's own CUDA graphs
(``torch.compile(mode="reduce-overhead")``) record the ops that write them instead of
skipping the graph ("skipping cudagraphs due to mutated inputs").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class OutOfBlocksError(RuntimeError):
    """Raised when the allocator cannot satisfy a request; names what was asked and what is free."""


class BlockAllocator:
    """Hands out block ids of a paged cache and keeps each sequence's block table.

    Args:
        num_blocks: blocks in the cache (ids ``0 .. num_blocks - 1``).
        block_size: tokens per block.

    Raises:
        ValueError: non-positive sizes.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0, 1, ...
        self.block_tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """Extra blocks that sequence ``seq_id`` needs to hold ``num_tokens`` tokens in all."""
        have = len(self.block_tables.get(seq_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Make room for ``num_tokens`` tokens in all for ``seq_id``; returns its block table.

        Raises:
            OutOfBlocksError: not enough free blocks (nothing is allocated then).
        """
        need = self.blocks_needed(seq_id, num_tokens)
        if need > len(self._free):
            raise OutOfBlocksError(
                f"sequence {seq_id} needs {need} more blocks of {self.block_size} tokens for "
                f"{num_tokens} tokens, but only {len(self._free)} of {self.num_blocks} are free; "
                "raise num_blocks or lower the batch or max_new_tokens"
            )
        table = self.block_tables.setdefault(seq_id, [])
        table.extend(self._free.pop() for _ in range(need))
        return table

    def append_slot(self, seq_id: int, position: int) -> int:
        """Slot of token ``position`` of ``seq_id``, allocating a block when needed."""
        table = self.allocate(seq_id, position + 1)
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def fork(self, parent_id: int, child_id: int) -> list[tuple[int, int]]:
        """Give ``child_id`` a private copy of ``parent_id``'s blocks.

        Returns the ``(src, dst)`` pairs to pass to :func:`compiled_attn.ops.copy_blocks`.
        """
        parent = self.block_tables[parent_id]
        if len(parent) > len(self._free):
            raise OutOfBlocksError(
                f"fork of sequence {parent_id} needs {len(parent)} blocks, {len(self._free)} free"
            )
        child = [self._free.pop() for _ in parent]
        self.block_tables[child_id] = child
        return list(zip(parent, child))

    def free(self, seq_id: int) -> None:
        """Return all blocks of ``seq_id`` to the pool (no-op for unknown ids)."""
        self._free.extend(reversed(self.block_tables.pop(seq_id, [])))


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int, dtype: torch.dtype,
                       device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_layers`` zero-filled ``(key_cache, value_cache)`` pairs of shape ``[num_blocks,
    block_size, num_kv_heads, head_size]``, each marked as a static address for
    ``torch.compile`` (unguarded: a different cache tensor re-records a CUDA graph rather than
    recompiling). Use it for a model of your own too; see the README ("Bring your own model").

    Raises:
        ValueError: a size below 1.
    """
    sizes = dict(num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                 num_kv_heads=num_kv_heads, head_size=head_size)
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
              for _ in range(num_layers)]
    for pair in caches:
        for cache in pair:
            torch._dynamo.mark_static_address(cache)
    return caches


@dataclass
class KVCache:
    """Per-layer paged K/V tensors plus their allocator.

    Attributes:
        layers: one ``(key_cache, value_cache)`` pair per cache-owning layer, each
            ``[num_blocks, block_size, num_kv_heads, head_size]``.
        allocator: the shared :class:`BlockAllocator` (all layers use the same block ids).
    """

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    allocator: BlockAllocator = field(repr=False)

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_size: int, dtype: torch.dtype, device: torch.device | str) -> "KVCache":
        """Allocate ``num_layers`` zero-filled cache pairs of ``num_blocks`` blocks (static
        addresses, see :func:`allocate_kv_caches`)."""
        layers = allocate_kv_caches(num_layers, num_blocks, block_size, num_kv_heads, head_size, dtype, device)
        return cls(layers, BlockAllocator(num_blocks, block_size))

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_size: int,
                        dtype: torch.dtype) -> int:
        """Bytes one block costs over all layers, keys and values."""
        return 2 * num_layers * block_size * num_kv_heads * head_size * dtype.itemsize
