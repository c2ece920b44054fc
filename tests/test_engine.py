"""Engine (eager): lengths, per-request params, EOS, block accounting, batch invariance,
seeded sampling, validation, and paged decode == full recompute."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from compiled_attn.engine import Engine
from compiled_attn.kv_cache import KVCache, OutOfBlocksError
from compiled_attn.metadata import SequenceChunk, build_metadata
from compiled_attn.models import DiffLlamaConfig, build_random_model
from compiled_attn.sampling import SamplingParams

SMALL = DiffLlamaConfig(
    vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    bos_token_id=None, eos_token_id=None,
)
# Same architecture family with the extras: 3 layers, layer 2 reads layer 0's cache,
# a sliding window, affine subln, no GQA.
EXTRAS = dataclasses.replace(
    SMALL, num_hidden_layers=3, num_key_value_heads=4, sliding_window=5, subln_affine=True,
    kv_sharing={2: 0},
)

PROMPTS = [[1, 2, 3], [10, 11, 12, 13, 14, 15, 16], [40], [5, 9, 17, 33, 2]]


@pytest.fixture(scope="module")
def model():
    return build_random_model(SMALL, seed=0)


def make_engine(model, **kwargs) -> Engine:
    kwargs.setdefault("block_size", 4)
    return Engine(model, compile=False, **kwargs)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n)


def test_every_prompt_gets_max_new_tokens(model):
    engine = make_engine(model)
    completions, timings = engine.generate(PROMPTS, greedy(6))
    assert len(completions) == len(PROMPTS)
    for prompt, c in zip(PROMPTS, completions):
        assert c.prompt_ids == prompt
        assert len(c.output_ids) == 6
        assert all(isinstance(t, int) and 0 <= t < SMALL.vocab_size for t in c.output_ids)
        assert c.finish_reason == "length"
    assert timings.prefill_tokens == sum(map(len, PROMPTS))
    assert timings.decode_tokens == 5 * len(PROMPTS)  # the prefill samples the first token
    assert timings.prefill_tokens_per_s > 0 and timings.decode_tokens_per_s > 0
    assert engine.compile_stats is None


def test_per_request_params_finish_at_different_times(model):
    engine = make_engine(model)
    lengths = [1, 5, 3, 8]
    params = [SamplingParams(max_new_tokens=n) for n in lengths]
    completions, timings = engine.generate(PROMPTS, params)
    assert [len(c.output_ids) for c in completions] == lengths
    assert all(c.finish_reason == "length" for c in completions)
    assert timings.decode_tokens == sum(n - 1 for n in lengths)
    # Each sequence's tokens are those it gets when it runs to the longest length alone:
    # finishing early must not disturb the others.
    full, _ = make_engine(model).generate(PROMPTS, greedy(8))
    for c, f, n in zip(completions, full, lengths):
        assert c.output_ids == f.output_ids[:n]


def test_params_list_must_match_prompts(model):
    engine = make_engine(model)
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate(PROMPTS, [greedy(2)])


def find_eos_case(model):
    """A prompt pair and a token that prompt 0 emits (first at index i >= 1) and
    prompt 1 never emits within 8 greedy tokens."""
    candidates = [[1, 2, 3], [7, 7], [20, 21, 22, 23], [50, 3], [9], [33, 34, 35], [60, 61]]
    engine = make_engine(model)
    outs = [c.output_ids for c in engine.generate(candidates, greedy(8))[0]]
    for a, out_a in enumerate(outs):
        for i in range(1, 8):
            token = out_a[i]
            if token in out_a[:i]:
                continue
            for b, out_b in enumerate(outs):
                if b != a and token not in out_b:
                    return [candidates[a], candidates[b]], token, out_a[: i + 1], out_b
    pytest.fail("no EOS test case among the candidate prompts")


def test_eos_stops_one_sequence_early_others_continue(model):
    prompts, eos, expect_a, expect_b = find_eos_case(model)
    engine = make_engine(model)
    engine.eos_token_ids = frozenset({eos})
    completions, _ = engine.generate(prompts, greedy(8))
    a, b = completions
    assert a.output_ids == expect_a and a.output_ids[-1] == eos  # EOS included
    assert a.finish_reason == "eos"
    assert b.output_ids == expect_b and b.finish_reason == "length"
    assert engine.kv_cache.allocator.num_free_blocks == engine.kv_cache.allocator.num_blocks


def test_eos_from_config(model):
    prompts, eos, expect_a, _ = find_eos_case(model)
    cfg = dataclasses.replace(SMALL, eos_token_id=[eos, SMALL.vocab_size + 5])
    with_eos = build_random_model(cfg, seed=0)  # same seed: same weights
    engine = make_engine(with_eos)
    assert engine.eos_token_ids == frozenset({eos, SMALL.vocab_size + 5})
    completions, _ = engine.generate(prompts, greedy(8))
    assert completions[0].output_ids == expect_a
    assert completions[0].finish_reason == "eos"


def test_eos_on_the_first_token():
    base = build_random_model(SMALL, seed=0)
    first = make_engine(base).generate([[4, 5]], greedy(3))[0][0].output_ids[0]
    engine = make_engine(base)
    engine.eos_token_ids = frozenset({first})
    (c,), timings = engine.generate([[4, 5]], greedy(3))
    assert c.output_ids == [first] and c.finish_reason == "eos"
    assert timings.decode_tokens == 0


def test_all_blocks_return_after_generate(model):
    engine = make_engine(model, num_blocks=40)
    alloc = engine.kv_cache.allocator
    assert alloc.num_free_blocks == 40
    for _ in range(2):
        engine.generate(PROMPTS, [greedy(n) for n in (2, 9, 1, 4)])
        assert alloc.num_free_blocks == 40
        assert alloc.block_tables == {}


def test_blocks_return_when_forward_raises(model):
    engine = make_engine(model, num_blocks=40)
    calls = []

    def failing(md, kv_caches, all_logits=False):
        calls.append(md.num_seqs)
        if len(calls) == 3:
            raise RuntimeError("boom in step 3")
        return model(md, kv_caches, all_logits)

    engine.runner.forward = failing
    with pytest.raises(RuntimeError, match="boom"):
        engine.generate(PROMPTS, greedy(6))
    assert len(calls) == 3
    assert engine.kv_cache.allocator.num_free_blocks == 40
    assert engine.kv_cache.allocator.block_tables == {}
    # The engine is usable afterwards.
    engine.runner.forward = model
    completions, _ = engine.generate(PROMPTS, greedy(2))
    assert all(len(c.output_ids) == 2 for c in completions)


def test_a_request_that_can_never_fit_the_cache_is_refused(model):
    engine = make_engine(model, num_blocks=2)  # 2 blocks of 4 tokens
    # 9 prompt + 2 new tokens (+1 slot for the on-device advance) need 3 blocks.
    with pytest.raises(OutOfBlocksError, match="needs 3 blocks of 4.*only 2 in all"):
        engine.generate([[1] * 2, [1] * 9], greedy(2))
    assert engine.kv_cache.allocator.num_free_blocks == 2
    assert not engine.has_unfinished()


def test_requests_that_fit_alone_but_not_together_wait_their_turn(model):
    engine = make_engine(model, num_blocks=2)
    # Each needs both blocks (4 + 3 + 1 slots): the second waits for the first to finish.
    completions, timings = engine.generate([[1, 2, 3, 4], [5, 6, 7, 8]], greedy(3))
    assert [len(c.output_ids) for c in completions] == [3, 3]
    assert timings.decode_steps == 4  # two decode steps each, one request at a time
    assert engine.kv_cache.allocator.num_free_blocks == 2
    for prompt, c in zip([[1, 2, 3, 4], [5, 6, 7, 8]], completions):
        (alone,), _ = make_engine(model).generate([prompt], greedy(3))
        assert alone.output_ids == c.output_ids


def test_batched_greedy_equals_each_prompt_alone(model):
    engine = make_engine(model)
    batched, _ = engine.generate(PROMPTS, greedy(8))
    for prompt, c in zip(PROMPTS, batched):
        (alone,), _ = engine.generate([prompt], greedy(8))
        assert alone.output_ids == c.output_ids, prompt
    # Order of the batch does not matter either.
    reversed_out, _ = engine.generate(PROMPTS[::-1], greedy(8))
    assert [c.output_ids for c in reversed_out[::-1]] == [c.output_ids for c in batched]


def test_seeded_sampling_reproducible_and_seed_dependent(model):
    engine = make_engine(model)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=8)
    a = [c.output_ids for c in engine.generate(PROMPTS, params, seed=5)[0]]
    b = [c.output_ids for c in make_engine(model).generate(PROMPTS, params, seed=5)[0]]
    c = [c.output_ids for c in engine.generate(PROMPTS, params, seed=6)[0]]
    assert a == b
    assert a != c
    g = [c.output_ids for c in engine.generate(PROMPTS, greedy(8))[0]]
    assert a != g  # temperature 1 on a near-uniform random model is not greedy


@pytest.mark.parametrize(
    "prompts, params, match",
    [
        ([], greedy(2), "at least one prompt"),
        ([[1, 2], []], greedy(2), r"prompts\[1\] is empty"),
        ([[1, 64]], greedy(2), r"prompts\[0\] has token ids outside \[0, 64\) \(first: 64\)"),
        ([[3], [-1]], greedy(2), r"prompts\[1\] has token ids outside"),
        ([[1] * 60], greedy(5), r"prompts\[0\] has 60 tokens.*max_new_tokens=5.*max_model_len=64"),
    ],
)
def test_validation_errors(model, prompts, params, match):
    engine = make_engine(model, num_blocks=40)
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, params)
    assert engine.kv_cache.allocator.num_free_blocks == 40


def test_type_and_range_errors(model):
    engine = make_engine(model, num_blocks=40)
    with pytest.raises(TypeError, match=r"prompts\[0\] must hold integer token ids"):
        engine.generate([[1.5, 2.7]], greedy(2))
    with pytest.raises(TypeError, match="max_new_tokens must be an int"):
        SamplingParams(max_new_tokens=2.5)
    engine._sync = object()  # as under tensor parallelism
    with pytest.raises(ValueError, match=r"step\(wait=False\) runs without tensor parallelism"):
        engine.step(wait=False)
    engine._sync = None
    with pytest.raises(TypeError, match=r"seed must be an int \(any: taken modulo 2\*\*63\), got float 1.5"):
        engine.generate([[1]], greedy(2), seed=1.5)
    with pytest.raises(TypeError, match=r"params must be a SamplingParams, got dict \{'max_new_tokens': 3\}"):
        engine.add_request([1, 2], {"max_new_tokens": 3})
    with pytest.raises(TypeError, match="max_num_batched_tokens must be None or an int, got str '64'"):
        make_engine(model, max_num_batched_tokens="64")
    with pytest.raises(ValueError, match="seed must lie in"):
        engine.add_request([1, 2], greedy(2), seed=-1)
    with pytest.raises(ValueError, match="max_model_len must be >= 1"):
        make_engine(model, max_model_len=0)
    with pytest.raises(ValueError, match=r"max_model_len \(65\) is greater than the model's max_position_embeddings \(64\)"):
        make_engine(model, max_model_len=65)
    for flag in ("async_decode", "compile", "warmup", "cuda_graphs", "enable_prefix_caching"):
        with pytest.raises(TypeError, match=f"{flag} must be a bool, got str 'no'"):
            Engine(model, block_size=4, **{"compile": False, flag: "no"})
    assert engine.kv_cache.allocator.num_free_blocks == 40 and not engine.has_unfinished()


def test_any_generate_seed_works(model):
    """Seeds derive per-request seeds modulo 2**63: huge seeds work and stay deterministic."""
    engine = make_engine(model)
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    runs = [[c.output_ids for c in engine.generate([[1, 2], [3]], params, seed=10**13)[0]] for _ in range(2)]
    assert runs[0] == runs[1]


def test_prompt_exactly_at_max_model_len_is_accepted(model):
    engine = make_engine(model, max_model_len=12)
    (c,), _ = engine.generate([[1] * 9], greedy(3))
    assert len(c.output_ids) == 3
    with pytest.raises(ValueError, match="max_model_len=12"):
        engine.generate([[1] * 10], greedy(3))


def test_engine_constructor_sizes(model):
    engine = make_engine(model, max_model_len=10, block_size=4)
    assert engine.max_blocks_per_seq == 3
    assert engine.kv_cache.allocator.num_blocks == 8 * 3
    k, v = engine.kv_cache.layers[0]
    assert k.shape == (24, 4, SMALL.num_key_value_heads, SMALL.head_dim) and k.dtype == torch.float32
    assert len(engine.kv_cache.layers) == SMALL.num_hidden_layers
    with pytest.raises(ValueError, match="block_size"):
        make_engine(model, block_size=0)


def record_steps(engine: Engine, model):
    """Wrap the engine's forward to keep each step's metadata and logits."""
    steps = []

    def recording(md, kv_caches, all_logits=False):
        logits = model(md, kv_caches, all_logits)
        # Decode metadata are views of static buffers that the step advances: snapshot them.
        steps.append((torch.utils._pytree.tree_map(torch.clone, md), logits.clone()))
        return logits

    engine.runner.forward = recording
    return steps


def full_recompute(model, sequences, config):
    """Logits of every token, each sequence run as one prefill. Cache-less
    (``kv_caches=None``) unless the model shares KV caches across layers, which needs a
    cache: then a fresh scratch cache is used (see test_cacheless_forward_with_kv_sharing)."""
    chunks, next_block = [], 0
    for s in sequences:  # consecutive blocks, only used when a scratch cache is needed
        blocks = -(-len(s) // 4)
        chunks.append(SequenceChunk(s, 0, list(range(next_block, next_block + blocks))))
        next_block += blocks
    md = build_metadata(chunks, 4, 64)
    assert md.prefill_only
    with torch.inference_mode():
        if not config.kv_sharing:
            logits = model(md, None, all_logits=True)
        else:
            scratch = KVCache.allocate(model.num_cache_layers, next_block, 4,
                                       config.num_key_value_heads, config.head_dim, torch.float32, "cpu")
            logits = model(md, scratch.layers, all_logits=True)
    bounds = md.cu_seqlens_q.tolist()
    return [logits[bounds[i]:bounds[i + 1]] for i in range(len(sequences))]


@pytest.mark.parametrize("config", [SMALL, EXTRAS], ids=["gqa", "window-sharing-affine"])
def test_paged_decode_matches_full_recompute(config):
    model = build_random_model(config, seed=3)
    engine = make_engine(model, block_size=4, num_blocks=40)
    steps = record_steps(engine, model)
    lengths = [9, 4, 12]
    prompts = [[1, 2, 3, 4, 5], [7, 8], [30, 31, 32, 33, 34, 35, 36]]
    completions, _ = engine.generate(prompts, [greedy(n) for n in lengths])
    assert len(steps) == max(lengths)
    sequences = [c.prompt_ids + c.output_ids[:-1] for c in completions]
    reference = full_recompute(model, sequences, config)
    for n, (md, logits) in enumerate(steps):
        active = [i for i, m in enumerate(lengths) if m > n]
        assert logits.shape == (len(active), config.vocab_size)
        if n > 0:
            assert md.prefill_only is False and md.cu_seqlens_q.tolist() == list(range(len(active) + 1))
        for row, i in enumerate(active):
            position = len(prompts[i]) + n - 1
            torch.testing.assert_close(logits[row], reference[i][position], atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"step {n}, sequence {i}: {m}")
            # and the engine's greedy pick is the argmax of those logits
            assert completions[i].output_ids[n] == int(reference[i][position].argmax())


def test_cacheless_forward_with_kv_sharing_is_a_clear_error():
    """A sharing layer reads its target's paged cache; without caches the model says so."""
    model = build_random_model(EXTRAS, seed=3)
    md = build_metadata([SequenceChunk([1, 2, 3, 4, 5, 6], 0, [0, 1])], 4, 4)
    with torch.inference_mode(), pytest.raises(ValueError, match="kv_caches=None.*kv_sharing"):
        model(md, None, all_logits=True)


def test_default_cache_is_capped_and_zero_blocks_refused(model):
    from compiled_attn.engine import DEFAULT_CACHE_TOKENS

    long_context = build_random_model(dataclasses.replace(SMALL, max_position_embeddings=64 * 1024), seed=0)
    engine = make_engine(long_context, warmup=False, block_size=16)  # max_model_len: the model's 64k
    assert engine.kv_cache.allocator.num_blocks == DEFAULT_CACHE_TOKENS // 16
    with pytest.raises(ValueError, match="num_blocks must be >= 1, got 0"):
        make_engine(model, num_blocks=0)


def test_warmup_leaves_no_trace(model):
    """After the warm-up, a request gets the tokens it gets from an engine that never warmed
    up: its default seed (its request id) and the decode buffers start afresh."""
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    outputs = []
    for warmup in (True, False):
        engine = make_engine(model, warmup=warmup)
        request = engine.add_request([1, 2, 3], params)
        while engine.has_unfinished():
            engine.step()
        outputs.append(request.output_ids)
        assert request.request_id == 0 and engine.kv_cache.allocator.num_free_blocks == engine.kv_cache.allocator.num_blocks
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("limits", [dict(max_model_len=2), dict(block_size=1, num_blocks=3), dict(max_num_seqs=1)])
def test_warmup_fits_the_smallest_engines(model, limits):
    """The warm-up batches keep to the engine's limits: any engine that can serve a
    one-token request can be built."""
    engine = make_engine(model, **limits)
    (request,), _ = engine.generate([[5]], SamplingParams(max_new_tokens=1))
    assert len(request.output_ids) == 1
