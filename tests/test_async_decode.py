"""Async decode (tokens read one step late) on the CPU: every output equals a synchronous
engine's (``async_decode=False``), and the overlap really happens.

The overlap is observed from outside the engine: the model's forward logs each decode
launch and :meth:`InflightStep.read` logs each read of a step's tokens, so a decode step
launched while an earlier one's tokens are unread shows in the log.
"""

from __future__ import annotations

import dataclasses

import pytest

from compiled_attn.engine import Engine, InflightStep, Request
from compiled_attn.models import build_random_model
from compiled_attn.sampling import SamplingParams
from test_engine import PROMPTS, SMALL, greedy, make_engine

MORE_PROMPTS = [[20, 21, 22, 23], [9], [33, 34, 35], [60, 61], *PROMPTS]
SAMPLED = dict(temperature=1.0, top_p=0.9)


@pytest.fixture(scope="module")
def model():
    return build_random_model(SMALL, seed=0)


def generate_logged(engine: Engine, monkeypatch, *args, **kwargs):
    """``engine.generate(*args, **kwargs)`` and a log of ``"launch"`` for every decode
    forward and ``"read"`` for every read of a decode step's tokens, in order."""
    log = []
    forward, read = engine.runner.forward, InflightStep.read

    def logged_forward(md, kv_caches, all_logits=False):
        if not md.prefill_only:
            log.append("launch")
        return forward(md, kv_caches, all_logits)

    def logged_read(self):
        log.append("read")
        return read(self)

    with monkeypatch.context() as patch:
        patch.setattr(engine.runner, "forward", logged_forward)
        patch.setattr(InflightStep, "read", logged_read)
        completions, timings = engine.generate(*args, **kwargs)
    return completions, timings, log


def overlapped(log: list[str]) -> int:
    """Decode steps launched before the tokens of the step before them were read."""
    unread = count = 0
    for entry in log:
        if entry == "launch":
            count += unread > 0
            unread += 1
            assert unread <= 2, "more than one step in flight besides the new one"
        else:
            unread -= 1
    assert unread == 0, "a decode step was never read"
    return count


def check_outputs(requests: list[Request], eos: frozenset[int] = frozenset()) -> None:
    """Nothing past max_new_tokens, nothing after an EOS, finish reasons as delivered."""
    for r in requests:
        assert len(r.output_ids) <= r.params.max_new_tokens
        assert not eos & set(r.output_ids[:-1]), f"request {r.request_id} has tokens after an EOS"
        if r.finish_reason == "eos":
            assert r.output_ids[-1] in eos
        elif r.finish_reason == "length":
            assert len(r.output_ids) == r.params.max_new_tokens


def outputs(requests: list[Request]) -> list[tuple[list[int], str | None]]:
    return [(r.output_ids, r.finish_reason) for r in requests]


def both(model, prompts, params, **kwargs):
    """``generate`` with a synchronous and an async engine: (sync, async) (completions, timings)."""
    sync = make_engine(model, async_decode=False, **kwargs).generate(prompts, params, seed=3)
    overlapping = make_engine(model, **kwargs).generate(prompts, params, seed=3)
    return sync, overlapping


@pytest.mark.parametrize("sampling", [{}, SAMPLED, "mixed"], ids=["greedy", "sampled", "mixed"])
def test_same_tokens_as_sync_and_steps_overlap(model, monkeypatch, sampling):
    n = 8
    kinds = [{}, SAMPLED] * len(PROMPTS) if sampling == "mixed" else [sampling] * len(PROMPTS)
    params = [SamplingParams(max_new_tokens=n, **kind) for kind in kinds[:len(PROMPTS)]]
    want, sync_timings, sync_log = generate_logged(make_engine(model, async_decode=False), monkeypatch,
                                                   PROMPTS, params, seed=3)
    got, timings, async_log = generate_logged(make_engine(model), monkeypatch, PROMPTS, params, seed=3)
    assert outputs(got) == outputs(want)
    check_outputs(got)
    assert overlapped(sync_log) == sync_timings.overlapped_steps == 0
    # Decode steps 2 .. n-1 are launched before the step before them is read; step 1
    # follows the prefill, and the last step's tokens are read by a step of their own.
    assert overlapped(async_log) == timings.overlapped_steps == n - 2
    assert (timings.decode_steps, timings.decode_tokens) == (sync_timings.decode_steps, sync_timings.decode_tokens)
    assert timings.decode_tokens == (n - 1) * len(PROMPTS) and timings.decode_seconds > 0


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_different_lengths_finish_at_different_times(model, sampling):
    lengths = [1, 5, 3, 8, 2, 12, 4, 9]
    params = [SamplingParams(max_new_tokens=n, **sampling) for n in lengths]
    (want, sync_timings), (got, timings) = both(model, MORE_PROMPTS, params)
    assert outputs(got) == outputs(want)
    assert [len(c.output_ids) for c in got] == lengths
    check_outputs(got)
    # Lengths are known ahead: no step is launched that a synchronous engine would not run.
    assert timings.decode_steps == sync_timings.decode_steps
    assert timings.decode_tokens == sync_timings.decode_tokens == sum(n - 1 for n in lengths)
    assert timings.overlapped_steps > 0


def pick_eos(model, prompts, params) -> int:
    """A token that the synchronous engine emits mid-decode (first at an index in
    ``1 .. max_new_tokens - 2``) in as many requests as possible, at least two."""
    completions, _ = make_engine(model, async_decode=False).generate(prompts, params, seed=3)
    hits: dict[int, int] = {}
    for c in completions:
        for i, token in enumerate(c.output_ids[: c.params.max_new_tokens - 1]):
            if i >= 1 and token not in c.output_ids[:i]:
                hits[token] = hits.get(token, 0) + 1
    token = max(hits, key=hits.get)
    assert hits[token] >= 2, "no token ends two requests mid-decode"
    return token


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_eos_mid_decode_drops_the_token_sampled_past_it(model, sampling):
    params = [SamplingParams(max_new_tokens=12, **sampling)] * len(MORE_PROMPTS)
    eos = pick_eos(model, MORE_PROMPTS, params)
    with_eos = build_random_model(dataclasses.replace(SMALL, eos_token_id=eos), seed=0)  # same weights
    sync_engine, async_engine = make_engine(with_eos, async_decode=False), make_engine(with_eos)
    rows = {"sync": 0, "async": 0}
    for name, engine in (("sync", sync_engine), ("async", async_engine)):
        def counting(md, kv_caches, all_logits=False, name=name):
            rows[name] += 0 if md.prefill_only else md.num_seqs
            return with_eos(md, kv_caches, all_logits)
        engine.runner.forward = counting
    want, sync_timings = sync_engine.generate(MORE_PROMPTS, params, seed=3)
    got, timings = async_engine.generate(MORE_PROMPTS, params, seed=3)
    assert sum(c.finish_reason == "eos" and 1 < len(c.output_ids) < 12 for c in want) >= 2
    assert outputs(got) == outputs(want)
    check_outputs(got, frozenset({eos}))
    assert timings.decode_tokens == sync_timings.decode_tokens
    # Tokens were sampled past EOS (launched before the EOS was read) and dropped.
    assert rows["async"] > rows["sync"] == sync_timings.decode_tokens
    assert rows["async"] - timings.decode_tokens <= sum(c.finish_reason == "eos" for c in got)
    assert timings.overlapped_steps > 0
    allocator = async_engine.kv_cache.allocator
    assert allocator.num_free_blocks == allocator.num_blocks and allocator.block_tables == {}


def drive(engine: Engine, arrivals: dict[int, list[tuple[list[int], SamplingParams]]],
          eos: frozenset[int] = frozenset()) -> tuple[list[Request], list[int]]:
    """Step ``engine`` by hand, adding ``arrivals[i]`` before step ``i``, until all finish.

    Checks after every step that outputs never run past their end and that ``step()``
    returns each request (parallel samples included) once, in the step that finished it.
    Returns the requests in arrival order and, per step, the number of requests waiting
    during an overlapped step.
    """
    requests, returned, waiting_while_overlapped = [], [], []

    def everyone() -> list[Request]:
        return requests + [sample for r in requests for sample in r.samples]

    i = 0
    while i <= max(arrivals) or engine.has_unfinished():
        requests += [engine.add_request(prompt, params) for prompt, params in arrivals.get(i, [])]
        done_before = {r.request_id for r in everyone() if r.finish_reason is not None}
        before = engine.timings.overlapped_steps
        waiting = len(engine.scheduler.waiting)
        finished = engine.step()
        if engine.timings.overlapped_steps > before:
            waiting_while_overlapped.append(waiting)
        check_outputs(everyone(), eos)
        # (samples forked in this step count too, also those that finish in it)
        assert sorted(r.request_id for r in finished) == sorted(
            r.request_id for r in everyone() if r.finish_reason is not None and r.request_id not in done_before)
        returned += finished
        i += 1
    assert sorted(r.request_id for r in returned) == sorted(r.request_id for r in everyone())
    return requests, waiting_while_overlapped


def test_requests_arriving_while_others_decode(model):
    arrivals = {
        0: [([1, 2, 3], greedy(10))],
        3: [([7, 8], SamplingParams(max_new_tokens=6, **SAMPLED))],
        4: [([40], greedy(2)), ([5, 9, 17, 33, 2], greedy(9))],
        9: [([60, 61], SamplingParams(max_new_tokens=5, **SAMPLED))],
    }
    want, _ = drive(make_engine(model, async_decode=False), arrivals)
    engine = make_engine(model)
    got, overlapped_waiting = drive(engine, arrivals)
    assert outputs(got) == outputs(want)
    assert engine.timings.overlapped_steps == len(overlapped_waiting) > 0


def test_a_request_that_cannot_be_admitted_does_not_stop_the_overlap(model):
    # 6 blocks of 4: the first request holds 4 (13 prompt tokens + the next) and grows to 6
    # (13 + 8 + 1 tokens); the second needs 3 for its prompt (9 + the next), never free
    # while the first runs: it waits, and the first keeps overlapping.
    arrivals = {0: [(list(range(1, 14)), greedy(8))], 2: [(list(range(20, 29)), greedy(6))]}
    want, _ = drive(make_engine(model, num_blocks=6, async_decode=False), arrivals)
    engine = make_engine(model, num_blocks=6)
    got, overlapped_waiting = drive(engine, arrivals)
    assert outputs(got) == outputs(want)
    assert overlapped_waiting.count(1) >= 5


def test_has_unfinished_counts_a_step_in_flight(model):
    prompt = [9]
    (alone,), _ = make_engine(model, async_decode=False).generate([prompt], greedy(12))
    eos = alone.output_ids[1]  # the first decode step emits it
    assert eos not in alone.output_ids[:1]
    engine = make_engine(model)
    engine.eos_token_ids = frozenset({eos})
    request = engine.add_request(prompt, greedy(12))
    assert engine.step() == []  # prefill
    assert engine.step() == []  # decode step 1 launched, in flight
    assert engine.step() == [request]  # step 2 launched, then step 1's EOS read
    assert request.output_ids == alone.output_ids[:2] and request.finish_reason == "eos"
    assert engine.scheduler.running == [] and engine.has_unfinished()  # step 2 is still in flight
    assert engine.step() == []  # its token, sampled past the EOS, is dropped
    assert not engine.has_unfinished()
    assert request.output_ids == alone.output_ids[:2]
    assert engine.timings.decode_tokens == 1 and engine.timings.decode_steps == 2
    assert engine.kv_cache.allocator.num_free_blocks == engine.kv_cache.allocator.num_blocks


def arrivals_while_decoding(system: list[int], new_tokens: int) -> dict[int, list[tuple[list[int], SamplingParams]]]:
    """A request every second step, each while others decode: greedy and sampled, one with
    ``n = 2``, prompts that share ``system``, ``new_tokens`` to ``new_tokens + 3`` new tokens."""
    kinds = [{}, SAMPLED, {}, dict(SAMPLED, n=2), {}, SAMPLED, {}]
    return {2 * i: [(system + [10 + i, 20 + 3 * i], SamplingParams(max_new_tokens=new_tokens + i % 4, **kind))]
            for i, kind in enumerate(kinds)}


@pytest.mark.parametrize("caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@pytest.mark.parametrize("num_blocks", [200, 12], ids=["room", "tiny-cache"])
def test_admissions_launched_behind_a_decode_step_give_the_sync_tokens(model, caching, num_blocks):
    """A request that arrives while others decode is prefilled in a mixed step launched
    behind the decode step in flight, the decode rows fed their in-flight tokens on the
    device: outputs equal a synchronous engine's, also when an in-flight token is an EOS
    read only after that launch (the row's token from the mixed step is dropped), with
    sampled rows, parallel samples, a shared prefix and a cache small enough to preempt."""
    system = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    arrivals = arrivals_while_decoding(system, 6 if num_blocks == 200 else 16)  # long outputs outgrow 12 blocks
    plain, _ = drive(make_engine(model, async_decode=False), arrivals)
    seen: dict[int, int] = {}  # token -> requests that emit it mid-decode first at index >= 1
    for r in plain:
        for i, token in enumerate(r.output_ids[:-1]):
            if i >= 1 and token not in r.output_ids[:i]:
                seen[token] = seen.get(token, 0) + 1
    eos = max(seen, key=seen.get)
    with_eos = build_random_model(dataclasses.replace(SMALL, eos_token_id=eos), seed=0)  # same weights
    settings = dict(num_blocks=num_blocks, enable_prefix_caching=caching)
    want, _ = drive(make_engine(with_eos, async_decode=False, **settings), arrivals, frozenset({eos}))
    engine = make_engine(with_eos, **settings)
    got, _ = drive(engine, arrivals, frozenset({eos}))
    assert outputs(got) == outputs(want)
    assert [[s.output_ids for s in r.samples] for r in got] == [[s.output_ids for s in r.samples] for r in want]
    assert sum(r.finish_reason == "eos" for r in got) >= 2
    assert engine.timings.behind_steps >= 2
    if num_blocks == 12:
        assert engine.scheduler.num_preemptions > 0
    if caching:
        assert sum(r.num_cached for r in got) > 0
    allocator = engine.kv_cache.allocator
    assert allocator.num_free_blocks == allocator.num_blocks and allocator.block_tables == {}
