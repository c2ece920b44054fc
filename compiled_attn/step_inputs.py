"""Step inputs: the static device buffers that decode and mixed steps read, and the host
writes into them.

A captured CUDA graph reads fixed addresses, so every step's inputs go into buffers that
live as long as the graphs: :class:`DecodeBuffers` for decode steps (one row per running
request, padded to a capture size; :func:`advance` moves them to the next token on the
device) and :class:`MixedBuffers` for mixed steps (prefill chunks and decode rows, padded to
a captured ``(tokens, seqs)`` shape). The host's columns reach them through page-locked
memory by non-blocking copies (:func:`write_buffers`), so writing never waits for the step
in flight. What the steps run is in :mod:`compiled_attn.graphs` (decode) and
:mod:`compiled_attn.mixed_graphs` (mixed); the packing of chunks into host columns in
:mod:`compiled_attn.metadata`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import torch

from .block_allocator import slot_of
from .metadata import AttentionMetadata, PackedChunks, block_table_rows, pinned
from .ops import PAD_SLOT_ID


def write_buffers(owner, columns: dict[str, list], block_tables: Sequence[Sequence[int]]) -> None:
    """Copy host ``columns`` (attribute name -> values) into the leading entries of
    ``owner``'s device buffers of those names, and ``block_tables`` into the top-left corner
    of ``owner.block_table`` (:func:`~compiled_attn.metadata.block_table_rows`): the buffers of a decode or
    mixed step (:class:`DecodeBuffers`, :class:`MixedBuffers`), written by
    non-blocking copies. Empty columns are left as they are."""
    for name, values in columns.items():
        if values:
            buffer = getattr(owner, name)
            buffer[: len(values)].copy_(pinned(torch.tensor(values, dtype=buffer.dtype), buffer.device),
                                        non_blocking=True)
    if block_tables:
        table = pinned(block_table_rows(block_tables), owner.block_table.device)
        owner.block_table[: table.shape[0], : table.shape[1]].copy_(table, non_blocking=True)


@dataclass
class DecodeRow:
    """Host description of one decode row: the last token and where the next one goes.

    Attributes:
        token_id: the token to feed (last sampled one).
        position: its position (``seq_len - 1``).
        block_table: the sequence's block ids, covering ``position`` (and ``position + 1``
            so that the on-device advance can address the next slot).
        temperature, top_p, seed: the request's sampling parameters.
    """

    token_id: int
    position: int
    block_table: Sequence[int]
    temperature: float
    top_p: float
    seed: int


class DecodeBuffers:
    """Static device buffers of the decode batch, at the largest size.

    Args:
        max_rows: rows of the largest batch.
        max_blocks_per_seq: ``block_table`` width.
        block_size: tokens per block.
        device: where the buffers live.
    """

    def __init__(self, max_rows: int, max_blocks_per_seq: int, block_size: int, device) -> None:
        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.block_size = block_size
        self.input_ids = zeros(max_rows)
        self.positions = zeros(max_rows)
        self.slot_mapping = torch.full((max_rows,), PAD_SLOT_ID, dtype=torch.int64, device=device)
        self.cu_seqlens_q = torch.arange(max_rows + 1, dtype=torch.int32, device=device)  # one token each
        self.seq_lens = zeros(max_rows, dtype=torch.int32)
        self.block_table = zeros(max_rows, max_blocks_per_seq, dtype=torch.int32)
        self.temperature = zeros(max_rows, dtype=torch.float32)
        self.top_p = torch.ones(max_rows, device=device)
        self.seeds = zeros(max_rows)

    @property
    def max_rows(self) -> int:
        return self.input_ids.shape[0]

    def metadata(self, rows: int) -> AttentionMetadata:
        """Views of the first ``rows`` rows as a decode batch."""
        return AttentionMetadata(
            self.input_ids[:rows], self.positions[:rows], self.slot_mapping[:rows],
            self.cu_seqlens_q[: rows + 1], self.seq_lens[:rows], self.block_table[:rows],
        )

    def write(self, rows: Sequence[DecodeRow], size: int) -> None:
        """Copy ``rows`` into the buffers and pad up to ``size`` rows with safe values.

        Raises:
            ValueError: more rows than ``size`` or ``size`` above the buffers.
        """
        if not len(rows) <= size <= self.max_rows:
            raise ValueError(f"need len(rows) <= size <= {self.max_rows}, got {len(rows)} rows, size {size}")
        pad = size - len(rows)
        bs = self.block_size
        host = {
            "input_ids": [r.token_id for r in rows] + [0] * pad,
            "positions": [r.position for r in rows] + [0] * pad,
            "slot_mapping": [slot_of(r.block_table, r.position, bs) for r in rows]
            + [PAD_SLOT_ID] * pad,
            "seq_lens": [r.position + 1 for r in rows] + [0] * pad,
            "temperature": [r.temperature for r in rows] + [0.0] * pad,
            "top_p": [r.top_p for r in rows] + [1.0] * pad,
            "seeds": [r.seed for r in rows] + [0] * pad,
        }
        # the rows' own block ids only: a padding row has no keys, so its table is never read
        write_buffers(self, host, [r.block_table for r in rows])

    def set_block(self, row: int, index: int, block_id: int) -> None:
        """Write one new block id (a sequence crossed into a new block).

        A fill kernel with the id as its argument, enqueued behind the step in flight.
        ``table[i, j] = id`` would instead copy a host scalar without ``non_blocking``,
        which waits for the stream and so for the step in flight.
        """
        self.block_table[row, index].fill_(block_id)


def advance(md: AttentionMetadata, tokens: torch.Tensor, block_size: int) -> None:
    """Move a decode batch to its next token in place, on the device.

    The sampled ``tokens`` become ``input_ids``; live rows (``seq_lens > 0``) step their
    position and length and get the slot of the new position from ``block_table``;
    padding rows stay at length 0 and slot ``PAD_SLOT_ID``.
    """
    live = md.seq_lens > 0
    md.input_ids.copy_(tokens)
    md.positions.add_(live.long())
    md.seq_lens.add_(live.int())
    md.slot_mapping.copy_(torch.where(live, slot_of(md.block_table, md.positions, block_size), PAD_SLOT_ID))


class MixedBuffers:
    """Static device buffers of a mixed step, at the largest captured shape.

    Args:
        sizes: the captured ``(tokens, seqs)`` shapes.
        max_blocks_per_seq: ``block_table`` width.
        device: where the buffers live.

    Attributes:
        input_ids, positions, slot_mapping: ``[max_tokens]`` int64.
        cu_seqlens_q: ``[max_seqs + 1]`` int32; seq_lens: ``[max_seqs]`` int32;
        block_table: ``[max_seqs, max_blocks_per_seq]`` int32.
        draw_rows: ``[max_seqs]`` int64 sequence (logits row) of each draw.
        temperature, top_p: ``[max_seqs]`` float32; seeds, sample_positions: ``[max_seqs]``
            int64 sampling inputs of each draw (see :func:`~compiled_attn.sampling.sample`).
    """

    def __init__(self, sizes: Sequence[tuple[int, int]], max_blocks_per_seq: int, device) -> None:
        self.sizes = sorted(set(sizes))
        self._tokens = sorted({t for t, _ in self.sizes})
        max_tokens = self._tokens[-1]
        max_seqs = max(s for _, s in self.sizes)

        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids, self.positions = zeros(max_tokens), zeros(max_tokens)
        self.slot_mapping = torch.full((max_tokens,), PAD_SLOT_ID, dtype=torch.int64, device=device)
        self.cu_seqlens_q = zeros(max_seqs + 1, dtype=torch.int32)
        self.seq_lens = zeros(max_seqs, dtype=torch.int32)
        self.block_table = zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32)
        self.draw_rows, self.seeds, self.sample_positions = zeros(max_seqs), zeros(max_seqs), zeros(max_seqs)
        self.temperature = zeros(max_seqs, dtype=torch.float32)
        self.top_p = torch.ones(max_seqs, device=device)

    def padded_shape(self, num_tokens: int, num_seqs: int, num_draws: int) -> tuple[int, int] | None:
        """The smallest captured ``(tokens, seqs)`` that holds a step of ``num_tokens``
        tokens in ``num_seqs`` sequences with ``num_draws`` draws (and a padding sequence
        for the pad tokens, if any); ``None`` when none does."""
        i = bisect.bisect_left(self._tokens, num_tokens)
        if i == len(self._tokens):
            return None
        tokens = self._tokens[i]
        seqs_needed = max(num_seqs + (tokens > num_tokens), num_draws)
        fitting = [s for t, s in self.sizes if t == tokens and s >= seqs_needed]
        return (tokens, min(fitting)) if fitting else None

    def metadata(self, tokens: int, seqs: int) -> AttentionMetadata:
        """Views of the buffers as a batch of ``tokens`` tokens in ``seqs`` sequences."""
        return AttentionMetadata(self.input_ids[:tokens], self.positions[:tokens], self.slot_mapping[:tokens],
                                 self.cu_seqlens_q[: seqs + 1], self.seq_lens[:seqs], self.block_table[:seqs])

    def write(self, packed: PackedChunks, shape: tuple[int, int], draws: Sequence[tuple[int, float, float, int, int]],
              greedy: bool = False) -> None:
        """Copy one step into the buffers, padded to ``shape`` (from :meth:`padded_shape`).

        ``draws`` holds ``(sequence, temperature, top_p, seed, position)`` per sampled
        token; ``greedy`` (every draw takes the argmax) writes their rows only. Only the
        step's own ``block_table`` rows, and in them the columns up to the longest
        (:func:`~compiled_attn.metadata.block_table_rows`), are written: a padding sequence
        has no keys, so its row is never read.
        """
        tokens, seqs = shape
        pad_tokens, pad_seqs, pad_draws = tokens - packed.num_tokens, seqs - packed.num_seqs, seqs - len(draws)
        rows, temperature, top_p, seeds, positions = (list(column) for column in zip(*draws)) if draws else [[]] * 5
        host = {
            "input_ids": packed.input_ids + [0] * pad_tokens,
            "positions": packed.positions + [0] * pad_tokens,
            "slot_mapping": packed.slot_mapping + [PAD_SLOT_ID] * pad_tokens,
            "cu_seqlens_q": packed.cu_seqlens_q + [tokens] * pad_seqs,
            "seq_lens": packed.seq_lens + [0] * pad_seqs,
            "draw_rows": rows + [0] * pad_draws,
        }
        if not greedy:
            host.update(temperature=temperature + [0.0] * pad_draws, top_p=top_p + [1.0] * pad_draws,
                        seeds=seeds + [0] * pad_draws, sample_positions=positions + [0] * pad_draws)
        write_buffers(self, host, packed.block_table)

    def write_padding(self, shape: tuple[int, int]) -> None:
        """Write a step of ``shape`` that is all padding (what capturing runs on: the
        attention kernels need ``cu_seqlens_q`` to end at the token count)."""
        self.write(PackedChunks([], [], [], [0], [], [], self.block_table.shape[1], prefill_only=False), shape, [])
