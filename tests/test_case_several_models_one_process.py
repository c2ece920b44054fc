"""Case: several differently shaped models compiled in one process.

``torch.compile(model)`` caches on ``type(model).forward``'s code object, which every
instance shares, and Dynamo's recompile limit (8 per code object) then covers all of them:
under ``fullgraph=True`` the fifth model's graphs raised ``FailOnRecompileLimitHit``, while
each engine's ``compile_stats`` said 0 recompiles. Each :class:`CompiledFunction` now has
an entry point (code object) and so a cache and a budget of its own, and its stats count
its own cache entries. No test here calls ``torch._dynamo.reset()``: a user never does.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from compiled_attn.compile import CompiledFunction
from compiled_attn.engine import Engine
from compiled_attn.metadata import SequenceChunk, build_metadata
from compiled_attn.models import build_random_model
from compiled_attn.models.config import random_model_config
from compiled_attn.sampling import SamplingParams

pytestmark = pytest.mark.slow

BASE = dataclasses.replace(random_model_config(), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           max_position_embeddings=64)
CONFIGS = [
    BASE,
    dataclasses.replace(BASE, hidden_size=48),
    dataclasses.replace(BASE, num_hidden_layers=2),
    dataclasses.replace(BASE, num_attention_heads=8, num_key_value_heads=4),
    dataclasses.replace(BASE, num_key_value_heads=4),
    dataclasses.replace(BASE, head_dim=16, vocab_size=128),
]
PROMPTS = [[1, 2, 3], [4, 5]]
PARAMS = [SamplingParams(max_new_tokens=3), SamplingParams(max_new_tokens=3, temperature=0.8)]


def _tokens(engine: Engine) -> list[list[int]]:
    completions, _ = engine.generate(PROMPTS, PARAMS)
    return [c.output_ids for c in completions]


@pytest.fixture(scope="module")
def runs():
    """Each model in a compiled engine, run once: (engine, its stats then, tokens, eager tokens).

    The forwards compile with the ``aot_eager`` backend (Dynamo and AOTAutograd, no
    Inductor code generation): the case is about Dynamo's caches, and six Inductor
    compilations would take minutes on a small CPU. The sampler compiles as usual.
    """
    assert len(CONFIGS) * 2 > torch._dynamo.config.recompile_limit  # 2 forward graphs each
    out = []
    for i, config in enumerate(CONFIGS):
        model = build_random_model(config, seed=i)
        engine = Engine(model, compile=True, compile_kwargs={"backend": "aot_eager"}, max_num_seqs=4)
        tokens = _tokens(engine)
        out.append((engine, dataclasses.replace(engine.compile_stats), tokens,
                    _tokens(Engine(model, compile=False, max_num_seqs=4))))
    return out


def test_every_model_compiles_with_its_own_budget_and_matches_eager(runs):
    for engine, stats, tokens, eager in runs:
        assert (stats.graphs_compiled, stats.recompiles, stats.graph_breaks) == (3, 0, 0)
        assert engine.runner.forward.cache_entries == 2 and engine.runner.sampler.cache_entries == 1
        assert tokens == eager
    codes = {f.entry.__code__ for engine, *_ in runs for f in (engine.runner.forward, engine.runner.sampler)}
    assert len(codes) == 2 * len(runs)


def test_a_real_recompile_is_counted_on_its_engine_only(runs):
    engine = runs[0][0]
    md = build_metadata([SequenceChunk([1, 2], 0, [0])], engine.kv_cache.block_size, engine.max_blocks_per_seq)
    with torch.no_grad():
        engine.runner.forward(md, engine.kv_cache.layers)  # a variant compiled already: no compile
        assert engine.compile_stats.recompiles == 0
        engine.runner.forward(dataclasses.replace(md, input_ids=md.input_ids.int()), engine.kv_cache.layers)
    assert engine.compile_stats.recompiles == 1 and engine.compile_stats.graphs_compiled == 4
    assert engine.runner.forward.cache_entries == 3
    assert all(e.compile_stats.recompiles == 0 for e, *_ in runs[1:])
    assert _tokens(engine) == runs[0][3]  # and it still runs as before


class _Affine(torch.nn.Module):
    """A module class private to this test, so its ``forward`` code object is too."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def test_instances_of_one_class_each_get_their_own_cache():
    """Many instances past the recompile limit (a fast backend: only Dynamo's cache matters),
    and plain ``torch.compile`` on the same pattern for contrast."""
    sizes = range(2, 2 * torch._dynamo.config.recompile_limit + 4)
    for n in sizes:
        f = CompiledFunction(_Affine(n), backend="eager")
        x = torch.ones(3, n)
        torch.testing.assert_close(f(x), x @ f.fn.weight)
        torch.testing.assert_close(f(torch.ones(5, n)), torch.ones(5, n) @ f.fn.weight)
        assert (f.stats.graphs_compiled, f.stats.recompiles, f.cache_entries) == (1, 0, 1)
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        for n in sizes:
            torch.compile(_Affine(n), fullgraph=True, backend="eager")(torch.ones(3, n))
