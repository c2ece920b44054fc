"""CPU decode step: our engine against transformers' DiffLlama on the same weights.

The main CPU job, ``compiled-attn generate`` with the embedded default model
(``DEFAULT_MODEL_DIR``: 8 layers, hidden 256, 8 heads of 32, 8 KV heads, trained), float32, greedy,
a prompt of ``--prompt-len`` random byte tokens, ``--new-tokens`` generated, batch 1 and 8:

* ours: :class:`compiled_attn.engine.Engine` with the CLI's defaults, compiled
  (``compile=True``) and eager; a warm-up ``generate`` on the same prompts, then the best
  of ``--repeats`` runs of ``timings.decode_seconds / timings.decode_steps``;
* theirs (anchor): ``transformers.DiffLlamaForCausalLM.generate(...,
  cache_implementation="static")`` on our weights written as a Hugging Face checkpoint.
  transformers compiles the decode forward of a static-cache ``generate`` with its default
  ``CompileConfig`` (inductor, ``mode="reduce-overhead"``, whose CUDA graphs do not apply
  on the CPU) only on accelerators; ``CompileConfig._compile_all_devices`` asks for the same
  compile on the CPU. Also timed without compile (``disable_compile=True``). A step is
  (time of N new tokens - time of 1 token) / (N - 1), best of ``--repeats``.

Both sides run in this process, one after the other, with ``torch.set_num_threads`` at
the CPUs this process may use. Greedy tokens of ours and theirs are compared (float32
rounding may flip a near-tie of two logits and the two continuations part from there; the
table says how many tokens agree). Anchors of the
attention kernel: the per-call time of ``compiled_attn.ops.reference.paged_attention``
(the CPU kernel of the paged ops) at the decode shapes against one
``F.scaled_dot_product_attention`` call on the same keys, already contiguous. Appends the
table to ``<results-dir>/cpu.md`` and ``cpu.jsonl``; ``--profile`` also prints the top ops
of our compiled decode steps (``torch.profiler``).

    python profiling/bench_cpu.py [--batch-sizes 1 8] [--results-dir profiling/results] [--profile]
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
import timeit
from pathlib import Path

import torch
import torch.nn.functional as F

from compiled_attn.benchmark import _prompts
from compiled_attn.engine import Engine
from compiled_attn.models import DEFAULT_MODEL_DIR, load_diffllama, save_diffllama
from compiled_attn.ops import reference
from compiled_attn.ops.arith import cdiv
from compiled_attn.results import ResultRow, write_results
from compiled_attn.sampling import SamplingParams


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def time_ours(model, prompts, new_tokens: int, compile: bool, repeats: int, profile: bool = False):
    """Best decode seconds per step of ``repeats`` generate calls, and the greedy tokens."""
    engine = Engine(model, compile=compile, max_num_seqs=max(8, len(prompts)))
    params = SamplingParams(max_new_tokens=new_tokens)
    engine.generate(prompts, params)  # warm-up: compiles every shape of the run
    steps, tokens = [], None
    for _ in range(repeats):
        requests, timings = engine.generate(prompts, params)
        steps.append(timings.decode_seconds / timings.decode_steps)
        tokens = [r.output_ids for r in requests]
    if profile:
        with torch.profiler.profile() as prof:
            _, timings = engine.generate(prompts, params)
        print(f"\ntorch.profiler, ours {'compiled' if compile else 'eager'} B={len(prompts)}: "
              f"{timings.decode_steps} decode steps, {timings.decode_seconds * 1e3:.1f} ms decode, "
              f"{timings.prefill_seconds * 1e3:.1f} ms prefill (profiler overhead included)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    del engine
    gc.collect()
    return min(steps), tokens


def time_theirs(model_dir: Path, prompts, new_tokens: int, compile: bool, repeats: int):
    """Best decode seconds per step of transformers' static-cache generate, and its tokens."""
    from transformers import DiffLlamaForCausalLM
    from transformers.generation.configuration_utils import CompileConfig

    hf = DiffLlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    compile_config = CompileConfig()  # what generate uses on an accelerator
    compile_config._compile_all_devices = True  # ... and, asked, on the CPU

    def run(n: int):
        start = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                          min_new_tokens=n, cache_implementation="static", pad_token_id=0,
                          compile_config=compile_config, disable_compile=not compile)
        return time.perf_counter() - start, out

    run(new_tokens)  # compiles
    run(1)
    steps = []
    for _ in range(repeats):
        full, out = run(new_tokens)
        one, _ = run(1)
        steps.append((full - one) / (new_tokens - 1))
    del hf
    gc.collect()
    return min(steps), out[:, ids.shape[1]:].tolist()


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> tuple[int, int, int]:
    """(tokens equal position by position, tokens in all, shortest common prefix of a row)."""
    equal = sum(a == b for x, y in zip(ours, theirs) for a, b in zip(x, y))
    total = sum(len(x) for x in ours)
    prefix = min(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(ours, theirs))
    return equal, total, prefix


def kernel_call_us(batch: int, context: int, config, repeats: int = 15) -> tuple[float, float]:
    """Per-call microseconds of the CPU paged-attention kernel (differential, one query per
    sequence, ``context`` keys each, the engine's 256-column block table) and of one SDPA
    call on the same queries and keys, contiguous (no gather, no differential)."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, size, block = config.num_attention_heads, config.num_key_value_heads, config.head_dim, 16
    used = cdiv(context, block)
    cache_blocks = batch * used + 1
    key_cache = torch.randn(cache_blocks, block, kv_heads, size, generator=g)
    value_cache = torch.randn(cache_blocks, block, kv_heads, size, generator=g)
    table = torch.zeros(batch, 256, dtype=torch.int32)
    table[:, :used] = torch.randperm(cache_blocks - 1, generator=g)[: batch * used].view(batch, used).int() + 1
    query = torch.randn(batch, heads, size, generator=g)
    cu_seqlens = torch.arange(batch + 1, dtype=torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    lam = torch.tensor(0.5)
    q = query.unsqueeze(2)
    k = torch.randn(batch, kv_heads, context, size, generator=g)
    v = torch.randn(batch, kv_heads, context, size, generator=g)

    def best_us(fn) -> float:
        timer = timeit.Timer(fn)
        number, _ = timer.autorange()
        return min(timer.repeat(repeats, number)) / number * 1e6

    ours = best_us(lambda: reference.paged_attention(query, key_cache, value_cache, cu_seqlens, seq_lens, table,
                                                     lam, size ** -0.5, True, -1, -1, 0.0, None))
    sdpa = best_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    return ours, sdpa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (best kept)")
    parser.add_argument("--results-dir", default="profiling/results")
    parser.add_argument("--profile", action="store_true", help="print torch.profiler tops of our decode steps")
    args = parser.parse_args()

    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(threads)
    model = load_diffllama(DEFAULT_MODEL_DIR)
    config = model.config
    rows: list[ResultRow] = []
    lines = [f"{'case':<8} {'ours compiled':>14} {'ours eager':>11} {'HF compiled':>12} {'HF eager':>9} "
             f"{'ours/HF compiled':>17} {'ours/HF eager':>14}  greedy tokens equal"]
    with tempfile.TemporaryDirectory() as model_dir:
        save_diffllama(model, model_dir)
        for batch in args.batch_sizes:
            prompts = _prompts(batch, args.prompt_len, config.vocab_size)
            step, tokens = {}, {}
            for name, compile in (("ours compiled", True), ("ours eager", False)):
                step[name], tokens[name] = time_ours(model, prompts, args.new_tokens, compile, args.repeats,
                                                     profile=args.profile and compile)
            for name, compile in (("HF compiled", True), ("HF eager", False)):
                step[name], tokens[name] = time_theirs(Path(model_dir), prompts, args.new_tokens, compile,
                                                       args.repeats)
            equal, total, prefix = agreement(tokens["ours compiled"], tokens["HF compiled"])
            same_ours = tokens["ours compiled"] == tokens["ours eager"]
            ms = {name: s * 1e3 for name, s in step.items()}
            lines.append(f"B={batch:<6} {ms['ours compiled']:>11.3f} ms {ms['ours eager']:>8.3f} ms "
                         f"{ms['HF compiled']:>9.3f} ms {ms['HF eager']:>6.3f} ms "
                         f"{ms['ours compiled'] / ms['HF compiled']:>17.2f} "
                         f"{ms['ours eager'] / ms['HF eager']:>14.2f}  "
                         f"{equal}/{total} (all rows agree for the first {prefix}; ours compiled == eager: {same_ours})")
            print(lines[-1], flush=True)
            rows += [
                ResultRow(f"B={batch} ours compiled", "step ms", ms["ours compiled"], "HF static+compile ms",
                          ms["HF compiled"], "<= 1.0"),
                ResultRow(f"B={batch} ours eager", "step ms", ms["ours eager"], "HF static+compile ms",
                          ms["HF compiled"]),
                ResultRow(f"B={batch} ours eager", "step ms", ms["ours eager"], "HF static eager ms", ms["HF eager"]),
                ResultRow(f"B={batch} greedy tokens equal, ours compiled vs HF compiled", "tokens", equal,
                          "tokens", total),
            ]
    for batch in args.batch_sizes:
        for context in (16, 80, 300):
            ours, sdpa = kernel_call_us(batch, context, config)
            rows.append(ResultRow(f"paged_attention kernel, differential, B={batch} ctx={context}", "us/call", ours,
                                  "SDPA call, same K/V contiguous, us", sdpa))
            print(f"paged_attention kernel B={batch} ctx={context}: {ours:.1f} us/call (SDPA anchor {sdpa:.1f} us)")
    print("\n".join(lines))
    print(write_results(rows, args.results_dir, "cpu",
                        f"CPU decode step, default model fp32, prompt {args.prompt_len}, {args.new_tokens} new "
                        f"tokens, greedy, {cpu_name()}, torch.set_num_threads({threads})"))


if __name__ == "__main__":
    main()
