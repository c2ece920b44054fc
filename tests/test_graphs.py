"""The CUDA-graph runner's host logic on the CPU: sizes, padding, on-device advance.

A replay runs ``decode_step`` over the padded rows; here the same function runs eagerly
over the padded rows, which is what a captured graph replays.
"""

from __future__ import annotations

import pytest
import torch

from compiled_attn.engine import Engine
from compiled_attn.graphs import CUDAGraphRunner, decode_step, default_capture_sizes
from compiled_attn.step_inputs import DecodeBuffers, DecodeRow, advance
from compiled_attn.models import DiffLlamaConfig, build_random_model
from compiled_attn.sampling import SamplingParams

CONFIG = DiffLlamaConfig(
    vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    eos_token_id=None, lambda_std_dev=0.3,
)


def test_default_capture_sizes():
    assert default_capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert default_capture_sizes(5) == [1, 2, 4, 5]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    with pytest.raises(ValueError, match="max_batch_size"):
        default_capture_sizes(0)


def test_padded_size_picks_the_smallest_fitting_capture():
    runner = CUDAGraphRunner(lambda rows: torch.zeros(rows), [8, 1, 2, 4, 16])
    assert [runner.padded_size(n) for n in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    assert runner.padded_size(17) is None and runner.max_size == 16


def test_write_pads_rows_with_kernel_safe_values():
    buffers = DecodeBuffers(max_rows=6, max_blocks_per_seq=4, block_size=4, device="cpu")
    rows = [DecodeRow(11, 5, [7, 2], 0.5, 0.9, 3), DecodeRow(12, 0, [1], 0.0, 1.0, 4)]
    buffers.write(rows, size=4)
    md = buffers.metadata(4)
    assert md.input_ids.tolist() == [11, 12, 0, 0]
    assert md.positions.tolist() == [5, 0, 0, 0]
    assert md.slot_mapping.tolist() == [2 * 4 + 1, 1 * 4 + 0, -1, -1]
    assert md.seq_lens.tolist() == [6, 1, 0, 0]
    assert md.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    assert md.block_table.tolist() == [[7, 2, 0, 0], [1, 0, 0, 0], [0] * 4, [0] * 4]
    assert buffers.temperature[:4].tolist() == [0.5, 0.0, 0.0, 0.0]
    assert buffers.seeds[:4].tolist() == [3, 4, 0, 0]
    with pytest.raises(ValueError, match="size"):
        buffers.write(rows, size=1)


def test_advance_moves_live_rows_and_keeps_padding_inert():
    buffers = DecodeBuffers(max_rows=3, max_blocks_per_seq=3, block_size=4, device="cpu")
    buffers.write([DecodeRow(1, 3, [5, 9], 0, 1, 0), DecodeRow(2, 6, [4, 8], 0, 1, 0)], size=3)
    md = buffers.metadata(3)
    advance(md, torch.tensor([40, 41, 42]), block_size=4)
    assert md.input_ids.tolist() == [40, 41, 42]
    assert md.positions.tolist() == [4, 7, 0]
    assert md.seq_lens.tolist() == [5, 8, 0]
    # position 4 -> block 9 offset 0; position 7 -> block 8 offset 3; padding stays -1.
    assert md.slot_mapping.tolist() == [9 * 4, 8 * 4 + 3, -1]


def _emulate_graphs(engine: Engine, sizes: list[int]) -> list[tuple[int, bool]]:
    """Make the engine pad every decode batch to a capture size and run the padded step,
    as a replay would; returns the (size, greedy) variants used."""
    runner = CUDAGraphRunner(lambda rows, greedy: None, sizes)
    used = []

    def replay(size, greedy=False):
        used.append((size, greedy))
        return decode_step(engine.runner.forward, engine.kv_cache.layers, engine.runner.buffers, size, greedy=greedy)

    runner.replay = replay
    engine.runner.graph_runner = runner
    engine.cuda_graphs = True
    return used


def test_padded_replays_give_the_tokens_of_unpadded_steps():
    model = build_random_model(CONFIG, seed=1)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11], [12, 13]]
    params = [SamplingParams(max_new_tokens=n, temperature=t) for n, t in zip((14, 9, 5, 12, 2), (0, 0.8, 0, 1.0, 0))]
    plain, _ = Engine(model, compile=False, block_size=4).generate(prompts, params, seed=7)
    engine = Engine(model, compile=False, block_size=4, max_num_seqs=8)
    used = _emulate_graphs(engine, [1, 2, 4, 8])
    padded, _ = engine.generate(prompts, params, seed=7)
    assert [c.output_ids for c in padded] == [c.output_ids for c in plain]
    assert {size for size, _ in used} == {8, 4, 2, 1}  # 5, 4, 3, 2, 1 live rows
    # Sampled rows run the sampler; the last steps (one greedy row) the argmax variant.
    assert (8, False) in used and (1, True) in used and (1, False) not in used


def test_greedy_variant_picks_the_samplers_greedy_tokens():
    model = build_random_model(CONFIG, seed=3)
    engine = Engine(model, compile=False, block_size=4, num_blocks=32)
    rows = []
    for prompt in ([1, 2, 3, 4, 5], [6, 7], [8]):
        request = engine.add_request(prompt, SamplingParams(max_new_tokens=4))
        engine.step()
        rows.append(request.decode_row(engine.kv_cache.allocator.allocate(request.request_id, len(prompt) + 2)))
    tokens = {}
    for greedy in (False, True):
        buffers = DecodeBuffers(4, engine.max_blocks_per_seq, 4, "cpu")
        buffers.write(rows, 4)
        with torch.inference_mode():
            tokens[greedy] = decode_step(model, engine.kv_cache.layers, buffers, 4, greedy=greedy)
    assert torch.equal(tokens[True], tokens[False])


def test_poisoned_padding_never_reaches_real_rows():
    """Garbage in padded rows (huge positions, random blocks, NaN temperature, garbage in
    unused cache blocks) leaves real rows exactly as without padding."""
    model = build_random_model(CONFIG, seed=2)
    engine = Engine(model, compile=False, block_size=4, num_blocks=32)
    for k, v in engine.kv_cache.layers:
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    rows = []
    for i, prompt in enumerate(([1, 2, 3, 4, 5], [6, 7])):
        request = engine.add_request(prompt, SamplingParams(max_new_tokens=4))
        engine.step()
        rows.append(request.decode_row(engine.kv_cache.allocator.allocate(request.request_id, len(prompt) + 2)))
    clean = DecodeBuffers(8, engine.max_blocks_per_seq, 4, "cpu")
    clean.write(rows, 2)
    with torch.inference_mode():
        want = decode_step(model, engine.kv_cache.layers, clean, 2)
    caches_after_clean = [t.clone() for pair in engine.kv_cache.layers for t in pair]

    poisoned = DecodeBuffers(8, engine.max_blocks_per_seq, 4, "cpu")
    poisoned.write(rows, 8)
    poisoned.input_ids[2:8] = torch.randint(0, CONFIG.vocab_size, (6,))
    poisoned.positions[2:8] = 10**6
    poisoned.block_table[2:8] = torch.randint(0, 32, (6, engine.max_blocks_per_seq), dtype=torch.int32)
    poisoned.temperature[2:8] = float("nan")
    poisoned.top_p[2:8] = float("nan")
    with torch.inference_mode():
        got = decode_step(model, engine.kv_cache.layers, poisoned, 8)
    assert torch.equal(got[:2], want)
    # Padding rows wrote nothing: the caches equal those after the clean (real-only) step,
    # NaN where nothing was ever written (real rows' K/V may differ in the last bits: the
    # matmuls of a batch of 8 round differently from those of a batch of 2).
    after = [t for pair in engine.kv_cache.layers for t in pair]
    for a, b in zip(after, caches_after_clean):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
