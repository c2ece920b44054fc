"""``compiled-attn`` command line: ``generate`` runs the decode loop on a model,
``bench`` times decode steps under several runtimes (CUDA), ``profile-report`` writes one
offline HTML report of a ``--profile`` trace, ``train`` trains a byte-level DiffLlama on the
standard library's source.

Examples::

    compiled-attn generate                              # embedded default model, CPU
    compiled-attn generate --prompt "def fibonacci(n):" --max-new-tokens 96
    compiled-attn generate --random-model --seed 3      # a seeded random model (tests)
    compiled-attn generate --model DIR --prompt "Hello" --max-new-tokens 64 --json
    compiled-attn generate --device cuda --profile runs/trace --profile-shapes --profile-stack
    compiled-attn profile-report runs/trace             # runs/trace/<worker>.<ns>.report.html
    torchrun --nproc-per-node 2 -m compiled_attn.cli generate --tensor-parallel-size 2   # tensor parallel
    compiled-attn bench --batch-sizes 1 64
    torchrun --nproc-per-node 2 -m compiled_attn.cli bench --tensor-parallel-size 2   # an ~8 B model, TP=2
    compiled-attn train --out runs/default              # the shipped ~7 M model (H200: a few minutes)
    compiled-attn train --tiny --steps 50 --seq-len 128 --batch-rows 8 --no-compile   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from .distributed import destroy_tensor_parallel, get_tp_rank, init_tensor_parallel
from .engine import Engine
from .kv_cache import KV_CACHE_DTYPES, OutOfBlocksError, calibrate_kv_scales
from .models import DEFAULT_MODEL_DIR, build_random_model, load_diffllama, random_model_config
from .models.sharding import shard_model
from .ops.backends import compiled_variants
from .profile_report import write_report
from .profiler import StepProfiler, summarize_trace
from .sampling import SamplingParams
from .scheduler import check_token_budget
from .tokenizer import load_tokenizer
from .train_cli import add_train_arguments, bounded, run_train_command

DEFAULT_PROMPTS = ("def fibonacci(n):", "class Stack:\n    def push(self, item):")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _prompt_ids(value: str) -> list[int]:
    if not value.strip(","):
        raise argparse.ArgumentTypeError("--prompt-ids needs at least one id")
    try:
        return [int(x) for x in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers, got {value!r}")


_positive_int = bounded(int, lambda number: number >= 1, "an int >= 1")
_seed = bounded(int, lambda number: 0 <= number < 1 << 63, "an int in [0, 2**63)")
_temperature = bounded(float, lambda number: 0 <= number < math.inf, "a finite number >= 0 (0 = greedy)")
_top_p = bounded(float, lambda number: 0 < number <= 1, "a number in (0, 1]")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="compiled-attn", description="Differential-attention models, compiled whole, over a paged KV cache.")
    commands = parser.add_subparsers(dest="command", required=True)
    parser.command_parsers = commands.choices  # name -> parser, for errors in a command's own usage
    gen = commands.add_parser("generate", help="generate text with a differential-attention model")
    source = gen.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path,
                        help="Hugging Face DiffLlama directory (default: the embedded model, a ~7 M-parameter "
                             "byte-level DiffLlama trained on Python's standard library)")
    source.add_argument("--random-model", action="store_true",
                        help="a seeded random model (random_model_config(), --seed) instead of the embedded one")
    prompts = gen.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", action="append", help="a text prompt (repeatable)")
    prompts.add_argument("--prompt-file", type=Path, help="file with one prompt per line")
    prompts.add_argument("--prompt-ids", type=_prompt_ids, action="append",
                         help="a prompt as comma-separated token ids (repeatable)")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=96, help="tokens (bytes) per completion, default 96")
    gen.add_argument("--temperature", type=_temperature, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=_top_p, default=1.0)
    gen.add_argument("--seed", type=_seed, default=0, help="sampling seed (and init seed of --random-model)")
    gen.add_argument("--no-compile", action="store_true", help="run the model eagerly")
    gen.add_argument("--no-cuda-graphs", action="store_true", help="decode without CUDA-graph replay (cuda only)")
    gen.add_argument("--no-async-decode", action="store_true",
                     help="read each decode step's tokens before launching the next (no host/device overlap)")
    gen.add_argument("--max-batch-size", type=_positive_int, default=128,
                     help="most sequences decoding at once, also the largest captured graph")
    gen.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    gen.add_argument("--tensor-parallel-size", type=_positive_int, default=1, metavar="N",
                     help="shard the model over N ranks (Megatron style); run under "
                          "torchrun --nproc-per-node N -m compiled_attn.cli generate ...; rank 0 prints")
    gen.add_argument("--dtype", choices=tuple(DTYPES), help="default: float32 on cpu, bfloat16 on cuda")
    gen.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV-cache block")
    gen.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                     help="KV-cache dtype: auto = the model's; fp8 (alias fp8_e4m3) = float8_e4m3fn, half the bytes")
    gen.add_argument("--calculate-kv-scales", action="store_true",
                     help="with an fp8 cache: per-layer scales max|k|/200, max|v|/100 from the prompts, vLLM's "
                          "headroom (default 1.0)")
    gen.add_argument("--max-num-batched-tokens", type=_positive_int, metavar="N",
                     help="most tokens a step computes, at least --block-size and --max-batch-size; longer "
                          "prompts are prefilled in chunks (default: no limit)")
    gen.add_argument("--no-prefix-caching", action="store_true", help="compute every prompt from its first token")
    gen.add_argument("--num-blocks", type=_positive_int,
                     help="KV-cache blocks (default: 8 sequences of max length, at most 65536 tokens)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    gen.add_argument("--profile", metavar="DIR",
                     help="write a torch.profiler trace of the timed run to DIR (TensorBoard/Perfetto)")
    gen.add_argument("--profile-steps", type=_positive_int, help="engine steps to record with --profile (default 8)")
    gen.add_argument("--memory-snapshot", type=Path, metavar="FILE",
                     help="with --profile on cuda: write a CUDA memory snapshot to FILE")
    gen.add_argument("--profile-shapes", action="store_true", help="with --profile: record ops' input shapes")
    gen.add_argument("--profile-stack", action="store_true", help="with --profile: record Python stacks of ops")
    gen.add_argument("--profile-memory", action="store_true", help="with --profile: record allocations and frees")
    bench = commands.add_parser("bench", help="decode-step latency: eager, compiled, our graphs, "
                                "reduce-overhead, transformers (CUDA)")
    bench.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    bench.add_argument("--prompt-len", type=int, default=512)
    bench.add_argument("--new-tokens", type=int, default=None,
                       help="tokens generated per prompt (default 256; 128 with --tensor-parallel-size)")
    bench.add_argument("--modes", nargs="+", default=["eager", "compiled", "graphs", "reduce-overhead", "hf"],
                       choices=["eager", "compiled", "graphs", "reduce-overhead", "hf"])
    bench.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                       help="KV-cache dtype of our engine's runtimes (auto = bfloat16, the model's)")
    bench.add_argument("--results-dir", type=Path, default=None,
                       help="where decode.md and decode.jsonl are appended (tp_decode.jsonl with TP); default "
                            "profiling/results on CUDA, nowhere for the CPU smoke run")
    bench.add_argument("--tensor-parallel-size", type=_positive_int, default=1, metavar="N",
                       help="under torchrun --nproc-per-node N: the decode step of an ~8 B model sharded over N "
                            "ranks, compiled with our CUDA graphs (compiled_attn.tp_benchmark); --modes do not apply")
    bench.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                       help="cpu: only with --tensor-parallel-size (gloo, a 3 M model: a smoke test)")
    report = commands.add_parser("profile-report", help="write one self-contained HTML report of a --profile trace "
                                 "(phase shares, decode steps apart from prefill, top ops and kernels, timeline)")
    report.add_argument("path", type=Path, metavar="DIR", help="a --profile directory (its newest trace) or a trace file")
    report.add_argument("--out", type=Path, metavar="FILE", help="HTML file (default: <trace>.report.html beside it)")
    report.add_argument("--top", type=_positive_int, default=15, help="rows in the ops and kernels tables")
    report.add_argument("--timeline-steps", type=_positive_int, default=3, help="steps drawn in the timeline")
    train = commands.add_parser("train", help="train a byte-level DiffLlama (or --plain Llama) on the Python "
                                "standard library's source through our ops (see compiled_attn.train)")
    add_train_arguments(train)
    return parser


def _check_world(tensor_parallel_size: int, command: str) -> None:
    """Raise ``ValueError`` unless torchrun started ``tensor_parallel_size`` processes."""
    processes = int(os.environ.get("WORLD_SIZE", 1))
    if processes != tensor_parallel_size:
        raise ValueError(f"--tensor-parallel-size {tensor_parallel_size} needs as many processes, "
                         f"{processes} running: pass --tensor-parallel-size {processes}, or run torchrun "
                         f"--nproc-per-node {tensor_parallel_size} -m compiled_attn.cli {command} "
                         f"--tensor-parallel-size {tensor_parallel_size} ...")


def _bench_tp(args) -> None:
    """``bench --tensor-parallel-size N``: :func:`~compiled_attn.tp_benchmark.run_tp_bench`."""
    if args.tensor_parallel_size == 1:
        raise ValueError("bench --device cpu needs --tensor-parallel-size N > 1 (the CUDA bench's runtimes need a GPU)")
    _check_world(args.tensor_parallel_size, "bench")
    if args.kv_cache_dtype != "auto":
        raise ValueError("bench --tensor-parallel-size takes no --kv-cache-dtype (its cache is the model's dtype)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("bench --tensor-parallel-size on --device cuda needs CUDA GPUs; --device cpu runs a smoke test")
    new_tokens = args.new_tokens or 128
    if new_tokens < 2 or min(args.batch_sizes) < 1:
        raise ValueError(f"bench needs --new-tokens >= 2 (a decode step to time) and --batch-sizes >= 1, got "
                         f"{new_tokens} and {args.batch_sizes}")
    from .tp_benchmark import run_tp_bench  # the harness stays off the library's import path

    results_dir = args.results_dir or (Path("profiling/results") if args.device == "cuda" else None)
    tp = init_tensor_parallel(backend="nccl" if args.device == "cuda" else "gloo")
    try:
        if results_dir is not None:
            results_dir.mkdir(parents=True, exist_ok=True)
        run_tp_bench(tp, args.batch_sizes, args.prompt_len, new_tokens, args.device,
                     None if results_dir is None else results_dir / "tp_decode.jsonl")
    finally:
        destroy_tensor_parallel()


def _read_prompts(args, tokenizer) -> list[list[int]]:
    if args.prompt_ids:
        return args.prompt_ids
    if args.prompt_file:
        try:
            text = args.prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"--prompt-file {args.prompt_file}: cannot read it as UTF-8 text ({err})") from None
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines:
            raise ValueError(f"--prompt-file {args.prompt_file} holds no non-empty line")
        return [tokenizer.encode(line) for line in lines]
    return [tokenizer.encode(p) for p in (args.prompt or DEFAULT_PROMPTS)]


def generate(args, tokenizer) -> dict:
    """Run ``generate`` (text through ``tokenizer``) and return the JSON-ready result."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but torch sees no CUDA device")
    if args.memory_snapshot is not None and (args.profile is None or args.device != "cuda"):
        raise ValueError("--memory-snapshot needs --profile DIR and --device cuda")
    flags = [f for f, on in (("--profile-shapes", args.profile_shapes), ("--profile-stack", args.profile_stack),
                             ("--profile-memory", args.profile_memory),
                             ("--profile-steps", args.profile_steps is not None)) if on]
    if flags and args.profile is None:
        raise ValueError(f"{' '.join(flags)} needs --profile DIR")
    check_token_budget(args.max_num_batched_tokens, args.max_batch_size, args.block_size,
                       names=("--max-num-batched-tokens", "--max-batch-size", "--block-size"))
    if args.profile is not None:  # before the model loads, not when the trace is written
        if not args.profile:
            raise ValueError("--profile needs a directory, got ''")
        if os.path.exists(args.profile) and not os.path.isdir(args.profile):
            raise ValueError(f"--profile {args.profile}: exists and is not a directory")
        try:
            os.makedirs(args.profile, exist_ok=True)
        except OSError as err:
            raise ValueError(f"--profile {args.profile}: cannot create the directory ({err})") from None
    dtype = DTYPES[args.dtype or ("bfloat16" if args.device == "cuda" else "float32")]
    start = time.perf_counter()
    tp = None
    _check_world(args.tensor_parallel_size, "generate")
    if args.tensor_parallel_size > 1:
        tp = init_tensor_parallel(backend="nccl" if args.device == "cuda" else "gloo")
    if args.random_model:
        model = build_random_model(random_model_config(), seed=args.seed, dtype=dtype, device=args.device)
        if tp is not None:
            model = shard_model(model, tp)
    else:  # with tensor parallelism each rank reads only its slices of the checkpoint
        model = load_diffllama(args.model or DEFAULT_MODEL_DIR, dtype=dtype, device=args.device, tp=tp)
    load_seconds = time.perf_counter() - start
    prompts = _read_prompts(args, tokenizer)
    if args.calculate_kv_scales and args.kv_cache_dtype == "auto":
        raise ValueError("--calculate-kv-scales needs --kv-cache-dtype fp8 (or fp8_e4m3)")
    kv_scales = calibrate_kv_scales(model, prompts) if args.calculate_kv_scales else None
    params = SamplingParams(args.temperature, args.top_p, args.max_new_tokens)
    engine = Engine(model, block_size=args.block_size, num_blocks=args.num_blocks, compile=not args.no_compile,
                    max_num_seqs=args.max_batch_size, max_num_batched_tokens=args.max_num_batched_tokens,
                    enable_prefix_caching=not args.no_prefix_caching,
                    kv_cache_dtype=args.kv_cache_dtype, kv_scales=kv_scales,
                    cuda_graphs=args.device == "cuda" and not args.no_cuda_graphs,
                    async_decode=not args.no_async_decode)
    variants = compiled_variants()  # Triton kernels compiled so far (the engine warmed up)
    if args.profile is None:
        completions, timings = engine.generate(prompts, params, seed=args.seed)
        profile = None
    else:
        profiler = StepProfiler(args.profile, active=args.profile_steps or 8, memory_snapshot=args.memory_snapshot,
                                record_shapes=args.profile_shapes, with_stack=args.profile_stack,
                                profile_memory=args.profile_memory, device=args.device)
        with profiler:
            completions, timings = engine.generate(prompts, params, seed=args.seed, on_step=profiler.step)
        trace = profiler.written[-1]
        profile = {"trace": str(trace), "summary": summarize_trace(trace)}
    stats, capture, mixed = engine.compile_stats, engine.capture_stats, engine.runner.mixed_capture_stats
    return {
        "model": str(args.model) if args.model else f"random (seed {args.seed})" if args.random_model else "embedded-default",
        "device": args.device,
        "dtype": str(dtype).removeprefix("torch."),
        "kv_cache_dtype": str(engine.kv_cache_dtype).removeprefix("torch."),
        "completions": [
            {"prompt_ids": c.prompt_ids, "generated_ids": c.output_ids,
             "text": tokenizer.decode(c.output_ids), "finish_reason": c.finish_reason}
            for c in completions
        ],
        "timings": {
            "load_seconds": load_seconds,
            "prefill_tokens": timings.prefill_tokens,
            "prefill_seconds": timings.prefill_seconds,
            "prefill_tokens_per_s": timings.prefill_tokens_per_s,
            "decode_tokens": timings.decode_tokens,
            "decode_seconds": timings.decode_seconds,
            "decode_tokens_per_s": timings.decode_tokens_per_s,
            "overlapped_steps": timings.overlapped_steps,
            "compile_seconds": stats.compile_seconds if stats else 0.0,
            "warmup_seconds": engine.warmup_seconds,
            "jit_compiles": compiled_variants() - variants,
        },
        "compile": None if stats is None else {
            "graphs_compiled": stats.graphs_compiled,
            "graph_breaks": stats.graph_breaks,
            "recompiles": stats.recompiles,
        },
        "profile": None if profile is None else {
            "trace": profile["trace"],
            "phase_shares": profile["summary"].shares(),
            "decode_steps": profile["summary"].step_stats("decode").as_dict(),  # prefill steps apart
            "prefill_steps": profile["summary"].step_stats("prefill").as_dict(),
            "top_cpu_ops": profile["summary"].cpu_ops[:10],
            "top_kernels": profile["summary"].kernels[:10],
            "report": profile["summary"].format(),
        },
        "cuda_graphs": None if capture is None else {
            "captured_sizes": capture.sizes,
            "capture_seconds": capture.seconds,
            "graph_memory_bytes": capture.memory_bytes,
            "mixed_shapes": len(mixed.sizes) if mixed else 0,
            "mixed_capture_seconds": mixed.seconds if mixed else 0.0,
        },
    }


def _print_text(result: dict, prompts_text: list[str]) -> None:
    for i, c in enumerate(result["completions"]):
        print(f"[{i}] {prompts_text[i]!r} -> {c['text']!r} ({len(c['generated_ids'])} tokens, {c['finish_reason']})")
    t = result["timings"]
    print(f"prefill: {t['prefill_tokens']} tokens, {t['prefill_tokens_per_s']:.1f} tokens/s")
    print(f"decode:  {t['decode_tokens']} tokens, {t['decode_tokens_per_s']:.1f} tokens/s")
    print(f"warm-up: {t['warmup_seconds']:.1f} s before the first request")
    if result["compile"] is not None:
        c = result["compile"]
        print(f"compile: {t['compile_seconds']:.1f} s, {c['graphs_compiled']} graphs, "
              f"{c['graph_breaks']} graph breaks, {c['recompiles']} recompiles")
    if result["profile"] is not None:
        print(f"trace: {result['profile']['trace']}")
        print(result["profile"]["report"])
    if result["cuda_graphs"] is not None:
        g = result["cuda_graphs"]
        print(f"cuda graphs: {len(g['captured_sizes'])} sizes up to {max(g['captured_sizes'])}, "
              f"captured in {g['capture_seconds']:.1f} s, {g['graph_memory_bytes'] / 2**20:.0f} MiB; "
              f"{g['mixed_shapes']} mixed-step shapes in {g['mixed_capture_seconds']:.1f} s")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line; an unknown option is an error of its command's parser (its usage
    printed, not the top level's)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.command_parsers[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.command == "bench":
        try:
            if args.tensor_parallel_size > 1 or args.device == "cpu":
                _bench_tp(args)
                return 0
            from .benchmark import run_bench  # the harness stays off the library's import path

            table = run_bench(args.batch_sizes, args.prompt_len, args.new_tokens or 256, args.modes,
                              args.results_dir or Path("profiling/results"), kv_cache_dtype=args.kv_cache_dtype)
        except ValueError as err:
            print(f"compiled-attn: error: {err}", file=sys.stderr)
            return 2
        print(table)
        return 0
    if args.command == "profile-report":
        try:
            out = write_report(args.path, args.out, top=args.top, steps=args.timeline_steps)
        except (ValueError, OSError) as err:
            print(f"compiled-attn: error: {err}", file=sys.stderr)
            return 2
        print(f"report: {out}")
        return 0
    if args.command == "train":
        try:
            run_train_command(args)
        except (ValueError, FileNotFoundError) as err:
            print(f"compiled-attn: error: {err}", file=sys.stderr)
            return 2
        return 0
    try:
        tokenizer = load_tokenizer(args.model)
        result = generate(args, tokenizer)
    except (ValueError, FileNotFoundError, OutOfBlocksError) as err:
        print(f"compiled-attn: error: {err}", file=sys.stderr)
        return 2
    if get_tp_rank() != 0:  # every rank generated the same tokens: rank 0 prints them
        destroy_tensor_parallel()
        return 0
    if args.json:
        print(json.dumps(result))
    else:
        _print_text(result, [tokenizer.decode(c["prompt_ids"]) for c in result["completions"]])
    destroy_tensor_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
