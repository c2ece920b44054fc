"""Scheduling features on the CPU: prefix caching, chunked prefill, preemption.

Each feature must leave the tokens unchanged: the reference is an engine with room to spare,
no prefix cache and no token budget, on the same requests (greedy, a random model whose LM
head is scaled so that picks are not near-ties; fp32). Block and token counts show that the
feature actually ran.
"""

from __future__ import annotations

import random

import pytest
import torch

from compiled_attn.block_allocator import BlockAllocator, block_hash
from compiled_attn.engine import Engine
from compiled_attn.models import DiffLlamaConfig, build_random_model
from compiled_attn.sampling import SamplingParams, sample_seed
from compiled_attn.scheduler import Request, Scheduler

CONFIG = DiffLlamaConfig(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    bos_token_id=None, eos_token_id=None, lambda_std_dev=0.3,
)
SYSTEM = list(range(10, 50))  # a shared 40-token system prompt


@pytest.fixture(scope="module")
def model():
    model = build_random_model(CONFIG, seed=11)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model


def engine(model, **kwargs) -> Engine:
    kwargs.setdefault("enable_prefix_caching", False)
    return Engine(model, compile=False, block_size=4, max_model_len=200, **kwargs)


def workload(seed: int, n: int = 10, shared: bool = True):
    rng = random.Random(seed)
    prompts = [(SYSTEM if shared and i % 2 == 0 else []) + [rng.randrange(96) for _ in range(rng.randint(1, 30))]
               for i in range(n)]
    params = [SamplingParams(max_new_tokens=rng.randint(1, 20)) for _ in range(n)]
    return prompts, params


def drive(engine: Engine, prompts, params, arrive_every: int = 2):
    """Add one request every ``arrive_every`` steps (mixed arrivals) until all finish."""
    requests, pending, step = [], list(zip(prompts, params)), 0
    while pending or engine.has_unfinished():
        if pending and step % arrive_every == 0:
            requests.append(engine.add_request(*pending.pop(0)))
        engine.step()
        step += 1
    return [r.output_ids for r in requests], requests


@pytest.fixture(scope="module")
def reference(model):
    prompts, params = workload(1)
    return drive(engine(model, num_blocks=1000), prompts, params)[0]


def test_prefix_caching_gives_the_same_tokens_and_hits(model, reference):
    prompts, params = workload(1)
    e = engine(model, num_blocks=1000, enable_prefix_caching=True)
    got, requests = drive(e, prompts, params)
    assert got == reference
    hits = [r.num_cached for r in requests]
    assert hits[0] == 0 and all(h == 40 for h in hits[2::2])  # the 10 blocks of the system prompt
    assert e.timings.prefill_tokens == sum(map(len, prompts)) - sum(hits)


@pytest.mark.parametrize("budget", [16, 64, 256])
def test_chunked_prefill_gives_the_same_tokens(model, reference, budget):
    prompts, params = workload(1)
    e = engine(model, num_blocks=1000, max_num_batched_tokens=budget, max_num_seqs=16)  # (budget >= max_num_seqs)
    steps = []
    run = e.runner.launch_chunks
    e.runner.launch_chunks = lambda chunks, draws=None, feed=None: (
        steps.append([(c.num_tokens, c.completes) for c in chunks]), run(chunks, draws, feed))[1]
    got, _ = drive(e, prompts, params)
    assert got == reference
    assert max(sum(n for n, _ in step) for step in steps) <= budget
    partial = sum(not completes for step in steps for _, completes in step)  # chunks that stop mid-prompt
    assert (partial > 0) == (budget < 70)  # the longest prompt has 70 tokens


def test_preemption_under_a_tiny_cache_gives_the_same_tokens(model, reference):
    prompts, params = workload(1)
    for caching in (False, True):
        e = engine(model, num_blocks=24, enable_prefix_caching=caching)  # 96 tokens for ~10 requests
        got, requests = drive(e, prompts, params, arrive_every=1)
        assert got == reference
        assert e.scheduler.num_preemptions > 0 and sum(r.num_preemptions for r in requests) > 0
        allocator = e.kv_cache.allocator
        assert allocator.num_free_blocks == allocator.num_blocks and allocator.block_tables == {}


def test_everything_at_once(model, reference):
    prompts, params = workload(1)
    e = engine(model, num_blocks=30, enable_prefix_caching=True, max_num_batched_tokens=16, max_num_seqs=4)
    assert drive(e, prompts, params, arrive_every=1)[0] == reference


def test_generate_with_a_shared_system_prompt_reuses_its_blocks(model):
    prompts, params = workload(2)
    cached = engine(model, num_blocks=1000, enable_prefix_caching=True)
    first, _ = cached.generate(prompts[:1], params[:1])
    later, timings = cached.generate(prompts[2:3], params[2:3])
    assert later[0].num_cached == 40 and timings.prefill_tokens == len(prompts[2]) - 40
    fresh, _ = engine(model, num_blocks=1000).generate(prompts[2:3], params[2:3])
    assert later[0].output_ids == fresh[0].output_ids


def test_bad_scheduler_settings_are_clear_errors(model):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine(model, max_num_batched_tokens=3)  # below one block of 4
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine(model, max_num_batched_tokens=0)
    with pytest.raises(TypeError, match="max_num_seqs"):
        engine(model, max_num_seqs=1.5)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens must be >= block_size \(4\) and >= max_num_seqs "
                                         r"\(17, a token for each running request\), got 16"):
        engine(model, max_num_batched_tokens=16, max_num_seqs=17)  # vLLM's rule: a token per running request
    assert engine(model, max_num_batched_tokens=16, max_num_seqs=16).scheduler.max_num_batched_tokens == 16


def test_a_budget_below_max_num_seqs_is_refused_at_construction():
    alloc = BlockAllocator(num_blocks=10, block_size=4)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens must be >= block_size \(4\) and >= max_num_seqs "
                                         r"\(5, a token for each running request\), got 4"):
        Scheduler(alloc, max_num_seqs=5, max_num_batched_tokens=4, max_model_len=64)
    assert Scheduler(alloc, max_num_seqs=4, max_num_batched_tokens=None, max_model_len=64).max_num_batched_tokens is None


# --- the allocator's prefix cache ------------------------------------------------------------


def test_prefix_blocks_are_shared_refcounted_and_evicted_lru():
    alloc = BlockAllocator(num_blocks=6, block_size=2, prefix_caching=True)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    assert alloc.allocate_prefix(0, tokens) == 0
    alloc.allocate(0, 7)
    alloc.cache_full_blocks(0, tokens, 7)  # blocks [1,2] [3,4] [5,6] registered
    assert alloc.num_cached_blocks == 3
    assert alloc.allocate_prefix(1, tokens) == 6  # never the block of the last token ... here [7]
    assert alloc.block_tables[1] == alloc.block_tables[0][:3]
    assert alloc.allocate_prefix(2, [1, 2, 3, 4, 9, 9]) == 4  # two shared blocks, then a miss
    alloc.free(0)
    alloc.free(1)
    assert alloc.num_free_blocks == 6 - 2  # sequence 2 still holds two cached blocks
    alloc.free(2)
    assert alloc.num_free_blocks == 6 and alloc.num_cached_blocks == 3
    alloc.allocate(3, 12)  # takes every block: the 3 free ones first, then evicts the cached ones
    assert alloc.num_cached_blocks == 0 and alloc.num_free_blocks == 0
    alloc.free(3)
    assert alloc.allocate_prefix(4, tokens) == 0


def test_whole_prompt_hit_leaves_the_last_token_to_compute():
    alloc = BlockAllocator(num_blocks=8, block_size=2, prefix_caching=True)
    tokens = [1, 2, 3, 4]
    alloc.allocate(0, 4)
    alloc.cache_full_blocks(0, tokens, 4)
    assert alloc.allocate_prefix(1, tokens) == 2  # block [3, 4] holds the last token: recomputed
    assert block_hash(None, [1, 2]) != block_hash(block_hash(None, [9, 9]), [1, 2])  # hashes chain


def test_generate_rejects_params_that_are_not_sampling_params(model):
    e = engine(model, num_blocks=100)
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        e.generate([[1, 2]], None)
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        e.generate([[1, 2]], [{"max_new_tokens": 2}])
    assert not e.has_unfinished()


# --- parallel sampling ------------------------------------------------------------------------


def test_parallel_samples_share_the_prompt_blocks_and_equal_single_requests(model):
    """``n=4`` sampled completions: the prompt is computed once and its blocks shared (block
    counts), the partial last block copied on first write; each sample equals a single
    request drawing with that sample's seed."""
    prompt = list(range(1, 31))  # 30 tokens: 7 full blocks of 4 and a partial one
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=4)
    e = engine(model, num_blocks=200)
    parent = e.add_request(prompt, params, seed=5)
    e.step()  # the prompt, computed once; the 4 samples forked
    allocator = e.kv_cache.allocator
    tables = [allocator.block_tables[r.request_id] for r in [parent, *parent.samples]]
    assert len(parent.samples) == 3 and all(t == tables[0] for t in tables)
    assert allocator.num_blocks - allocator.num_free_blocks == 8  # 8 blocks for 4 sequences of 31 tokens
    e.step()  # each sample writes token 31 into the shared 8th block: 3 copies, the last writer keeps it
    tables = [allocator.block_tables[r.request_id] for r in [parent, *parent.samples]]
    assert all(t[:7] == tables[0][:7] for t in tables) and len({t[7] for t in tables}) == 4
    while e.has_unfinished():
        e.step()
    got = [r.output_ids for r in [parent, *parent.samples]]
    assert len({tuple(g) for g in got}) > 1  # sampled: the completions differ
    seeds = [5] + [sample_seed(5, k) for k in range(1, 4)]
    assert [r.seed for r in parent.samples] == seeds[1:]
    single = SamplingParams(max_new_tokens=12, temperature=1.0)
    for seed, output in zip(seeds, got):
        alone = engine(model, num_blocks=200)
        request = alone.add_request(prompt, single, seed=seed)
        while alone.has_unfinished():
            alone.step()
        assert request.output_ids == output
    assert allocator.num_free_blocks == allocator.num_blocks


def test_bad_n_is_a_clear_error(model):
    with pytest.raises(ValueError, match="n must be >= 1"):
        SamplingParams(n=0)
    with pytest.raises(TypeError, match="n must be an int"):
        SamplingParams(n=2.0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine(model, num_blocks=100, max_num_seqs=2).add_request([1, 2], SamplingParams(n=3))


def test_enable_prefix_caching_must_be_a_bool(model):
    with pytest.raises(TypeError, match="enable_prefix_caching must be a bool"):
        engine(model, enable_prefix_caching="no")


def test_prefills_through_the_paged_kernel_give_the_same_tokens(model, reference):
    """The warm-up's ``paged_prefill`` (mixed steps' kernel at prefill sizes) computes the
    same thing as the varlen path."""
    prompts, params = workload(1)
    e = engine(model, num_blocks=1000)
    e.runner.paged_prefill = True
    assert drive(e, prompts, params)[0] == reference


def test_can_admit_counts_slots_budget_and_reserved_blocks():
    """A waiting request is admissible with a free slot and the blocks of its first chunk
    (within the budget) among the free ones minus those reserved."""
    alloc = BlockAllocator(num_blocks=10, block_size=4)
    scheduler = Scheduler(alloc, max_num_seqs=3, max_num_batched_tokens=4, max_model_len=64)
    running = [Request(i, [1, 2], SamplingParams(), 0) for i in range(2)]
    for request in running:
        scheduler.add(request)
    scheduler.schedule()  # both admitted: 2 of 10 blocks taken (2 tokens + the next each)
    assert scheduler.running == running and alloc.num_free_blocks == 8
    waiting = Request(5, list(range(9)), SamplingParams(), 0)  # a first chunk of 4 tokens: 1 block
    scheduler.add(waiting)
    assert scheduler.can_admit() and scheduler.can_admit(reserved_blocks=7)
    assert not scheduler.can_admit(reserved_blocks=8)
    scheduler.max_num_batched_tokens = None  # the whole prompt and the next token: 3 blocks
    assert scheduler.can_admit(reserved_blocks=5) and not scheduler.can_admit(reserved_blocks=6)
    scheduler.max_num_seqs = 2  # no slot
    assert not scheduler.can_admit()


def test_parallel_samples_draw_seeds_no_other_prompt_of_the_call_has(model):
    """``generate`` seeds prompt ``i`` with ``i`` (its default seed 0); the samples of
    prompt 0 must not take prompts 1, 2, ...'s seeds (equal prompts would then give equal
    "independent" completions)."""
    prompt = [3, 1, 4, 1, 5]
    params = SamplingParams(max_new_tokens=8, temperature=2.0, n=3)
    completions, _ = engine(model, num_blocks=200).generate([prompt] * 3, params)
    everyone = [r for c in completions for r in (c, *c.samples)]
    assert len({r.seed for r in everyone}) == len(everyone) == 9
    assert len({tuple(r.output_ids) for r in everyone}) > 3  # not three copies of three completions


def test_sampling_params_name_bad_types():
    for bad in (dict(seed=1.5), dict(seed=True), dict(temperature="0.5"), dict(top_p=None)):
        with pytest.raises(TypeError, match=next(iter(bad))):
            SamplingParams(**bad)
