"""Mixed-step CUDA graphs' host logic on the CPU: shapes, padding, and the padded step.

A replay runs :func:`mixed_step` over the padded buffers; here the same function runs
eagerly over them, which is what a captured graph replays.
"""

from __future__ import annotations

import pytest
import torch

from compiled_attn.engine import Engine
from compiled_attn.metadata import SequenceChunk, build_metadata, pack_chunks
from compiled_attn.mixed_graphs import default_mixed_capture_sizes, mixed_step
from compiled_attn.step_inputs import MixedBuffers
from compiled_attn.models import DiffLlamaConfig, build_random_model
from compiled_attn.ops import PAD_SLOT_ID
from compiled_attn.sampling import SamplingParams, sample

CONFIG = DiffLlamaConfig(
    vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
    eos_token_id=None, lambda_std_dev=0.3,
)


def test_default_mixed_capture_sizes():
    sizes = default_mixed_capture_sizes(max_num_seqs=6, max_num_batched_tokens=64)
    assert sizes == [(t, s) for t in (16, 24, 32, 48, 64) for s in (1, 2, 4, 8)]
    # seqs reach past max_num_seqs (room for the padding sequence); tokens stop at 2048
    assert max(s for _, s in default_mixed_capture_sizes(8, None)) == 16
    assert sorted({t for t, _ in default_mixed_capture_sizes(8, None)}) == [
        16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    # the budget is a size of its own: every step within it fits a graph
    assert sorted({t for t, _ in default_mixed_capture_sizes(8, 100)}) == [16, 24, 32, 48, 64, 96, 100]
    assert default_mixed_capture_sizes(2, 8) == [(8, 1), (8, 2), (8, 4)]  # a budget below 16


def test_padded_shape_fits_tokens_seqs_draws_and_the_padding_sequence():
    buffers = MixedBuffers(default_mixed_capture_sizes(6, 64), 4, "cpu")
    assert buffers.padded_shape(16, 3, 3) == (16, 4)  # no pad tokens: no padding sequence needed
    assert buffers.padded_shape(16, 4, 4) == (16, 4)
    assert buffers.padded_shape(15, 4, 4) == (16, 8)  # 1 pad token: a fifth sequence
    assert buffers.padded_shape(17, 1, 1) == (24, 2)  # 17 tokens: 24, the next size (16 * 1.5)
    assert buffers.padded_shape(25, 1, 1) == (32, 2)
    assert buffers.padded_shape(20, 2, 5) == (24, 8)  # parallel samples: more draws than sequences
    assert buffers.padded_shape(65, 1, 1) is None  # more tokens than any shape
    assert buffers.padded_shape(16, 8, 8) == (16, 8)
    assert buffers.padded_shape(14, 8, 8) is None  # 8 sequences and a padding one: no shape of 16


def test_write_pads_tokens_into_one_padding_sequence():
    buffers = MixedBuffers([(8, 4)], 3, "cpu")
    packed = pack_chunks([SequenceChunk([5, 6, 7], 2, [4, 1]), SequenceChunk([9], 6, [2, 3])], block_size=4,
                         max_blocks_per_seq=3)
    buffers.write(packed, (8, 4), [(1, 0.5, 0.9, 11, 7), (0, 0.0, 1.0, 12, 5)])
    assert buffers.input_ids.tolist() == [5, 6, 7, 9, 0, 0, 0, 0]
    assert buffers.positions.tolist() == [2, 3, 4, 6, 0, 0, 0, 0]
    assert buffers.slot_mapping.tolist() == [4 * 4 + 2, 4 * 4 + 3, 1 * 4, 3 * 4 + 2] + [PAD_SLOT_ID] * 4
    assert buffers.cu_seqlens_q.tolist() == [0, 3, 4, 8, 8]  # the padding sequence holds tokens 4..7
    assert buffers.seq_lens.tolist() == [5, 7, 0, 0]
    assert buffers.block_table[:2].tolist() == [[4, 1, 0], [2, 3, 0]]  # (the third column: not written)
    assert buffers.draw_rows.tolist() == [1, 0, 0, 0]
    assert buffers.temperature.tolist() == [0.5, 0.0, 0.0, 0.0]
    assert buffers.seeds.tolist() == [11, 12, 0, 0] and buffers.sample_positions.tolist() == [7, 5, 0, 0]


def test_padding_only_step_ends_cu_seqlens_at_the_token_count():
    """What capturing runs on: every token in a padding sequence with no keys, so the
    kernels' tile search stays inside the sequences (all-zero buffers would not)."""
    model = build_random_model(CONFIG, seed=6)
    engine = Engine(model, compile=False, block_size=4, num_blocks=8, max_num_seqs=4)
    buffers = MixedBuffers([(16, 8)], engine.max_blocks_per_seq, "cpu")
    buffers.cu_seqlens_q.fill_(3)
    buffers.write_padding((16, 8))
    assert buffers.cu_seqlens_q.tolist() == [0] + [16] * 8
    assert buffers.seq_lens.tolist() == [0] * 8 and buffers.slot_mapping.tolist() == [PAD_SLOT_ID] * 16
    caches = [(k.clone(), v.clone()) for k, v in engine.kv_cache.layers]
    with torch.no_grad():
        tokens = mixed_step(model, engine.kv_cache.layers, buffers, (16, 8), sample)
    assert tokens.shape == (8,)
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(engine.kv_cache.layers, caches))


def _prefilled_engine(model, prompts):
    """An engine (float64 model: exact comparisons) with ``prompts`` prefilled and one
    token sampled each; returns it and the requests."""
    engine = Engine(model, compile=False, block_size=4, num_blocks=64, max_num_seqs=8)
    requests = [engine.add_request(p, SamplingParams(max_new_tokens=8)) for p in prompts]
    engine.step()
    return engine, requests


def test_padded_step_equals_the_unpadded_forward_and_writes_only_real_slots():
    """A mixed batch (a decode row, a prefix-hit chunk, a fresh prompt) through the padded
    buffers gives the logits and cache writes of the unpadded batch, with garbage (NaN
    in free cache blocks, stale buffer values) in the padding."""
    model = build_random_model(CONFIG, seed=4).double()
    engine, (a, b) = _prefilled_engine(model, [[1, 2, 3, 4, 5], [6, 7, 8]])
    allocator = engine.kv_cache.allocator
    for request in (a, b):
        allocator.allocate(request.request_id, request.num_tokens + 6)
    fresh = list(allocator.allocate(99, 7))
    used = {blk for table in allocator.block_tables.values() for blk in table}
    free = [blk for blk in range(allocator.num_blocks) if blk not in used]
    for k, v in engine.kv_cache.layers:
        k[free] = float("nan")
        v[free] = float("nan")
    chunks = [SequenceChunk([a.output_ids[-1]], a.num_tokens - 1, allocator.block_tables[a.request_id]),
              SequenceChunk([b.output_ids[-1], 30, 31, 32], b.num_tokens - 1, allocator.block_tables[b.request_id]),
              SequenceChunk([40, 41, 42, 43, 44, 45, 46], 0, fresh)]
    caches = [(k.clone(), v.clone()) for k, v in engine.kv_cache.layers]
    with torch.no_grad():
        want = model(build_metadata(chunks, 4, engine.max_blocks_per_seq), caches)
        buffers = MixedBuffers([(16, 4), (16, 8)], engine.max_blocks_per_seq, "cpu")
        buffers.block_table.random_(0, allocator.num_blocks)  # stale rows
        buffers.input_ids.random_(0, CONFIG.vocab_size)
        buffers.positions.random_(0, 100)
        draws = [(i, 0.0, 1.0, i, 0) for i in range(3)]
        shape = buffers.padded_shape(12, 3, 3)
        assert shape == (16, 4)
        buffers.write(pack_chunks(chunks, 4, engine.max_blocks_per_seq), shape, draws)
        logits = []
        tokens = mixed_step(model, engine.kv_cache.layers, buffers, shape,
                            lambda lg, *args: logits.append(lg) or sample(lg, *args))
    torch.testing.assert_close(logits[0][:3], want, rtol=1e-9, atol=1e-9)
    assert tokens[:3].tolist() == want.argmax(-1).tolist()
    for (k, v), (k_want, v_want) in zip(engine.kv_cache.layers, caches):
        assert torch.equal(k[list(used)], k_want[list(used)]) and torch.equal(v[list(used)], v_want[list(used)])
        assert k[free].isnan().all() and v[free].isnan().all()  # pad tokens wrote nothing


def emulate_mixed_graphs(engine: Engine, sizes: list[tuple[int, int]]) -> list[tuple[int, int, bool]]:
    """Give the engine mixed buffers of ``sizes`` and a runner that replays by running the
    padded step eagerly; returns the ``(tokens, seqs, greedy)`` variants replayed."""
    runner = engine.runner
    runner.mixed_buffers = MixedBuffers(sizes, engine.max_blocks_per_seq, "cpu")
    used = []

    class Replayer:
        def replay(self, shape, greedy):
            used.append((*shape, greedy))
            return mixed_step(runner.forward, engine.kv_cache.layers, runner.mixed_buffers, shape, runner.sampler,
                              greedy)

    runner.mixed_graphs = Replayer()
    return used


@pytest.mark.parametrize("budget", [None, 16])
def test_engine_with_mixed_graphs_gives_the_tokens_of_compiled_steps(budget):
    """Prefix hits, chunked prefill, parallel samples and sampled and greedy requests through
    padded mixed steps: the tokens of an engine without mixed graphs."""
    model = build_random_model(CONFIG, seed=5)
    system = list(range(1, 21))
    prompts = [system + [30, 31], system + [32], [40, 41, 42], system + [33, 34, 35], [50] * 40]
    params = [SamplingParams(max_new_tokens=n, temperature=t, n=k)
              for n, t, k in zip((6, 5, 7, 4, 3), (0, 0.8, 0, 1.0, 0), (1, 1, 2, 1, 1))]

    def engine():
        return Engine(model, compile=False, block_size=4, num_blocks=96, max_num_seqs=8,
                      max_num_batched_tokens=budget)

    plain = engine().generate(prompts, params, seed=3)[0]
    graphed = engine()
    used = emulate_mixed_graphs(graphed, default_mixed_capture_sizes(8, budget))
    got = graphed.generate(prompts, params, seed=3)[0]
    assert [c.output_ids for c in got] == [c.output_ids for c in plain]
    assert [s.output_ids for s in got[2].samples] == [s.output_ids for s in plain[2].samples]
    assert used and all(t <= (budget or 2048) for t, _, _ in used)
    assert not all(greedy for *_, greedy in used)  # steps with sampled draws ran the sampler's graphs
    used.clear()  # all-greedy requests: the argmax graphs
    greedy_params = SamplingParams(max_new_tokens=5)
    assert ([c.output_ids for c in graphed.generate(prompts, greedy_params)[0]]
            == [c.output_ids for c in engine().generate(prompts, greedy_params)[0]])
    assert used and all(greedy for *_, greedy in used)


def test_compiled_engine_with_mixed_buffers_compiles_each_variant_once():
    """The compiled forward sees the mixed buffers (padded mixed steps), the decode buffers
    and packed eager steps: one graph per variant, no recompile (buffers that were views
    of one flat tensor recompiled it on their storage offsets)."""
    model = build_random_model(CONFIG, seed=5)
    engine = Engine(model, block_size=4, num_blocks=96, max_num_seqs=8)
    used = emulate_mixed_graphs(engine, default_mixed_capture_sizes(8, None))
    engine.generate([[1, 2, 3], [4, 5, 6, 7, 8], [9] * 20], SamplingParams(max_new_tokens=6))
    engine.add_request([1, 2, 3, 4], SamplingParams(max_new_tokens=4))
    engine.step()
    engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=4))
    while engine.has_unfinished():
        engine.step()
    assert used and engine.compile_stats.recompiles == 0, engine.compile_stats


def test_bad_mixed_capture_sizes_are_clear_errors():
    model = build_random_model(CONFIG, seed=0)
    for sizes in ([(16, 32)], [(16,)], [16], [(16.0, 2)], [(0, 0)]):
        with pytest.raises(ValueError, match="mixed_capture_sizes"):
            Engine(model, compile=False, block_size=4, num_blocks=8, cuda_graphs=False, mixed_capture_sizes=sizes)
