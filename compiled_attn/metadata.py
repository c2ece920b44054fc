"""Batch metadata: from a list of sequence chunks to the device tensors of one forward.

A *chunk* is the part of a sequence that runs in this step: its new tokens
(``query_len`` of them) on top of ``context_len`` tokens already in the paged cache. One
batch may mix prefills (``context_len == 0``), chunked prefills and prefix-cache hits
(``context_len > 0``, several tokens), decodes (one token) and multi-token decodes.
Field names follow vLLM / flash-attn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.utils._pytree as pytree

from .block_allocator import slot_of
from .ops import PAD_SLOT_ID


@dataclass(frozen=True)
class SequenceChunk:
    """The tokens of one sequence that run in this step.

    Attributes:
        token_ids: the ``query_len`` new token ids.
        context_len: tokens of this sequence already in the cache (positions
            ``0 .. context_len - 1``); the new tokens take positions
            ``context_len .. context_len + query_len - 1``.
        block_table: block ids holding positions ``0 ..`` of this sequence, enough for
            ``context_len + query_len`` tokens.
    """

    token_ids: Sequence[int]
    context_len: int
    block_table: Sequence[int]


@dataclass
class AttentionMetadata:
    """Device tensors of one forward pass (a pytree: it can enter a compiled function).

    Attributes:
        input_ids: ``[T]`` int64 token ids, sequences packed back to back.
        positions: ``[T]`` int64 position of each token in its sequence.
        slot_mapping: ``[T]`` int64 cache slot of each token, ``PAD_SLOT_ID`` (-1) = skip.
        cu_seqlens_q: ``[B + 1]`` int32 cumulative query counts.
        seq_lens: ``[B]`` int32 keys per sequence after this step (context + new).
        block_table: ``[B, max_blocks_per_seq]`` int32, rows padded with block 0.
        prefill_only: every sequence starts from an empty cache, so attention may run over
            the fresh contiguous k/v (a static flag: one compiled graph per value).
        query_lens: host copy of the per-sequence query counts (not part of the pytree;
            ``None`` inside compiled code).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    prefill_only: bool = False
    query_lens: tuple[int, ...] | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def last_token_indices(self) -> torch.Tensor:
        """``[B]`` int64 index of each sequence's last token (where logits are taken).

        Gathers ``cu_seqlens_q[1:]`` with an index instead of slicing: Inductor of torch
        2.11 fails to lower a slice of a size-oblivious dynamic dim ("unbacked_bindings").
        """
        ends = torch.arange(1, self.num_seqs + 1, device=self.cu_seqlens_q.device)
        return self.cu_seqlens_q[ends].long() - 1


TENSOR_FIELDS = ("input_ids", "positions", "slot_mapping", "cu_seqlens_q", "seq_lens", "block_table")


def _flatten(md: AttentionMetadata):
    return [getattr(md, name) for name in TENSOR_FIELDS], md.prefill_only


def _flatten_with_keys(md: AttentionMetadata):
    return [(pytree.GetAttrKey(name), getattr(md, name)) for name in TENSOR_FIELDS], md.prefill_only


def _unflatten(values, prefill_only) -> AttentionMetadata:
    return AttentionMetadata(*values, prefill_only=prefill_only)


pytree.register_pytree_node(
    AttentionMetadata, _flatten, _unflatten,
    serialized_type_name="compiled_attn.metadata.AttentionMetadata",
    flatten_with_keys_fn=_flatten_with_keys,
)


def block_table_rows(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """``rows`` of block ids as an int32 host tensor ``[len(rows), longest row]``, shorter
    rows padded with block 0: the columns a step reads. A row past them is never read (a
    sequence's keys end within its blocks), so buffers take this much and no more, which
    for long ``max_model_len`` is a small part of their width."""
    width = max(map(len, rows), default=0)
    return torch.tensor([list(row) + [0] * (width - len(row)) for row in rows], dtype=torch.int32).view(len(rows),
                                                                                                         width)


def pinned(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` in page-locked memory when it is bound for a CUDA ``device`` (else as is).

    A non-blocking copy from pageable memory stages through a driver buffer and returns
    only when the data has been taken (about 30 us for each of a mixed step's small
    columns on the H200's host, ``profiling/results/serving.md``); from pinned memory it
    is queued and returns at once. PyTorch's caching host allocator holds the block until
    the copy has run, so the tensor may be dropped right after."""
    return host.pin_memory() if torch.device(device).type == "cuda" else host


def column_to_device(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` as a 1-D ``dtype`` tensor on ``device``, by a non-blocking copy from
    page-locked memory (:func:`pinned`)."""
    return pinned(torch.tensor(values, dtype=dtype), device).to(device, non_blocking=True)


@dataclass(frozen=True)
class PackedChunks:
    """Host lists of one step's metadata (:func:`pack_chunks`), field names as
    :class:`AttentionMetadata`'s; ``block_table`` holds each sequence's block ids, unpadded
    (``max_blocks_per_seq`` is the width of the tensor they go to)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    cu_seqlens_q: list[int]
    seq_lens: list[int]
    block_table: list[list[int]]
    max_blocks_per_seq: int
    prefill_only: bool

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def to_device(self, device: torch.device | str) -> AttentionMetadata:
        """The :class:`AttentionMetadata` of these lists on ``device``."""
        def tensor(values, dtype):
            return column_to_device(values, dtype, device)

        rows = block_table_rows(self.block_table)
        table = torch.zeros((self.num_seqs, self.max_blocks_per_seq), dtype=torch.int32)
        table[:, : rows.shape[1]] = rows
        table = pinned(table, device)
        return AttentionMetadata(
            input_ids=tensor(self.input_ids, torch.int64),
            positions=tensor(self.positions, torch.int64),
            slot_mapping=tensor(self.slot_mapping, torch.int64),
            cu_seqlens_q=tensor(self.cu_seqlens_q, torch.int32),
            seq_lens=tensor(self.seq_lens, torch.int32),
            block_table=table.to(device, non_blocking=True),
            prefill_only=self.prefill_only,
            query_lens=tuple(b - a for a, b in zip(self.cu_seqlens_q, self.cu_seqlens_q[1:])),
        )


def pack_chunks(
    chunks: Sequence[SequenceChunk],
    block_size: int,
    max_blocks_per_seq: int,
    num_blocks: int | None = None,
) -> PackedChunks:
    """Pack ``chunks`` back to back into host lists (no tensors, no device).

    Args:
        chunks: the sequences of this step, in batch order.
        block_size: tokens per cache block.
        max_blocks_per_seq: width of the ``block_table`` tensor (fixed, so compiled graphs
            and captured CUDA graphs see one shape; :meth:`PackedChunks.to_device` pads the
            rows with block 0); a longer table is an error.
        num_blocks: when given, block ids are checked against ``[0, num_blocks)``.

    Raises:
        ValueError: an empty batch or chunk, a block table too short for the chunk's
            tokens or wider than ``max_blocks_per_seq``, a block id out of range.
    """
    if not chunks:
        raise ValueError("chunks must hold at least one sequence, got an empty batch")
    input_ids, positions, slots, cu_seqlens, seq_lens, tables = [], [], [], [0], [], []
    for i, chunk in enumerate(chunks):
        query_len = len(chunk.token_ids)
        seq_len = chunk.context_len + query_len
        table = list(chunk.block_table)
        if query_len == 0 or chunk.context_len < 0:
            raise ValueError(
                f"chunks[{i}] must have >= 1 new token and context_len >= 0, got "
                f"{query_len} tokens, context_len={chunk.context_len}"
            )
        if len(table) * block_size < seq_len or len(table) > max_blocks_per_seq:
            raise ValueError(
                f"chunks[{i}].block_table has {len(table)} blocks of {block_size}; it must cover "
                f"seq_len={seq_len} tokens and hold at most max_blocks_per_seq={max_blocks_per_seq}"
            )
        if num_blocks is not None and any(not 0 <= b < num_blocks for b in table):
            raise ValueError(f"chunks[{i}].block_table {table} has ids outside [0, {num_blocks})")
        pos = range(chunk.context_len, seq_len)
        input_ids.extend(chunk.token_ids)
        positions.extend(pos)
        slots.extend(slot_of(table, p, block_size) for p in pos)
        cu_seqlens.append(cu_seqlens[-1] + query_len)
        seq_lens.append(seq_len)
        tables.append(table)
    return PackedChunks(input_ids, positions, slots, cu_seqlens, seq_lens, tables, max_blocks_per_seq,
                        prefill_only=all(c.context_len == 0 for c in chunks))


def build_metadata(
    chunks: Sequence[SequenceChunk],
    block_size: int,
    max_blocks_per_seq: int,
    device: torch.device | str = "cpu",
    num_blocks: int | None = None,
) -> AttentionMetadata:
    """Pack ``chunks`` into an :class:`AttentionMetadata` on ``device``; arguments and
    errors as :func:`pack_chunks`."""
    return pack_chunks(chunks, block_size, max_blocks_per_seq, num_blocks).to_device(device)


__all__ = ["AttentionMetadata", "PAD_SLOT_ID", "PackedChunks", "SequenceChunk", "block_table_rows", "build_metadata",
           "column_to_device", "pack_chunks", "pinned"]
