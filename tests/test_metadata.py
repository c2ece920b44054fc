"""build_metadata: exact tensors of a mixed batch, errors, pytree round trip."""

from __future__ import annotations

import random

import pytest
import torch
import torch.utils._pytree as pytree

from compiled_attn.metadata import (
    PAD_SLOT_ID,
    TENSOR_FIELDS,
    AttentionMetadata,
    SequenceChunk,
    block_table_rows,
    build_metadata,
    pack_chunks,
    pinned,
)
from compiled_attn.step_inputs import StagedBuffers

BLOCK_SIZE = 4
MAX_BLOCKS = 4
NUM_BLOCKS = 10


def mixed_chunks() -> list[SequenceChunk]:
    return [
        # prefill: 5 tokens, positions 0..4 in blocks 3, 5
        SequenceChunk([11, 12, 13, 14, 15], 0, [3, 5]),
        # chunked prefill on top of 6 cached tokens: positions 6..8 in blocks 0, 7, 2
        SequenceChunk([21, 22, 23], 6, [0, 7, 2]),
        # decode: position 9 in blocks 1, 4, 6
        SequenceChunk([31], 9, [1, 4, 6]),
        # multi-token (speculative) decode: positions 3, 4 in blocks 8, 9
        SequenceChunk([41, 42], 3, [8, 9]),
    ]


def test_mixed_batch_exact_values_and_dtypes():
    md = build_metadata(mixed_chunks(), BLOCK_SIZE, MAX_BLOCKS, "cpu", NUM_BLOCKS)
    assert md.input_ids.tolist() == [11, 12, 13, 14, 15, 21, 22, 23, 31, 41, 42]
    assert md.positions.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 3, 4]
    assert md.slot_mapping.tolist() == [
        3 * 4 + 0, 3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 5 * 4 + 0,  # seq 0
        7 * 4 + 2, 7 * 4 + 3, 2 * 4 + 0,  # seq 1: positions 6, 7 in block 7; 8 in block 2
        6 * 4 + 1,  # seq 2: position 9 in block 6
        8 * 4 + 3, 9 * 4 + 0,  # seq 3: positions 3 (block 8), 4 (block 9)
    ]
    assert md.cu_seqlens_q.tolist() == [0, 5, 8, 9, 11]
    assert md.seq_lens.tolist() == [5, 9, 10, 5]
    assert md.block_table.tolist() == [[3, 5, 0, 0], [0, 7, 2, 0], [1, 4, 6, 0], [8, 9, 0, 0]]
    assert md.prefill_only is False
    assert md.query_lens == (5, 3, 1, 2)
    assert md.num_seqs == 4 and md.num_tokens == 11
    assert md.last_token_indices().tolist() == [4, 7, 8, 10]
    assert md.last_token_indices().dtype == torch.int64
    dtypes = {name: getattr(md, name).dtype for name in TENSOR_FIELDS}
    assert dtypes == {
        "input_ids": torch.int64, "positions": torch.int64, "slot_mapping": torch.int64,
        "cu_seqlens_q": torch.int32, "seq_lens": torch.int32, "block_table": torch.int32,
    }
    for name in TENSOR_FIELDS:
        assert getattr(md, name).device.type == "cpu"
    assert (md.slot_mapping != PAD_SLOT_ID).all()


def test_prefill_only_flag_and_single_decode():
    md = build_metadata([SequenceChunk([1, 2], 0, [4]), SequenceChunk([3], 0, [2])], 4, 2)
    assert md.prefill_only is True
    assert md.slot_mapping.tolist() == [16, 17, 8]
    assert md.block_table.tolist() == [[4, 0], [2, 0]]
    md = build_metadata([SequenceChunk([7], 5, [1, 0])], 4, 2)
    assert md.prefill_only is False
    assert md.positions.tolist() == [5]
    assert md.slot_mapping.tolist() == [0 * 4 + 1]
    assert md.seq_lens.tolist() == [6]
    assert md.cu_seqlens_q.tolist() == [0, 1]
    assert md.block_table.shape == (1, 2)


def test_block_table_exactly_full_width_and_exact_cover_are_fine():
    # 8 tokens fill two blocks of 4 exactly; table width equals max_blocks_per_seq.
    md = build_metadata([SequenceChunk(list(range(8)), 0, [6, 2])], 4, 2, num_blocks=7)
    assert md.block_table.tolist() == [[6, 2]]
    assert md.slot_mapping.tolist() == [24, 25, 26, 27, 8, 9, 10, 11]


def test_empty_batch():
    with pytest.raises(ValueError, match="chunks.*empty batch"):
        build_metadata([], BLOCK_SIZE, MAX_BLOCKS)


def test_empty_chunk_names_the_chunk():
    chunks = [SequenceChunk([1], 0, [0]), SequenceChunk([], 3, [1])]
    with pytest.raises(ValueError, match=r"chunks\[1\].*>= 1 new token"):
        build_metadata(chunks, BLOCK_SIZE, MAX_BLOCKS)


def test_negative_context_len():
    with pytest.raises(ValueError, match=r"chunks\[0\].*context_len"):
        build_metadata([SequenceChunk([1], -1, [0])], BLOCK_SIZE, MAX_BLOCKS)


def test_block_table_too_short_names_the_field():
    # context 6 + 3 new = 9 tokens need 3 blocks of 4; only 2 given.
    chunks = [SequenceChunk([1], 0, [0]), SequenceChunk([1, 2, 3], 6, [0, 1])]
    with pytest.raises(ValueError, match=r"chunks\[1\]\.block_table has 2 blocks.*seq_len=9"):
        build_metadata(chunks, BLOCK_SIZE, MAX_BLOCKS)


def test_block_table_too_wide_names_the_field():
    with pytest.raises(ValueError, match=r"chunks\[0\]\.block_table.*max_blocks_per_seq=4"):
        build_metadata([SequenceChunk([1], 0, [0, 1, 2, 3, 4])], BLOCK_SIZE, MAX_BLOCKS)


@pytest.mark.parametrize("bad", [10, -1, 99])
def test_block_id_out_of_range_names_the_field(bad):
    chunks = [SequenceChunk([1, 2], 0, [0]), SequenceChunk([1], 4, [2, bad])]
    with pytest.raises(ValueError, match=r"chunks\[1\]\.block_table .*outside \[0, 10\)"):
        build_metadata(chunks, BLOCK_SIZE, MAX_BLOCKS, num_blocks=NUM_BLOCKS)


def test_block_ids_not_checked_without_num_blocks():
    md = build_metadata([SequenceChunk([1], 0, [50])], BLOCK_SIZE, MAX_BLOCKS)
    assert md.slot_mapping.tolist() == [200]


@pytest.mark.parametrize("prefill_only", [False, True])
def test_pytree_round_trip_keeps_tensors_and_prefill_only(prefill_only):
    chunks = mixed_chunks() if not prefill_only else [SequenceChunk([1, 2, 3], 0, [2])]
    md = build_metadata(chunks, BLOCK_SIZE, MAX_BLOCKS)
    assert md.prefill_only is prefill_only
    leaves, spec = pytree.tree_flatten(md)
    assert len(leaves) == len(TENSOR_FIELDS)
    for leaf, name in zip(leaves, TENSOR_FIELDS):
        assert leaf is getattr(md, name)
    back = pytree.tree_unflatten(leaves, spec)
    assert isinstance(back, AttentionMetadata)
    assert back.prefill_only is prefill_only
    for name in TENSOR_FIELDS:
        assert getattr(back, name) is getattr(md, name)
    # tree_map transforms every tensor and keeps the static flag.
    doubled = pytree.tree_map(lambda t: t * 2, md)
    assert doubled.prefill_only is prefill_only
    assert doubled.input_ids.tolist() == [2 * i for i in md.input_ids.tolist()]
    assert doubled.block_table.dtype == torch.int32


def test_pytree_spec_differs_by_prefill_only_and_keys_name_fields():
    a = build_metadata([SequenceChunk([1], 0, [0])], BLOCK_SIZE, MAX_BLOCKS)
    b = build_metadata([SequenceChunk([1], 2, [0])], BLOCK_SIZE, MAX_BLOCKS)
    assert pytree.tree_structure(a) != pytree.tree_structure(b)
    paths = [path for path, _ in pytree.tree_flatten_with_path(a)[0]]
    assert [p[0].name for p in paths] == list(TENSOR_FIELDS)


def test_block_table_rows_pad_to_the_longest_row_only():
    assert block_table_rows([[3, 5], [7], [1, 2, 4]]).tolist() == [[3, 5, 0], [7, 0, 0], [1, 2, 4]]
    assert block_table_rows([]).shape == (0, 0)
    packed = pack_chunks([SequenceChunk([1, 2, 3], 0, [6])], block_size=4, max_blocks_per_seq=5)
    assert packed.block_table == [[6]]  # unpadded on the host; the device tensor has the full width
    assert packed.to_device("cpu").block_table.tolist() == [[6, 0, 0, 0, 0]]


def test_pinned_leaves_host_tensors_for_the_cpu_alone():
    host = torch.arange(5)
    assert pinned(host, "cpu") is host
    assert pinned(host, torch.device("cpu")) is host


def test_staged_buffers_set_leading_entries_of_whole_tensors():
    staged = StagedBuffers({"input_ids": ((6,), torch.int64, 7), "seeds": ((3,), torch.int64, 0),
                            "block_table": ((3, 4), torch.int32, -1), "top_p": ((2,), torch.float32, 1.0)}, "cpu")
    bufs = staged.buffers
    assert bufs["input_ids"].tolist() == [7] * 6 and bufs["top_p"].tolist() == [1.0, 1.0]
    assert all(b.storage_offset() == 0 for b in bufs.values())  # no views: see StagedBuffers
    staged.write({"input_ids": [1, 2], "seeds": [], "top_p": [0.5]}, [[5, 6, 7], [8]])
    assert bufs["input_ids"].tolist() == [1, 2, 7, 7, 7, 7] and bufs["seeds"].tolist() == [0, 0, 0]
    assert bufs["block_table"].tolist() == [[5, 6, 7, -1], [8, 0, 0, -1], [-1] * 4]  # padded to the longest row
    assert bufs["top_p"].tolist() == [0.5, 1.0]
    staged.write({"seeds": [9, 9, 9]})
    assert bufs["input_ids"].tolist() == [1, 2, 7, 7, 7, 7] and bufs["seeds"].tolist() == [9, 9, 9]


def test_staged_writes_equal_writes_in_place():
    """Through the staging areas (one copy and one ``_foreach_copy_`` per dtype, as on
    CUDA), 200 random writes leave every buffer as writing in place does: offsets, lengths,
    dtypes, whole block-table rows."""
    columns = {"input_ids": ((32,), torch.int64, 0), "slot_mapping": ((32,), torch.int64, -1),
               "seeds": ((8,), torch.int64, 0), "seq_lens": ((8,), torch.int32, 0),
               "block_table": ((8, 6), torch.int32, 0), "top_p": ((8,), torch.float32, 1.0)}
    staged, direct = StagedBuffers(columns, "cpu", staged=True), StagedBuffers(columns, "cpu")
    rng = random.Random(0)
    for _ in range(200):
        write = {name: [rng.randrange(-5, 100) if dtype != torch.float32 else rng.random()
                        for _ in range(rng.choice([0, 1, shape[0] // 2, shape[0]]))]
                 for name, (shape, dtype, _) in columns.items() if name != "block_table" and rng.random() < 0.7}
        tables = [[rng.randrange(50) for _ in range(rng.randint(1, 6))] for _ in range(rng.randint(0, 8))]
        staged.write(write, tables)
        direct.write(write, tables)
        for name in columns:
            assert torch.equal(staged.buffers[name], direct.buffers[name]), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_buffer_writes_through_pinned_mirrors_arrive_whole():
    """Host columns for CUDA go through page-locked mirrors, so the copies return before
    they run; behind a busy stream, a step queued after each write reads that write's
    values (a write waits for the previous write's copies before it refills the mirrors)."""
    assert pinned(torch.arange(5), "cuda").is_pinned()

    staged, seen = StagedBuffers({"input_ids": ((4096,), torch.int64, -1),
                                  "block_table": ((8, 64), torch.int32, -1)}, "cuda"), []
    input_ids, block_table = staged.buffers["input_ids"], staged.buffers["block_table"]
    torch.cuda._sleep(50_000_000)  # the copies queue behind ~25 ms of device time
    for step in range(3):
        staged.write({"input_ids": [step * 10_000 + i for i in range(4000)]}, [[step, 1, 2], [3 + step]])
        seen.append((input_ids[:4000].clone(), block_table[:2, :3].clone()))  # a step behind it
    for step, (ids, table) in enumerate(seen):
        assert ids.tolist() == [step * 10_000 + i for i in range(4000)]
        assert table.tolist() == [[step, 1, 2], [3 + step, 0, 0]]
    packed = pack_chunks([SequenceChunk([1, 2, 3], 0, [6])], block_size=4, max_blocks_per_seq=5)
    md = packed.to_device("cuda")
    assert md.input_ids.tolist() == [1, 2, 3] and md.block_table.tolist() == [[6, 0, 0, 0, 0]]
