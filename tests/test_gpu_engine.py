"""The graph-replayed decode engine on a CUDA GPU (run on the H200: ``pytest -m gpu``)."""

from __future__ import annotations

import random
import time

import pytest
import torch

import compiled_attn.engine as engine_module
from compiled_attn.engine import Engine, InflightStep
from compiled_attn.graphs import decode_step
from compiled_attn.models import DiffLlamaConfig, build_random_model
from compiled_attn.profiler import StepProfiler, summarize_trace
from compiled_attn.sampling import SamplingParams
from compiled_attn.step_inputs import DecodeBuffers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CONFIG = DiffLlamaConfig(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=256,
    eos_token_id=None, lambda_std_dev=0.3,
)


def _model(seed: int, dtype=torch.float32):
    model = build_random_model(CONFIG, seed=seed, dtype=dtype, device="cuda")
    model.lm_head.weight.mul_(30.0)  # wide logit margins: greedy picks are not near-ties
    return model


def _workload(n: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(CONFIG.vocab_size) for _ in range(rng.randint(1, 60))] for _ in range(n)]
    params = [SamplingParams(max_new_tokens=rng.randint(1, 24), temperature=rng.choice([0.0, 0.0, 0.7]),
                             top_p=rng.choice([1.0, 0.9])) for _ in range(n)]
    return prompts, params


def test_overlapped_graph_replay_gives_the_tokens_of_synchronous_eager_for_64_mixed_requests():
    model = _model(0)
    prompts, params = _workload(64, seed=1)
    eager, _ = Engine(model, compile=False, cuda_graphs=False, num_blocks=512,
                      async_decode=False).generate(prompts, params, seed=3)
    engine = Engine(model, compile=True, cuda_graphs=True, max_num_seqs=32, num_blocks=512)
    replayed, timings = engine.generate(prompts, params, seed=3)
    assert engine.capture_stats is not None and engine.capture_stats.sizes == [1, 2, 4, 8, 16, 24, 32]
    # Decode rows also ride in mixed steps with prefill chunks; 24 steps are pure graph-replayed decode.
    assert timings.decode_steps >= 16 and timings.overlapped_steps > 0
    mismatched = [i for i, (a, b) in enumerate(zip(eager, replayed)) if a.output_ids != b.output_ids]
    assert not mismatched, f"requests {mismatched} differ between eager and graph replay"


def test_mixed_graph_replays_with_prefix_hits_and_chunked_prefill_give_the_tokens_of_compiled_steps():
    model = _model(2)
    prompts, params = _workload(48, seed=4)
    system = list(range(100, 140))  # a shared prefix of 40 tokens: prefix-cache hits
    prompts = [system + p if i % 2 else p for i, p in enumerate(prompts)]

    def engine(**kwargs):
        return Engine(model, compile=True, max_num_seqs=16, num_blocks=512, max_num_batched_tokens=64, **kwargs)

    compiled, _ = engine(cuda_graphs=False).generate(prompts, params, seed=5)
    graphed = engine(cuda_graphs=True)
    assert graphed.runner.mixed_capture_stats.sizes == graphed.runner.mixed_buffers.sizes
    replays = []
    replay = graphed.runner.mixed_graphs.replay
    graphed.runner.mixed_graphs.replay = lambda shape, greedy: replays.append(shape) or replay(shape, greedy)
    got, _ = graphed.generate(prompts, params, seed=5)
    assert len(replays) > 10 and max(t for t, _ in replays) == 64
    mismatched = [i for i, (a, b) in enumerate(zip(compiled, got)) if a.output_ids != b.output_ids]
    assert not mismatched, f"requests {mismatched} differ between compiled and graph-replayed mixed steps"


def test_admissions_launched_behind_replayed_decode_give_the_tokens_of_a_synchronous_engine():
    """Requests arriving while others decode are prefilled by mixed-step graphs launched
    behind the decode graph in flight, the decode rows fed that step's tokens on the device."""
    model = _model(3)
    prompts, params = _workload(24, seed=6)
    system = list(range(200, 240))  # prefix-cache hits for the odd requests
    prompts = [system + p if i % 2 else p for i, p in enumerate(prompts)]

    def serve(engine: Engine) -> list[list[int]]:
        requests, step = [], 0
        while len(requests) < len(prompts) or engine.has_unfinished():
            if len(requests) < len(prompts) and step % 3 == 0:
                requests.append(engine.add_request(prompts[len(requests)], params[len(requests)]))
            engine.step()
            step += 1
        return [r.output_ids for r in requests]

    want = serve(Engine(model, compile=False, cuda_graphs=False, num_blocks=512, async_decode=False))
    engine = Engine(model, compile=True, cuda_graphs=True, max_num_seqs=16, num_blocks=512)
    got = serve(engine)
    assert engine.timings.behind_steps > 5 and engine.timings.overlapped_steps > 0
    mismatched = [i for i, (a, b) in enumerate(zip(want, got)) if a != b]
    assert not mismatched, f"requests {mismatched} differ from the synchronous eager engine"


def test_a_polling_loop_gives_the_tokens_of_a_synchronous_engine(monkeypatch):
    """``step(wait=False)`` in a loop that adds a request every 2 ms of wall time: polls
    return at once while the replayed decode step in flight is far from its end (its device
    time measured by CUDA events; no lead, as this small model's step may take less than
    ``LAUNCH_LEAD_SECONDS``), admissions are launched behind it, and every request's tokens
    equal a synchronous eager engine's."""
    monkeypatch.setattr(engine_module, "LAUNCH_LEAD_SECONDS", 0.0)
    model = _model(3)
    prompts, params = _workload(24, seed=7)

    def serve(engine: Engine, wait: bool) -> list[list[int]]:
        """All requests at once (``wait``), else one every 2 ms; outputs do not depend on it."""
        requests, start = [], time.perf_counter()
        while len(requests) < len(prompts) or engine.has_unfinished():
            due = len(prompts) if wait else int((time.perf_counter() - start) / 2e-3) + 1
            while len(requests) < min(due, len(prompts)):
                requests.append(engine.add_request(prompts[len(requests)], params[len(requests)]))
            engine.step(wait=wait)
        return [r.output_ids for r in requests]

    want = serve(Engine(model, compile=False, cuda_graphs=False, num_blocks=512, async_decode=False), True)
    engine = Engine(model, compile=True, cuda_graphs=True, max_num_seqs=16, num_blocks=512)
    got = serve(engine, False)
    assert engine.timings.idle_polls > 0 and engine.timings.behind_steps > 0, engine.timings
    assert engine._decode_device_seconds > 0
    mismatched = [i for i, (a, b) in enumerate(zip(want, got)) if a != b]
    assert not mismatched, f"requests {mismatched} differ from the synchronous eager engine"


def test_1000_steps_of_changing_batch_size_no_recompiles_no_captures_steady_memory():
    model = _model(1, torch.bfloat16)
    engine = Engine(model, compile=True, cuda_graphs=True, max_num_seqs=16, num_blocks=1024)
    rng = random.Random(0)
    sizes, memory = [], {}
    for step in range(1000):
        target = 1 + (step // 40) % 16  # the wanted number of live requests sweeps 1..16
        while len(engine.scheduler.running) + len(engine.scheduler.waiting) < target:
            engine.add_request([rng.randrange(CONFIG.vocab_size) for _ in range(rng.randint(1, 30))],
                               SamplingParams(max_new_tokens=rng.randint(1, 40)))
        if engine.scheduler.running and not engine.scheduler.waiting:
            sizes.append(len(engine.scheduler.running))
        engine.step()
        if step == 100:
            stats = engine.compile_stats
            warm = (stats.graphs_compiled, len(engine.runner.graph_runner.graphs))
            memory["warm"] = torch.cuda.memory_allocated()
    memory["end"] = torch.cuda.memory_allocated()
    assert min(sizes) == 1 and max(sizes) == 16
    assert (stats.graphs_compiled, len(engine.runner.graph_runner.graphs)) == warm
    assert stats.recompiles == 0 and stats.graph_breaks == 0
    assert abs(memory["end"] - memory["warm"]) < 1 << 20, memory


def _rows_after_prefill(engine: Engine, prompts):
    rows = []
    for prompt in prompts:
        request = engine.add_request(prompt, SamplingParams(max_new_tokens=8))
        engine.step()
        table = engine.kv_cache.allocator.allocate(request.request_id, request.num_tokens + 1)
        rows.append(request.decode_row(list(table)))
    return rows


def test_poisoned_padding_never_changes_real_rows():
    model = _model(2)
    engine = Engine(model, compile=True, cuda_graphs=True, max_num_seqs=8, num_blocks=64)
    engine.capture()
    rows = _rows_after_prefill(engine, [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]])
    used = {b for t in engine.kv_cache.allocator.block_tables.values() for b in t}
    unused = torch.tensor(sorted(set(range(64)) - used), device="cuda")
    for k, v in engine.kv_cache.layers:
        k[unused] = float("nan")
        v[unused] = float("nan")
    clean = DecodeBuffers(8, engine.max_blocks_per_seq, engine.kv_cache.block_size, "cuda")
    clean.write(rows, 3)
    with torch.no_grad():
        want = decode_step(engine.runner.forward, engine.kv_cache.layers, clean, 3)
    engine.runner.buffers.write(rows, 4)  # one padding row, then poison it
    engine.runner.buffers.input_ids[3] = 7
    engine.runner.buffers.positions[3] = 10**6
    engine.runner.buffers.block_table[3] = torch.randint(0, 64, engine.runner.buffers.block_table[3].shape, device="cuda")
    engine.runner.buffers.temperature[3] = float("nan")
    engine.runner.buffers.top_p[3] = float("nan")
    got = engine.runner.graph_runner.replay(4)
    assert torch.equal(got[:3], want)
    for k, v in engine.kv_cache.layers:  # the padding row wrote nothing into unused blocks
        assert torch.isnan(k[unused]).all() and torch.isnan(v[unused]).all()


def test_the_host_copy_of_a_replay_survives_the_next_replay():
    """A replay returns the graph's static output, which the next replay overwrites; the
    engine's non-blocking copy to pinned host memory, enqueued between the two, still
    reads the first replay's tokens."""
    engine = Engine(_model(3), compile=True, cuda_graphs=True, max_num_seqs=4, num_blocks=64)
    engine.capture()
    rows = _rows_after_prefill(engine, [[1, 2], [3, 4, 5]])
    engine.runner.buffers.write(rows, 2)
    want = engine.runner.graph_runner.replay(2).tolist()
    engine.runner.buffers.write(rows, 2)  # the same step again, then the next one before reading
    first = engine.runner.graph_runner.replay(2)
    inflight = InflightStep.launch([], first)
    second = engine.runner.graph_runner.replay(2)
    assert second.data_ptr() == first.data_ptr()  # no device copy: the static output itself
    assert inflight.tokens.is_pinned()
    assert inflight.read() == want


def test_trace_of_replayed_decode_shows_our_kernels_inside_replays(tmp_path):
    engine = Engine(_model(4, torch.bfloat16), compile=True, cuda_graphs=True, max_num_seqs=4, num_blocks=64)
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))  # compile and capture
    profiler = StepProfiler(tmp_path, skip_first=1, active=6)
    with profiler:
        engine.generate([[5, 6, 7, 8], [9]], SamplingParams(max_new_tokens=9), on_step=profiler.step)
    summary = summarize_trace(profiler.trace_files()[-1])
    assert summary.replay_us > 0 and summary.phase_us.get("decode_step", 0) > 0
    attention = dict(summary.kernels)
    launches = [n for n in attention if "attention_kernel" in n]
    assert launches, f"no attention kernel in {list(attention)[:10]}"
    assert summary.device_busy_us > 0


def test_reduce_overhead_records_cuda_graphs_over_our_ops_and_matches_eager():
    """``torch.compile(mode="reduce-overhead", fullgraph=True)``: the KV caches are static
    addresses, so Inductor's CUDA-graph trees record our cache-writing ops (no skipped graph)
    and give eager's tokens."""
    from torch._dynamo.utils import counters

    model = _model(5)
    prompts, params = _workload(12, seed=6)
    params = [SamplingParams(max_new_tokens=p.max_new_tokens) for p in params]  # greedy
    eager, _ = Engine(model, compile=False, cuda_graphs=False, num_blocks=256).generate(prompts, params)
    skipped = counters["inductor"]["cudagraph_skips"]
    engine = Engine(model, compile=True, cuda_graphs=False, num_blocks=256,
                    compile_kwargs={"mode": "reduce-overhead"})
    got, _ = engine.generate(prompts, params)
    assert counters["inductor"]["cudagraph_skips"] == skipped
    assert engine.compile_stats.recompiles == 0 and engine.compile_stats.graph_breaks == 0
    assert [r.output_ids for r in got] == [r.output_ids for r in eager]


def test_warmup_keeps_triton_compiles_out_of_requests():
    """After the engine's warm-up, requests of any prompt length and batch size within its
    limits compile no Triton kernel variant (no JIT inside TTFT or a profile)."""
    from compiled_attn.ops.triton_kernels import compiled_variants

    model = _model(7, torch.bfloat16)
    engine = Engine(model, compile=True, max_num_seqs=32, num_blocks=1024)
    assert engine.warmup_seconds > 0
    before = compiled_variants()
    rng = random.Random(8)
    for batch in (1, 3, 17, 32):
        prompts = [[rng.randrange(CONFIG.vocab_size) for _ in range(rng.randint(1, 200))] for _ in range(batch)]
        engine.generate(prompts, SamplingParams(max_new_tokens=5))
    assert compiled_variants() == before
    # Mixed steps (prompts arriving while others decode) and chunked prefill run the paged
    # kernel at prefill sizes: warmed up too.
    mixed = Engine(model, compile=True, max_num_seqs=32, num_blocks=1024, max_num_batched_tokens=64)
    before = compiled_variants()
    decoding = [mixed.add_request([rng.randrange(CONFIG.vocab_size) for _ in range(20)],
                                  SamplingParams(max_new_tokens=30)) for _ in range(3)]
    for step in range(12):
        if step % 3 == 1:
            mixed.add_request([rng.randrange(CONFIG.vocab_size) for _ in range(rng.randint(1, 150))],
                              SamplingParams(max_new_tokens=4))
        mixed.step()
    while mixed.has_unfinished():
        mixed.step()
    assert all(r.finish_reason for r in decoding)
    assert compiled_variants() == before
    without_graphs = Engine(model, compile=True, cuda_graphs=False, max_num_seqs=32, num_blocks=1024)
    before = compiled_variants()
    for batch in (1, 5, 9, 31):
        without_graphs.generate([[1, 2, 3]] * batch, SamplingParams(max_new_tokens=3))
    assert compiled_variants() == before


def test_fp8_kv_cache_graph_replay_matches_eager_and_warmup_compiles_every_variant():
    """An fp8 KV cache (calibrated scales) through compile + CUDA graphs: no Triton JIT
    compile after the warm-up (its prefills attend over the paged cache, which the warm-up
    enumerates), no recompiles, and the tokens of the eager fp8 engine (float32 model, as
    the first test: exact replays)."""
    from compiled_attn.kv_cache import calibrate_kv_scales
    from compiled_attn.ops.triton_kernels import compiled_variants

    model = _model(2)
    prompts, params = _workload(32, seed=4)
    scales = calibrate_kv_scales(model, prompts)
    engine = Engine(model, compile=True, cuda_graphs=True, max_num_seqs=16, num_blocks=512,
                    kv_cache_dtype="fp8", kv_scales=scales)
    assert engine.kv_cache.layers[0][0].dtype == torch.float8_e4m3fn
    variants = compiled_variants()
    replayed, _ = engine.generate(prompts, params, seed=5)
    assert compiled_variants() == variants, "a request waited for a Triton JIT compile"
    assert engine.compile_stats.recompiles == 0 and engine.compile_stats.graph_breaks == 0
    eager, _ = Engine(model, compile=False, cuda_graphs=False, num_blocks=512, async_decode=False,
                      kv_cache_dtype="fp8", kv_scales=scales).generate(prompts, params, seed=5)
    mismatched = [i for i, (a, b) in enumerate(zip(eager, replayed)) if a.output_ids != b.output_ids]
    assert not mismatched, f"requests {mismatched} differ between eager and graph replay"
