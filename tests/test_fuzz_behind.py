"""Randomized differential test of admissions launched behind a decode step in flight
(:meth:`Engine._run_chunks_behind`) on the CPU: an async engine and a synchronous one
(``async_decode=False``) are stepped by hand through the same random arrivals, and every
output (tokens and finish reasons, parallel samples included) must be equal, each finished
request returned once by the step that finished it, and every block free at the end.

Cases draw the block size (1 to 8), ``max_model_len``, a cache from just enough for the
largest request (preemption) to plenty, ``max_num_batched_tokens`` (chunked prefill),
``max_num_seqs``, prefix caching, prompts sharing a prefix, greedy and sampled requests
with ``n`` up to 3 and an EOS among the tokens the requests emit. Seeds are fixed, so the
cases are the same on every run.

Half the requests carry explicit seeds, half the default one (the request id: ids are
taken when a request is added, its ``n - 1`` samples' included, so they do not depend on
the schedule; see :func:`test_default_seeds_do_not_follow_the_fork_timing`).
"""

from __future__ import annotations

import dataclasses
import random
import time

from compiled_attn.block_allocator import block_hash
from compiled_attn.engine import Engine, Request
from compiled_attn.mixed_graphs import default_mixed_capture_sizes
from compiled_attn.model_runner import InflightStep
from compiled_attn.models import build_random_model
from compiled_attn.sampling import SamplingParams
from test_engine import SMALL
from test_mixed_graphs import emulate_mixed_graphs

Arrivals = dict[int, list[tuple[list[int], SamplingParams, int | None]]]
_models: dict[int | None, object] = {}


def model_for(eos: int | None):
    """``SMALL`` with ``eos`` as its EOS token; the same weights for every ``eos``."""
    if eos not in _models:
        _models[eos] = build_random_model(dataclasses.replace(SMALL, eos_token_id=eos), seed=0)
    return _models[eos]


def everyone(requests: list[Request]) -> list[Request]:
    return requests + [sample for r in requests for sample in r.samples]


def drive(engine: Engine, arrivals: Arrivals, eos: int | None, wait: bool = True) -> list[Request]:
    """Step ``engine`` (``step(wait)``), adding ``arrivals[i]`` before step ``i``, until all
    finish; returns the requests in arrival order.

    Checks after every step that no output runs past its end or an EOS, that ``step()``
    returns exactly the requests (samples included, also ones forked and finished within
    the step) that it finished, and that the prefix-cache hashes of every running request
    are those of its tokens (no stand-in was hashed); at the end, that every block is free.
    """
    requests: list[Request] = []
    i = 0
    while i <= max(arrivals) or engine.has_unfinished():
        requests += [engine.add_request(prompt, params, seed=seed) for prompt, params, seed in arrivals.get(i, [])]
        done_before = {r.request_id for r in everyone(requests) if r.finish_reason is not None}
        finished = [r.request_id for r in engine.step(wait)]
        for r in everyone(requests):
            assert len(r.output_ids) <= r.params.max_new_tokens
            assert eos is None or eos not in r.output_ids[:-1], f"request {r.request_id} has tokens after an EOS"
            if r.finish_reason == "eos":
                assert r.output_ids[-1] == eos
            elif r.finish_reason == "length":
                assert len(r.output_ids) == r.params.max_new_tokens
        assert len(finished) == len(set(finished)), f"step {i} returned a request twice"
        assert set(finished) == {r.request_id for r in everyone(requests) if r.finish_reason is not None} - done_before
        check_prefix_hashes(engine)
        i += 1
        assert i < 5000, "no progress"
    assert all(r.finish_reason is not None for r in everyone(requests))
    allocator = engine.kv_cache.allocator
    assert allocator.num_free_blocks == allocator.num_blocks and allocator.block_tables == {}
    return requests


def check_prefix_hashes(engine: Engine) -> None:
    """Each running request's hashed leading blocks hash its own token ids."""
    allocator = engine.kv_cache.allocator
    size = allocator.block_size
    for r in engine.scheduler.running:
        parent = None
        for index, digest in enumerate(allocator._hashes.get(r.request_id, [])):
            parent = block_hash(parent, r.token_ids(index * size, (index + 1) * size))
            assert digest == parent, f"request {r.request_id}: block {index} hashed other tokens"


def outputs(requests: list[Request]):
    return [(r.output_ids, r.finish_reason, [(s.output_ids, s.finish_reason) for s in r.samples]) for r in requests]


def random_case(seed: int) -> tuple[Arrivals, dict, float]:
    """Arrivals (one to three steps apart, several in a step at times) and engine settings."""
    rng, seeds = random.Random(seed), random.Random(-seed - 1)  # (request seeds: a stream of their own)
    block_size = rng.choice([1, 2, 3, 4, 4, 8])
    max_model_len = rng.randint(16, 64)
    system = [rng.randrange(1, 64) for _ in range(rng.randint(0, 16))]
    arrivals: Arrivals = {}
    largest, step = 0, 0
    for k in range(rng.randint(3, 8)):
        prefix = system[:rng.randint(0, len(system))] if rng.random() < 0.7 else []
        prompt = (prefix + [rng.randrange(64) for _ in range(rng.randint(1, 6))])[: max_model_len - 2]
        new_tokens = rng.randint(1, min(24, max_model_len - len(prompt)))
        sampled = {} if rng.random() < 0.4 else dict(temperature=rng.choice([0.5, 1.0, 2.0]),
                                                     top_p=rng.choice([1.0, 0.8, 0.3]))
        params = SamplingParams(max_new_tokens=new_tokens, n=rng.choice([1, 1, 2, 3]), **sampled)
        step += rng.choice([0, 1, 1, 2, 3])
        arrivals.setdefault(step, []).append((prompt, params, seeds.choice([None, 7 * seed + k])))
        largest = max(largest, -(-min(len(prompt) + new_tokens + 1, max_model_len) // block_size))
    room = rng.random()
    num_blocks = largest + (rng.randint(0, 2) if room < 0.5 else rng.randint(3, 10) if room < 0.8 else 500)
    settings = dict(block_size=block_size, max_model_len=max_model_len, num_blocks=num_blocks,
                    max_num_batched_tokens=None if rng.random() < 0.5 else rng.randint(block_size, max(block_size, 16)),
                    enable_prefix_caching=rng.random() < 0.6, max_num_seqs=rng.choice([3, 4, 6, 16]))
    if settings["max_num_batched_tokens"] is not None:  # a token for each running request (vLLM's rule)
        settings["max_num_batched_tokens"] = max(settings["max_num_batched_tokens"], settings["max_num_seqs"])
    return arrivals, settings, rng.random()


def pick_eos(arrivals: Arrivals, settings: dict, pick: float) -> int | None:
    """Mostly one of the tokens most requests emit after their first (so EOS ends several
    mid-decode, some while a behind step is launched); sometimes no EOS."""
    if pick >= 0.85:
        return None
    counts: dict[int, int] = {}
    for r in everyone(drive(Engine(model_for(None), compile=False, async_decode=False, **settings), arrivals, None)):
        for token in set(r.output_ids[1:]):
            counts[token] = counts.get(token, 0) + 1
    top = sorted(counts, key=lambda t: (-counts[t], t))[:3]
    return top[int(pick * 10) % len(top)] if top else None


def test_random_arrivals_give_the_outputs_of_a_synchronous_engine():
    """48 random cases: outputs equal a synchronous engine's and no behind step preempts (a
    preempted row would be queued with its stand-in token); together they launch behind
    steps, preempt, and end rows by an EOS read only after a behind launch. Odd cases run
    their mixed steps through padded mixed buffers (emulated graphs), where a behind step's
    decode rows get their in-flight tokens by :meth:`MixedBuffers.feed`."""
    behind = preemptions = eos_finishes = fed = 0
    for seed in range(48):
        arrivals, settings, pick = random_case(seed)
        eos = pick_eos(arrivals, settings, pick)
        want = drive(Engine(model_for(eos), compile=False, async_decode=False, **settings), arrivals, eos)
        engine = Engine(model_for(eos), compile=False, **settings)
        if seed % 2:
            emulate_mixed_graphs(engine, default_mixed_capture_sizes(settings["max_num_seqs"],
                                                                     settings["max_num_batched_tokens"]))
            feed = engine.runner.mixed_buffers.feed

            def counted_feed(tokens, count, _feed=feed):
                nonlocal fed
                fed += count
                _feed(tokens, count)

            engine.runner.mixed_buffers.feed = counted_feed
        run_behind = engine._run_chunks_behind
        finished_behind: list[Request] = []

        def counted() -> list[Request]:
            preempted = engine.scheduler.num_preemptions
            finished = run_behind()
            assert engine.scheduler.num_preemptions == preempted, f"case {seed}: a behind step preempted"
            finished_behind.extend(r for r in finished if r.finish_reason == "eos")
            return finished

        engine._run_chunks_behind = counted
        got = drive(engine, arrivals, eos)
        assert outputs(got) == outputs(want), f"case {seed}: {settings}, eos {eos}"
        behind += engine.timings.behind_steps
        preemptions += engine.scheduler.num_preemptions
        eos_finishes += len(finished_behind)
    assert behind >= 30 and preemptions > 0 and eos_finishes > 0 and fed >= 10, (behind, preemptions, eos_finishes, fed)


def test_polling_steps_give_the_outputs_of_a_synchronous_engine(monkeypatch):
    """``step(wait=False)``, a serving loop that polls, over 16 of the random cases. The CPU
    has no device to run ahead of the host, so one is acted: each decode step reports its
    tokens not ready (though started) for its first 3 polls, with a device time far above
    ``LAUNCH_LEAD_SECONDS``; such polls return at once (``idle_polls``) unless a waiting
    request can be launched behind the step. Outputs equal a synchronous engine's."""
    def ready(self) -> bool:
        self.polls = getattr(self, "polls", 0) + 1
        return self.polls > 3

    monkeypatch.setattr(InflightStep, "ready", ready)
    monkeypatch.setattr(InflightStep, "started", lambda self: time.perf_counter())
    idle = behind = 0
    for seed in range(16):
        arrivals, settings, pick = random_case(seed)
        eos = pick_eos(arrivals, settings, pick)
        want = drive(Engine(model_for(eos), compile=False, async_decode=False, **settings), arrivals, eos)
        engine = Engine(model_for(eos), compile=False, **settings)
        engine._decode_device_seconds = 3600.0
        got = drive(engine, arrivals, eos, wait=False)
        assert outputs(got) == outputs(want), f"case {seed}: {settings}, eos {eos}"
        idle += engine.timings.idle_polls
        behind += engine.timings.behind_steps
    assert idle > 100 and behind > 5, (idle, behind)


def test_default_seeds_do_not_follow_the_fork_timing():
    """A behind step admits the ``n = 2`` request a step later than the synchronous engine
    (the row that the in-flight EOS ends still holds its slot), so it forks a step later;
    the request added next still gets the same id and default seed (5: the ``n = 2``
    request took ids 3 and 4 when it was added), so the same tokens."""
    model = model_for(45)  # request 0 emits 45 as its third token
    greedy = [SamplingParams(max_new_tokens=n) for n in (12, 12, 3)]
    arrivals: Arrivals = {0: [([1, 2, 3], greedy[0], None), ([7, 8], greedy[1], None)],
                          3: [([5, 6], greedy[2], None),
                              ([9, 10], SamplingParams(max_new_tokens=3, temperature=1.0, n=2), None)],
                          4: [([11, 12], SamplingParams(max_new_tokens=4, temperature=1.0), None)]}
    settings = dict(block_size=4, max_num_seqs=4)
    want = drive(Engine(model, compile=False, async_decode=False, **settings), arrivals, 45)
    engine = Engine(model, compile=False, **settings)
    got = drive(engine, arrivals, 45)
    assert engine.timings.behind_steps == 1
    assert outputs(got) == outputs(want)
