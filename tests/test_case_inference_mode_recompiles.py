"""Case: ``torch.inference_mode()`` around ``Engine.generate`` must not recompile.

Tensors made under inference mode lack the autograd dispatch keys and Dynamo guards on
them, so metadata and sampler inputs made in the caller's mode recompiled the compiled
model and sampler. The engine now makes every tensor it feeds to compiled code in one
mode (:func:`compiled_attn.engine.engine_mode`) whatever the caller's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from compiled_attn.engine import Engine
from compiled_attn.metadata import SequenceChunk, build_metadata
from compiled_attn.models import build_random_model
from compiled_attn.models.config import random_model_config
from compiled_attn.sampling import SamplingParams

pytestmark = pytest.mark.slow

# random_model_config() shrunk so that compiling stays cheap on a small CPU.
TINY = dataclasses.replace(random_model_config(), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8)
PROMPTS = [[1, 2, 3], [4, 5]]
PARAMS = [SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=4, temperature=0.8)]


def _tokens(engine: Engine) -> list[list[int]]:
    completions, _ = engine.generate(PROMPTS, PARAMS)
    return [c.output_ids for c in completions]


def _stats(engine: Engine) -> tuple[int, int, int]:
    s = engine.compile_stats
    return s.graphs_compiled, s.recompiles, s.graph_breaks


def test_inference_mode_and_no_grad_callers_reuse_the_compiled_graphs():
    model = build_random_model(TINY, seed=0)
    engine = Engine(model, compile=True, max_model_len=256)
    plain = _tokens(engine)
    assert _stats(engine) == (3, 0, 0)  # prefill, decode, sampler

    with torch.inference_mode():
        under_inference = _tokens(engine)
    assert _stats(engine) == (3, 0, 0), "inference_mode recompiled"
    with torch.no_grad():
        under_no_grad = _tokens(engine)
    assert _stats(engine) == (3, 0, 0), "no_grad recompiled"
    assert _tokens(engine) == plain
    assert under_inference == plain and under_no_grad == plain
    assert plain == _tokens(Engine(model, compile=False, max_model_len=256))
    assert engine.runner.forward.cache_entries == 2 and engine.runner.sampler.cache_entries == 1

    # The count is not blind to this kind: metadata made under inference mode and fed to
    # the compiled forward directly (not through the engine) fails the dispatch-key guard.
    with torch.inference_mode():
        md = build_metadata([SequenceChunk([1, 2], 0, [0])], engine.kv_cache.block_size,
                            engine.max_blocks_per_seq)
        engine.runner.forward(md, engine.kv_cache.layers)
    assert engine.compile_stats.recompiles >= 1


def test_engine_built_under_inference_mode_has_ordinary_tensors():
    """Its cache and decode buffers are written in place on every step, which inference
    tensors refuse outside inference mode: they must be ordinary tensors."""
    model = build_random_model(TINY, seed=0)
    with torch.inference_mode():
        engine = Engine(model, compile=False, max_model_len=256)
        inside = _tokens(engine)
    tensors = {f"kv_cache.layers[{i}]": t for i, pair in enumerate(engine.kv_cache.layers) for t in pair}
    tensors |= {f"buffers.{k}": v for k, v in vars(engine.runner.buffers).items() if isinstance(v, torch.Tensor)}
    assert len(tensors) > 2 and [name for name, t in tensors.items() if t.is_inference()] == []
    assert _tokens(engine) == inside  # outside inference mode: in-place writes work
    with torch.no_grad():
        assert _tokens(engine) == inside
