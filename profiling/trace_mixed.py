"""Where a mixed step's device time goes: kernels of replayed mixed-step graphs, per case.

    python profiling/trace_mixed.py [--system-prompt-len 1024] [--new-tokens 60]

Builds the serving bench's engine (the ~1.1 B DiffLlama, bf16, ``max_model_len`` 16384,
prefix caching on), runs one request whose prompt is a system prompt plus ``--new-tokens``
tokens (a prefix miss), then steps the same system prompt with other new tokens (a prefix
hit), a prompt of only ``--new-tokens`` tokens (no prefix) and a decode step. For each
case it replays the step's graph ``--replays`` times under the profiler and prints the
device milliseconds per replay and the kernels' self device time per replay (CUDA events
and ``torch.profiler``). Needs CUDA.
"""

from __future__ import annotations

import argparse
import random

import torch
from torch.profiler import ProfilerActivity, profile

from compiled_attn.benchmark import BENCH_CONFIG
from compiled_attn.engine import Engine
from compiled_attn.models import build_random_model
from compiled_attn.ops.triton_kernels import attention as triton_attention
from compiled_attn.sampling import SamplingParams


def replay_ms(replay, replays: int) -> float:
    """Median device milliseconds of ``replay()``."""
    times = []
    for _ in range(replays):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def kernel_table(replay, replays: int, rows: int) -> str:
    """Kernels of ``replays`` replays, self device milliseconds per replay, largest first."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    totals = {}
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0)
        if us > 0:
            totals[event.key] = totals.get(event.key, 0.0) + us / 1e3 / replays
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    lines = [f"  {ms:8.3f} ms  {name[:110]}" for name, ms in ranked[:rows]]
    return "\n".join(lines + [f"  {sum(totals.values()):8.3f} ms  (all kernels)"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system-prompt-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=60)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--rows", type=int, default=14)
    parser.add_argument("--max-splits", type=int, default=None,
                        help="cap the attention kernels' flash-decoding splits (a what-if of the split rule)")
    args = parser.parse_args()
    if args.max_splits is not None:
        rule = triton_attention.choose_num_splits
        triton_attention.choose_num_splits = lambda *a: min(rule(*a), args.max_splits)
    model = build_random_model(BENCH_CONFIG, seed=0, dtype=torch.bfloat16, device="cuda")
    engine = Engine(model, max_model_len=16384, max_num_seqs=64, num_blocks=16384, enable_prefix_caching=True)
    runner, rng = engine.runner, random.Random(0)
    shapes = []
    write = runner.mixed_buffers.write
    runner.mixed_buffers.write = lambda packed, shape, *a, **k: (shapes.append(shape), write(packed, shape, *a, **k))[1]

    def tokens(n: int) -> list[int]:
        return [rng.randrange(BENCH_CONFIG.vocab_size) for _ in range(n)]

    system = tokens(args.system_prompt_len)
    engine.generate([system + tokens(args.new_tokens)], SamplingParams(max_new_tokens=2))  # cached now
    cases = {"prefix hit": system + tokens(args.new_tokens), "no prefix": tokens(args.new_tokens)}
    for name, prompt in cases.items():
        engine.add_request(prompt, SamplingParams(max_new_tokens=4))
        shapes.clear()
        engine.step()  # its prefill: a mixed step
        shape = shapes[-1]
        print(f"== {name}: {len(prompt)} prompt tokens, mixed shape {shape}, "
              f"{replay_ms(lambda: runner.mixed_graphs.replay(shape, True), args.replays):.3f} ms a replay")
        print(kernel_table(lambda: runner.mixed_graphs.replay(shape, True), args.replays, args.rows))
        engine.step()  # a decode step
        # (its replays below advance the row past its blocks: block 0's K/V get overwritten,
        # which changes later tokens, not timings)
        rows = runner.graph_runner.padded_size(1)
        print(f"== decode step after it, {rows} row(s): "
              f"{replay_ms(lambda: runner.graph_runner.replay(rows, True), args.replays):.3f} ms a replay")
        print(kernel_table(lambda: runner.graph_runner.replay(rows, True), args.replays, args.rows))
        while engine.has_unfinished():
            engine.step()


if __name__ == "__main__":
    main()
