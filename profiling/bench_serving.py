"""Serving benchmark: seeded synthetic traffic through the engine, TTFT and TPOT percentiles.

Requests arrive as a Poisson process (``--rate`` per second) with long-tailed (log-normal)
prompt and output lengths, and are stepped through :class:`compiled_attn.engine.Engine`;
a request's *TTFT* is the wall time from its arrival to the step that gave its first
token, its *TPOT* the mean time between its later tokens. Two scenarios, each run with the
engine features off and on, on the same traffic:

* ``system-prompt``: every prompt starts with one shared system prompt
  (``--system-prompt-len``); with and without prefix caching (target: TTFT p50 >= 3x lower);
* ``long-prompts``: short requests decode while long prompts (``--long-prompt-len``)
  arrive; without a token budget and with ``max_num_batched_tokens`` (chunked prefill);
  TPOT p50 and p99 of the short requests, each against the same percentile of the short
  requests alone (target: p99 <= 2x that).

The model is the bench's ~1.1 B DiffLlama on CUDA and ``random_model_config()`` on the CPU
(random weights, greedy). ``--kv-cache-dtype fp8`` serves from an fp8 KV cache with the
engine's default scales (1.0; the kernels' time does not depend on them). ``--poll`` steps
the engine as a polling serving loop (``Engine.step(wait=False)``): a request that arrives
while a decode step runs is then prefilled right after that step, not after the next one.
Appends to ``<results-dir>/serving.md`` and ``serving.jsonl`` (default ``profiling/results``
on CUDA; on the CPU only when ``--results-dir`` is given, else it prints the table).

    python profiling/bench_serving.py [--device cuda] [--requests 64] [--rate 8] [--kv-cache-dtype fp8] [--poll]
                                      [--profile DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch

from compiled_attn.benchmark import BENCH_CONFIG
from compiled_attn import engine as engine_module
from compiled_attn.engine import Engine
from compiled_attn.kv_cache import KV_CACHE_DTYPES
from compiled_attn.models import build_random_model, random_model_config
from compiled_attn.ops.arith import cdiv
from compiled_attn.ops.backends import compiled_variants
from compiled_attn.profiler import StepProfiler
from compiled_attn.results import ResultRow, format_table, write_results
from compiled_attn.sampling import SamplingParams
from compiled_attn.scheduler import check_token_budget


def traffic(n: int, rate: float, vocab: int, seed: int, system: list[int], mean_prompt: int, mean_output: int,
            max_len: int) -> list[tuple[float, list[int], int]]:
    """``(arrival seconds, prompt ids, max_new_tokens)`` of ``n`` requests."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        prompt_len = max(1, min(int(rng.lognormvariate(0, 0.8) * mean_prompt), max_len // 2))
        output_len = max(2, min(int(rng.lognormvariate(0, 0.8) * mean_output), max_len // 4))
        arrivals.append((t, system + [rng.randrange(vocab) for _ in range(prompt_len)], output_len))
    return arrivals


def serve(engine: Engine, arrivals, on_step=None, poll: bool = False) -> tuple[list[dict], float, int]:
    """Step ``engine`` over ``arrivals`` in wall time (``on_step()`` after every step, e.g. a
    profiler's; ``poll``: ``step(wait=False)``, which returns at once while the decode step
    in flight is far from its end, so arrivals are added as they come). Returns one record
    per request (``prompt``, ``ttft`` and ``tpot`` in seconds, ``tpot`` ``None`` for a single
    token), the wall seconds and the tokens generated; prints the median wall time of steps
    that prefilled (mixed steps) and of decode steps (polls that ran nothing left out: under
    ``poll`` a step's time is then only the blocking tail of a poll, not the step period),
    and of the parts of a request's wait for its first token: from its arrival to its
    ``add_request``, and in the step that prefills it from the step's start to the mixed
    launch, the launch's host time, and from the launch to the step's end (its tokens read)."""
    start, pending, live = time.perf_counter(), list(arrivals), []
    step_ms = {"mixed": [], "decode": []}
    admit_ms = {"arrival to add_request": [], "step to launch": [], "launch (host)": [], "launch to tokens": []}
    calls_ms, settle, launch = _time_calls(engine)
    variants, graphs = compiled_variants(), engine.compile_stats.graphs_compiled
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            arrival, prompt, new_tokens = pending.pop(0)
            live.append((arrival, prompt, engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens)), []))
            admit_ms["arrival to add_request"].append((time.perf_counter() - start - arrival) * 1e3)
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        prefilled, idle = engine.timings.prefill_tokens, engine.timings.idle_polls
        began = time.perf_counter()
        engine.step(wait=not poll)
        ended = time.perf_counter()
        if engine.timings.idle_polls > idle:
            continue
        settle()
        if on_step is not None:
            on_step()
        mixed = engine.timings.prefill_tokens > prefilled
        step_ms["mixed" if mixed else "decode"].append((ended - start - now) * 1e3)
        if mixed:
            for part, ms in zip(admit_ms.values(), (None, launch[0] - began, launch[1] - launch[0], ended - launch[1])):
                if ms is not None:
                    part.append(ms * 1e3)
        now = time.perf_counter() - start
        for _, _, request, stamps in live:
            stamps.extend([now] * (len(request.output_ids) - len(stamps)))
    records = [{"prompt": prompt, "ttft": stamps[0] - arrival,
                "tpot": (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None}
               for arrival, prompt, _, stamps in live]
    seconds, tokens = time.perf_counter() - start, sum(len(stamps) for *_, stamps in live)
    ttft = sorted(r["ttft"] for r in records)
    steps = ", ".join(f"{len(ms)} {kind} steps, median {statistics.median(ms):.2f} ms"
                      for kind, ms in step_ms.items() if ms)
    steps += "; median ms of " + ", ".join(f"{name} {statistics.median(ms):.2f} ({len(ms)}x)"
                                       for name, ms in {**admit_ms, **calls_ms}.items() if ms)
    mixed = engine.runner.mixed_capture_stats
    print(f"engine warm-up {engine.warmup_seconds:.1f} s ({len(mixed.sizes) if mixed else 0} mixed-step graphs "
          f"captured in {mixed.seconds if mixed else 0:.1f} s); "
          f"served {len(records)} requests in {seconds:.1f} s, {tokens} tokens; TTFT median "
          f"{ttft[len(ttft) // 2] * 1e3:.1f} ms; {steps}; compiled while serving: "
          f"{compiled_variants() - variants} Triton variants, "
          f"{engine.compile_stats.graphs_compiled - graphs} graphs", flush=True)  # progress, should a later run not finish
    return records, seconds, tokens


def _time_calls(engine: Engine):
    """Wrap the parts of a step (the in-flight decode read, scheduling, the runner's mixed
    and decode launches, the mixed-buffer writes) to record each call's wall milliseconds,
    and on CUDA a mixed-step graph replay's device milliseconds per ``(tokens, seqs)`` shape
    (CUDA events around it, read after the step: the timing adds no wait). Returns
    ``(calls_ms, settle, launch)``: ``settle()`` (after each step) reads the replays'
    events; ``launch`` holds the host times the last ``launch_chunks`` began and ended."""
    calls_ms, pending, launch = {}, [], [0.0, 0.0]
    graphs = engine.runner.mixed_graphs
    if graphs is not None and torch.cuda.is_available():
        def replay(shape, greedy=False, _fn=graphs.replay):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            tokens = _fn(shape, greedy)
            end.record()
            pending.append((f"replay {shape[0]}x{shape[1]} (device)", begin, end))
            return tokens

        graphs.replay = replay

    def settle() -> None:
        for name, begin, end in pending:
            end.synchronize()
            calls_ms.setdefault(name, []).append(begin.elapsed_time(end))
        pending.clear()

    parts = {"drain": (engine, "_drain"), "schedule": (engine.scheduler, "schedule"),
             "launch_chunks": (engine.runner, "launch_chunks"), "launch_decode": (engine.runner, "launch_decode")}
    if engine.runner.mixed_buffers is not None:
        parts["mixed buffer writes"] = (engine.runner.mixed_buffers, "write")
    for name, (owner, attribute) in parts.items():
        calls_ms[name] = []

        def timed(*args, _fn=getattr(owner, attribute), _ms=calls_ms[name], _name=name, **kwargs):
            begin = time.perf_counter()
            result = _fn(*args, **kwargs)
            end = time.perf_counter()
            _ms.append((end - begin) * 1e3)
            if _name == "launch_chunks":
                launch[:] = [begin, end]
            return result

        setattr(owner, attribute, timed)
    return calls_ms, settle, launch


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", type=int, default=None, help="default: 64 on cuda, 16 on cpu")
    parser.add_argument("--rate", type=float, default=None, help="arrivals per second (default: 8 cuda, 2 cpu)")
    parser.add_argument("--system-prompt-len", type=int, default=None, help="default: 1024 cuda, 96 cpu")
    parser.add_argument("--long-prompt-len", type=int, default=None, help="default: 8192 cuda, 256 cpu")
    parser.add_argument("--budget", type=int, default=None,
                        help="max_num_batched_tokens, at least 16 (a block) and max_num_seqs (64 cuda, 16 cpu) "
                             "(default: 512 cuda, 32 cpu)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="KV-cache dtype: auto = the model's; fp8 (alias fp8_e4m3) = float8_e4m3fn, scales 1.0")
    parser.add_argument("--poll", action="store_true",
                        help="step the engine with step(wait=False) in a polling loop, adding requests as they "
                             "arrive while a decode step runs (default: blocking steps)")
    parser.add_argument("--launch-lead-us", type=float, default=None,
                        help="with --poll: how long before the decode step in flight ends the next is launched "
                             f"(engine.LAUNCH_LEAD_SECONDS, default {engine_module.LAUNCH_LEAD_SECONDS * 1e6:.0f} us)")
    parser.add_argument("--results-dir", default=None,
                        help="where to append the tables (default: profiling/results on cuda, nowhere on cpu)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="also trace the first --profile-steps steps of a third, untimed run of the "
                             "prefix-caching scenario into DIR (compiled-attn profile-report DIR reads it)")
    parser.add_argument("--profile-steps", type=int, default=48)
    parser.add_argument("--scenarios", nargs="+", choices=("system-prompt", "long-prompts"),
                        default=("system-prompt", "long-prompts"), help="the scenarios to run (default: both)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    for name in ("requests", "rate", "system_prompt_len", "long_prompt_len", "budget"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.launch_lead_us is not None:
        if not (args.poll and args.launch_lead_us >= 0):
            parser.error(f"--launch-lead-us needs --poll and a value >= 0, got {args.launch_lead_us}")
        engine_module.LAUNCH_LEAD_SECONDS = args.launch_lead_us * 1e-6
    config = BENCH_CONFIG if cuda else random_model_config()

    def given(value, cuda_default, cpu_default):
        return (cuda_default if cuda else cpu_default) if value is None else value

    n = given(args.requests, 64, 16)
    rate = given(args.rate, 8.0, 2.0)
    system_len = given(args.system_prompt_len, 1024, 96)
    long_len = given(args.long_prompt_len, 8192, 256)
    budget = given(args.budget, 512, 32)
    max_seqs = 64 if cuda else 16
    try:  # before any scenario runs, not when the engine is built (the engines' block size: 16)
        check_token_budget(budget, max_seqs, 16, names=("--budget", "max_num_seqs", "the block size"))
    except ValueError as err:
        parser.error(str(err))
    max_len = max(2 * long_len, 4 * system_len, 512)
    model = build_random_model(config, seed=0, dtype=torch.bfloat16 if cuda else torch.float32, device=args.device)
    vocab = config.vocab_size

    def engine(**kwargs) -> Engine:
        # a quarter of the worst case, at least one longest request
        return Engine(model, max_model_len=max_len, max_num_seqs=max_seqs, kv_cache_dtype=args.kv_cache_dtype,
                      num_blocks=max(cdiv(n * max_len, 16) // 4, cdiv(max_len, 16) + 1), **kwargs)

    rows = []
    if "system-prompt" in args.scenarios:
        rows += system_prompt_rows(args, engine, n, rate, vocab, system_len, max_len)
    if "long-prompts" in args.scenarios:
        rows += long_prompt_rows(engine, n, rate, vocab, long_len, budget, max_len, args.seed, args.poll)
    device = torch.cuda.get_device_name() if cuda else "cpu"
    kv = ("" if args.kv_cache_dtype == "auto" else ", fp8 KV cache") + (
        f", polling loop (lead {engine_module.LAUNCH_LEAD_SECONDS * 1e6:.0f} us)" if args.poll else "")
    rows = [dataclasses.replace(row, case=row.case + kv) for row in rows]  # (the jsonl has no title)
    title = f"Serving, {config.num_hidden_layers}-layer DiffLlama ({'bf16' if cuda else 'fp32'}{kv}), {device}"
    results_dir = args.results_dir or ("profiling/results" if cuda else None)
    print(format_table(rows, title) if results_dir is None else write_results(rows, results_dir, "serving", title))


def system_prompt_rows(args, engine, n, rate, vocab, system_len, max_len) -> list[ResultRow]:
    """TTFT percentiles and throughput with a shared system prompt, prefix caching off and on."""
    rows = []
    system = [random.Random(args.seed).randrange(vocab) for _ in range(system_len)]
    shared = traffic(n, rate, vocab, args.seed, system, 64, 64, max_len)
    runs = {caching: serve(engine(enable_prefix_caching=caching), shared, poll=args.poll) for caching in (False, True)}
    if args.profile is not None:  # a third run, traced (writing the trace would stall a timed one)
        traced = engine(enable_prefix_caching=True)  # built (compiled, captured) before the trace starts
        with StepProfiler(args.profile, active=args.profile_steps, record_shapes=True, device=args.device) as profiler:
            serve(traced, shared, on_step=profiler.step, poll=args.poll)
    case = f"{n} requests, {rate}/s, shared system prompt {system_len}"
    for name, q in (("p50", 50), ("p99", 99)):
        ttft = {caching: percentile([r["ttft"] for r in records], q) * 1e3 for caching, (records, _, _) in runs.items()}
        rows.append(ResultRow(f"{case}: TTFT {name}, prefix caching", "ms", ttft[True], "without ms", ttft[False],
                              "<= 0.33" if q == 50 else ""))
    throughput = {caching: tokens / seconds for caching, (_, seconds, tokens) in runs.items()}
    rows.append(ResultRow(f"{case}: throughput, prefix caching", "tokens/s", throughput[True], "without tokens/s",
                          throughput[False]))
    return rows


def long_prompt_rows(engine, n, rate, vocab, long_len, budget, max_len, seed, poll) -> list[ResultRow]:
    """TPOT p50 and p99 of short requests while long prompts arrive, without and with a token
    budget, against the same percentiles of the short requests alone."""
    rows = []
    short = traffic(n, rate, vocab, seed + 1, [], 32, 64, max_len)
    longs = [(t, [random.Random(i).randrange(vocab) for _ in range(long_len)], 4)
             for i, (t, _, _) in enumerate(traffic(max(2, n // 8), rate / 8, vocab, seed + 2, [], 1, 1, max_len))]
    mixed = sorted(short + longs, key=lambda a: a[0])
    alone, _, _ = serve(engine(enable_prefix_caching=False), short, poll=poll)
    alone_tpot = [r["tpot"] for r in alone if r["tpot"] is not None]
    short_prompts = {id(prompt) for _, prompt, _ in short}
    for label, kwargs in (("no budget", {}), (f"budget {budget}", {"max_num_batched_tokens": budget})):
        records, _, _ = serve(engine(enable_prefix_caching=False, **kwargs), mixed, poll=poll)
        tpot = [r["tpot"] for r in records if id(r["prompt"]) in short_prompts and r["tpot"] is not None]
        for name, q in (("p50", 50), ("p99", 99)):
            rows.append(ResultRow(f"{n} short requests + {len(longs)} prompts of {long_len}: TPOT {name} of the "
                                  f"short, {label}", "ms", percentile(tpot, q) * 1e3,
                                  f"short requests alone {name} ms", percentile(alone_tpot, q) * 1e3,
                                  "<= 2" if kwargs and q == 99 else ""))
    return rows


if __name__ == "__main__":
    main()
