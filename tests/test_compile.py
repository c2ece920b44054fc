"""torch.compile(fullgraph=True) of the whole model: no graph breaks, no recompiles."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from compiled_attn.compile import CompiledFunction
from compiled_attn.engine import Engine
from compiled_attn.metadata import SequenceChunk, build_metadata
from compiled_attn.models import DiffLlamaConfig, build_random_model
from compiled_attn.sampling import SamplingParams

pytestmark = pytest.mark.slow

CONFIG = DiffLlamaConfig(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
    eos_token_id=None, lambda_std_dev=0.3,
)


def _workload(engine: Engine):
    """Batches that change size every few steps, then a second prefill of new lengths."""
    lengths, budgets, temperatures = (5, 9, 13, 3), (3, 7, 1, 10), (0, 1, 0.7, 0)  # ints on purpose
    prompts = [[(7 * i + j) % CONFIG.vocab_size for j in range(n)] for i, n in enumerate(lengths)]
    first, _ = engine.generate(prompts, [SamplingParams(max_new_tokens=b, temperature=t)
                                         for b, t in zip(budgets, temperatures)])
    second, _ = engine.generate([list(range(17)), [4, 2]], [SamplingParams(max_new_tokens=b) for b in (4, 6)])
    return [c.output_ids for c in first + second]


def test_decode_loop_compiles_once_per_variant_and_matches_eager():
    torch._dynamo.reset()
    model = build_random_model(CONFIG, seed=5)
    engine = Engine(model, compile=True, block_size=16, num_blocks=32)
    engine.generate([[1], [2]], SamplingParams(max_new_tokens=2))  # warm-up: prefill, decode, sampler
    stats = engine.compile_stats
    assert (stats.graphs_compiled, stats.graph_breaks, stats.recompiles) == (3, 0, 0)

    compiled_tokens = _workload(engine)
    # A mixed batch (chunked prefill beside decodes) goes through the general graph.
    table = engine.kv_cache.allocator.allocate(99, 40)
    md = build_metadata([SequenceChunk(list(range(20)), 0, table[:2]), SequenceChunk([3, 4, 5], 30, table)],
                        16, engine.max_blocks_per_seq)
    md.prefill_only = False
    with torch.no_grad():
        mixed = engine.runner.forward(md, engine.kv_cache.layers)

    assert stats.graphs_compiled == 3, "a batch shape triggered a new graph"
    assert stats.recompiles == 0
    assert stats.graph_breaks == 0
    eager = Engine(model, compile=False, block_size=16, num_blocks=32)
    assert compiled_tokens == _workload(eager)
    assert len({t for seq in compiled_tokens for t in seq}) > 3
    with torch.no_grad():
        ref = model(md, engine.kv_cache.layers)
    torch.testing.assert_close(mixed, ref, rtol=1e-4, atol=1e-4)


def test_plain_torch_compile_fullgraph_of_the_model():
    """User code: torch.compile(model, fullgraph=True) with no wrapper traces in one graph."""
    torch._dynamo.reset()
    model = build_random_model(CONFIG, seed=6)
    compiled = torch.compile(model, fullgraph=True)
    md = build_metadata([SequenceChunk([1, 2, 3], 0, [0]), SequenceChunk([4], 0, [1])], 16, 2)
    with torch.no_grad():
        out = compiled(md, None, all_logits=True)
        ref = model(md, None, all_logits=True)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    explanation = torch._dynamo.explain(model)(md, None, True)
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1


def test_compiled_forward_counts_a_real_recompile():
    """The accounting is not blind: a new static variant compiles, a shape guard recompiles."""
    torch._dynamo.reset()
    model = build_random_model(CONFIG, seed=7)
    forward = CompiledFunction(model)
    md = build_metadata([SequenceChunk([1, 2], 0, [0])], 16, 2)
    with torch.no_grad():
        forward(md, None)
        forward(md, None, all_logits=True)  # new variant: a compile, not a recompile
        assert (forward.stats.graphs_compiled, forward.stats.recompiles) == (2, 0)
        int32_ids = dataclasses.replace(md, input_ids=md.input_ids.int())  # dtypes are guarded
        forward(int32_ids, None)
    assert forward.stats.recompiles == 1
