"""Paged KV cache: the per-layer cache tensors and the block allocator that addresses them.

Layout (one for every layer, as vLLM's): ``key_cache, value_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_size]``; block ids, slots and the prefix cache
are :mod:`compiled_attn.block_allocator`'s.

Cache tensors are *static addresses* (:func:`allocate_kv_caches`): allocated once and marked
with ``torch._dynamo.mark_static_address``, so that Inductor's own CUDA graphs
(``torch.compile(mode="reduce-overhead")``) record the ops that write them instead of
skipping the graph ("skipping cudagraphs due to mutated inputs").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .block_allocator import BlockAllocator, OutOfBlocksError

__all__ = ["BlockAllocator", "KVCache", "OutOfBlocksError", "allocate_kv_caches"]


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
                 head_size: int, dtype: torch.dtype, device: torch.device | str,
                 prefix_caching: bool = False) -> "KVCache":
        """Allocate ``num_layers`` zero-filled cache pairs of ``num_blocks`` blocks (static
        addresses, see :func:`allocate_kv_caches`) and their allocator (with or without
        ``prefix_caching``)."""
        layers = allocate_kv_caches(num_layers, num_blocks, block_size, num_kv_heads, head_size, dtype, device)
        return cls(layers, BlockAllocator(num_blocks, block_size, prefix_caching))

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_size: int,
                        dtype: torch.dtype) -> int:
        """Bytes one block costs over all layers, keys and values."""
        return 2 * num_layers * block_size * num_kv_heads * head_size * dtype.itemsize
