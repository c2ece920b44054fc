"""Step inputs: the static device buffers that decode and mixed steps read, and the host
writes into them.

A captured CUDA graph reads fixed addresses, so every step's inputs go into buffers that
live as long as the graphs: :class:`DecodeBuffers` for decode steps (one row per running
request, padded to a capture size; :func:`advance` moves them to the next token on the
device) and :class:`MixedBuffers` for mixed steps (prefill chunks and decode rows, padded to
a captured ``(tokens, seqs)`` shape). The host's columns reach them through page-locked
memory by non-blocking copies (:class:`StagedBuffers`), so writing never waits for the step
in flight. What the steps run is in :mod:`compiled_attn.graphs` (decode) and
:mod:`compiled_attn.mixed_graphs` (mixed); the packing of chunks into host columns in
:mod:`compiled_attn.metadata`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .block_allocator import slot_of
from .metadata import AttentionMetadata, PackedChunks
from .ops import PAD_SLOT_ID


class StagedBuffers:
    """Static device buffers that the host writes with one copy and one kernel per dtype.

    Each buffer (``columns``: name -> ``(shape, dtype, initial value)``) is a tensor of its
    own. On a CUDA device the buffers of each dtype also have a staging area: a flat
    page-locked host mirror and a flat device tensor of the same layout (the columns back
    to back, in the order given). A :meth:`write` puts the values into the mirror (numpy
    slice assignments), copies the mirror up to the end of the last entry it wrote to the
    device (one non-blocking copy per dtype, so it never waits for the step in flight) and
    from there into the written entries of the buffers (``torch._foreach_copy_``: one
    kernel per dtype). (One page-locked ``pin_memory()`` copy per column cost 0.43 ms of
    host time for a median mixed step on the H200's host, persistent mirrors with one copy
    per column 0.36-0.47 ms: ``profiling/results/serving.md``, 2026-12-01. The buffers stay
    whole tensors, not views of one flat tensor: views' storage offsets become symbols
    of the compiled forward, duck-sized into guards that recompile it.) Before it refills
    the mirror, a write waits for the previous write's copies (an event; in the engine
    they have run already: a step's inputs are written after the previous step of the
    same buffers was read). On the CPU the buffers are written in place.

    Args:
        columns: name -> ``(shape, dtype, initial value)`` of each buffer.
        device: where the buffers live.
        staged: write through the staging areas (default: on CUDA devices); on the CPU it
            stages through ordinary host memory (the tests check the staging there).

    Attributes:
        buffers: name -> the device buffer.
    """

    def __init__(self, columns: dict[str, tuple[tuple[int, ...], torch.dtype, float]], device,
                 staged: bool | None = None) -> None:
        device = torch.device(device)
        cuda = device.type == "cuda"
        self.buffers = {name: torch.full(shape, value, dtype=dtype, device=device)
                        for name, (shape, dtype, value) in columns.items()}
        self._host: dict[str, np.ndarray] = {}  # name -> numpy view of where the host writes it
        self._place: dict[str, tuple[torch.dtype, int]] = {}  # name -> (dtype, offset in its staging area)
        self._staging: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # dtype -> (host, device)
        if not (cuda if staged is None else staged):
            self._host = {name: buffer.numpy() for name, buffer in self.buffers.items()}
        else:
            for dtype in dict.fromkeys(dtype for _, dtype, _ in columns.values()):
                names = [name for name, (_, d, _) in columns.items() if d == dtype]
                host = torch.empty(sum(self.buffers[n].numel() for n in names), dtype=dtype, pin_memory=cuda)
                offset = 0
                for name in names:
                    buffer, value = self.buffers[name], columns[name][2]
                    self._host[name] = host[offset: offset + buffer.numel()].view(buffer.shape).fill_(value).numpy()
                    self._place[name] = (dtype, offset)
                    offset += buffer.numel()
                self._staging[dtype] = (host, torch.empty_like(host, device=device))
        self._copied: torch.cuda.Event | None = None

    def write(self, columns: dict[str, list], block_tables: Sequence[Sequence[int]] = ()) -> None:
        """Set the leading entries of the named 1-D buffers to ``columns`` (name -> values;
        empty ones are left as they are), and the top-left corner of ``block_table`` to
        ``block_tables`` (rows of block ids, shorter rows padded with block 0 up to the
        longest: :func:`~compiled_attn.metadata.block_table_rows`'s layout; on CUDA the
        rows are copied whole, their entries past that as the mirror holds them: a
        sequence's keys end within its blocks, so they are never read)."""
        if self._copied is not None:
            self._copied.synchronize()
        written = {}  # name -> elements written
        for name, values in columns.items():
            if values:
                self._host[name][: len(values)] = values
                written[name] = len(values)
        if block_tables:
            table, width = self._host["block_table"], max(map(len, block_tables))
            for i, row in enumerate(block_tables):
                table[i, : len(row)] = row
                table[i, len(row): width] = 0
            written["block_table"] = len(block_tables) * table.shape[1]
        if not self._staging or not written:
            return
        for dtype, (host, device) in self._staging.items():
            names = [name for name in written if self._place[name][0] == dtype]
            if names:
                end = max(self._place[name][1] + written[name] for name in names)
                device[:end].copy_(host[:end], non_blocking=True)
                torch._foreach_copy_(
                    [self.buffers[name].view(-1)[: written[name]] for name in names],
                    [device[self._place[name][1]: self._place[name][1] + written[name]] for name in names])
        if device.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(device.device))


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
        self.block_size = block_size
        self._staged = StagedBuffers({
            "input_ids": ((max_rows,), torch.int64, 0), "positions": ((max_rows,), torch.int64, 0),
            "slot_mapping": ((max_rows,), torch.int64, PAD_SLOT_ID), "seeds": ((max_rows,), torch.int64, 0),
            "seq_lens": ((max_rows,), torch.int32, 0),
            "block_table": ((max_rows, max_blocks_per_seq), torch.int32, 0),
            "temperature": ((max_rows,), torch.float32, 0.0), "top_p": ((max_rows,), torch.float32, 1.0),
        }, device)
        for name, buffer in self._staged.buffers.items():
            setattr(self, name, buffer)
        self.cu_seqlens_q = torch.arange(max_rows + 1, dtype=torch.int32, device=device)  # one token each

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
        self._staged.write(host, [r.block_table for r in rows])

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
        feed_index, feed_rows: ``[max_seqs]`` int64: the ``input_ids`` entry of each decode
            row fed on the device (:meth:`feed`) and its row in the tokens fed from.
    """

    def __init__(self, sizes: Sequence[tuple[int, int]], max_blocks_per_seq: int, device) -> None:
        self.sizes = sorted(set(sizes))
        self._tokens = sorted({t for t, _ in self.sizes})
        max_tokens = self._tokens[-1]
        max_seqs = max(s for _, s in self.sizes)

        self._staged = StagedBuffers({
            "input_ids": ((max_tokens,), torch.int64, 0), "positions": ((max_tokens,), torch.int64, 0),
            "slot_mapping": ((max_tokens,), torch.int64, PAD_SLOT_ID), "draw_rows": ((max_seqs,), torch.int64, 0),
            "feed_index": ((max_seqs,), torch.int64, 0), "feed_rows": ((max_seqs,), torch.int64, 0),
            "seeds": ((max_seqs,), torch.int64, 0), "sample_positions": ((max_seqs,), torch.int64, 0),
            "cu_seqlens_q": ((max_seqs + 1,), torch.int32, 0), "seq_lens": ((max_seqs,), torch.int32, 0),
            "block_table": ((max_seqs, max_blocks_per_seq), torch.int32, 0),
            "temperature": ((max_seqs,), torch.float32, 0.0), "top_p": ((max_seqs,), torch.float32, 1.0),
        }, device)
        for name, buffer in self._staged.buffers.items():
            setattr(self, name, buffer)

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
              greedy: bool = False, feed: Sequence[tuple[int, int]] = ()) -> None:
        """Copy one step into the buffers, padded to ``shape`` (from :meth:`padded_shape`).

        ``draws`` holds ``(sequence, temperature, top_p, seed, position)`` per sampled
        token; ``greedy`` (every draw takes the argmax) writes their rows only. Only the
        step's own ``block_table`` rows, and in them the columns up to the longest
        (:func:`~compiled_attn.metadata.block_table_rows`), are meaningful: a padding
        sequence has no keys, so its row is never read. ``feed`` holds ``(input_ids entry,
        row)`` pairs of decode rows whose input token :meth:`feed` copies in on the device.
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
            "feed_index": [entry for entry, _ in feed],
            "feed_rows": [row for _, row in feed],
        }
        if not greedy:
            host.update(temperature=temperature + [0.0] * pad_draws, top_p=top_p + [1.0] * pad_draws,
                        seeds=seeds + [0] * pad_draws, sample_positions=positions + [0] * pad_draws)
        self._staged.write(host, packed.block_table)

    def feed(self, tokens: torch.Tensor, count: int) -> None:
        """On the device, ``input_ids[feed_index[i]] = tokens[feed_rows[i]]`` for the first
        ``count`` pairs of the last :meth:`write` (``tokens``: int64, e.g. the sampled
        tokens of the decode step in flight)."""
        self.input_ids.index_copy_(0, self.feed_index[:count], tokens.index_select(0, self.feed_rows[:count]))

    def write_padding(self, shape: tuple[int, int]) -> None:
        """Write a step of ``shape`` that is all padding (what capturing runs on: the
        attention kernels need ``cu_seqlens_q`` to end at the token count)."""
        self.write(PackedChunks([], [], [], [0], [], [], self.block_table.shape[1], prefill_only=False), shape, [])
