"""``compiled-attn bench``: decode-step latency of one model under several runtimes.

Runtimes, on the same weights, batch and lengths: ``eager`` (our engine, no compile),
``compiled`` (``torch.compile(fullgraph=True)``, no graphs), ``graphs`` (compiled + our
CUDA-graph runner), ``reduce-overhead`` (``torch.compile(mode="reduce-overhead")``:
Inductor's own CUDA graphs), and ``hf`` (Hugging Face ``DiffLlamaForCausalLM.generate``
with a static cache, which it compiles). A step's latency is decode wall time over decode
steps of a full generate call (prompt of ``prompt_len``, ``new_tokens`` generated).

Anchors measured in the same run: the *physical floor* of a step, (weight bytes + KV
bytes read) / device-to-device copy bandwidth (bytes read + written per second of a
2 GiB copy), and each runtime against ours. The table is appended to
``<results_dir>/decode.md`` and ``decode.jsonl``. ``kv_cache_dtype="fp8"`` runs our engine's
runtimes over an fp8 KV cache (the floor then counts one byte per cached element).

With the first batch size also the time to first token (one prompt of ``prompt_len``: its
prefill) of a fresh engine's first request and of a later one, and, where a flash-attn
library is found (:mod:`compiled_attn.ops.flash_backend`), the same with the flash-attn
backend off in the same process (``flash_backend.disabled()``: our Triton kernel;
:func:`flash_ttft_rows`).
"""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path

import torch

from .engine import Engine
from .kv_cache import resolve_kv_cache_dtype
from .models import DiffLlamaConfig, build_random_model, save_diffllama
from .ops import flash_backend
from .ops.arith import cdiv
from .profiler import StepProfiler, summarize_trace
from .results import ResultRow, write_results
from .sampling import SamplingParams

BENCH_CONFIG = DiffLlamaConfig(
    vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=16384,
    bos_token_id=None, eos_token_id=None,
)
"""About 1.1 B parameters: hidden 2048, 16 layers, 32 heads (16 pairs) of 64, 8 KV heads."""

ENGINE_MODES = {
    "eager": dict(compile=False, cuda_graphs=False),
    "compiled": dict(compile=True, cuda_graphs=False),
    "graphs": dict(compile=True, cuda_graphs=True),
    "reduce-overhead": dict(compile=True, cuda_graphs=False, compile_kwargs={"mode": "reduce-overhead"}),
}


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second of a 2 GiB device-to-device copy (median of 20)."""
    src = torch.randn(1 << 30, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    return 2 * (1 << 30) * 2 / sorted(times[5:])[len(times[5:]) // 2]


def floor_seconds(model, batch: int, mean_context: float, bandwidth: float,
                  kv_dtype: torch.dtype | None = None) -> float:
    """(weights read + KV read) / bandwidth for one decode step; the input embedding
    reads only ``batch`` rows, so its table is not counted (unless tied to the head).
    ``kv_dtype``: the cache's dtype (default the model's)."""
    config = model.config
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                  if n != "model.embed_tokens.weight" or config.tie_word_embeddings)
    kv = (batch * mean_context * model.num_cache_layers * 2 * config.num_key_value_heads
          * config.head_dim * (kv_dtype or next(model.parameters()).dtype).itemsize)
    return (weights + kv) / bandwidth


def _prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()


def time_engine(model, mode: str, batch: int, prompt_len: int, new_tokens: int, max_batch: int,
                profile_steps: int = 0, kv_cache_dtype: str = "auto") -> dict:
    """Decode-step latency of our engine in ``mode`` (over a ``kv_cache_dtype`` cache); with
    ``profile_steps`` also the device-busy fraction of that many profiled decode steps."""
    block_size = 16
    profile_tokens = profile_steps + 2  # the profiled decode steps, the skipped prefill step, one more
    max_len = prompt_len + max(new_tokens, profile_tokens) + 1
    blocks = batch * cdiv(max_len, block_size) + 1
    engine = Engine(model, max_model_len=max_len, block_size=block_size, num_blocks=blocks,
                    max_num_seqs=max_batch, kv_cache_dtype=kv_cache_dtype, **ENGINE_MODES[mode])
    engine.generate(_prompts(batch, 16, model.config.vocab_size, 1), SamplingParams(max_new_tokens=4))  # warm-up
    _, timings = engine.generate(_prompts(batch, prompt_len, model.config.vocab_size),
                                 SamplingParams(max_new_tokens=new_tokens))
    result = {"step_s": timings.decode_seconds / timings.decode_steps,
              "tokens_per_s": timings.decode_tokens_per_s, "capture": engine.capture_stats}
    if profile_steps:
        with tempfile.TemporaryDirectory() as trace_dir:
            profiler = StepProfiler(trace_dir, skip_first=1, active=profile_steps)  # decode steps only
            with profiler:
                engine.generate(_prompts(batch, prompt_len, model.config.vocab_size, 2),
                                SamplingParams(max_new_tokens=profile_tokens), on_step=profiler.step)
            summary = summarize_trace(profiler.trace_files()[-1])
        result["device_busy"] = summary.device_busy_us / summary.step_us
        result["kernels_us"] = [(name, us / summary.steps) for name, us in summary.kernels[:15]]
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return result


def time_first_request(model, prompt_len: int, kv_cache_dtype: str = "auto") -> dict:
    """Time to first token of a fresh engine's first request against a later one (same
    length, other tokens), and the engine's warm-up seconds before the first request."""
    engine = Engine(model, max_model_len=prompt_len + 8, max_num_seqs=8, kv_cache_dtype=kv_cache_dtype)
    ttft = []
    for seed in (3, 4):
        start = time.perf_counter()
        engine.generate(_prompts(1, prompt_len, model.config.vocab_size, seed), SamplingParams(max_new_tokens=1))
        ttft.append(time.perf_counter() - start)
    result = {"first_s": ttft[0], "later_s": ttft[1], "warmup_s": engine.warmup_seconds}
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return result


def flash_ttft_rows(model, prompt_len: int, kv_cache_dtype: str, flash_on: dict, log=print,
                    timer=time_first_request) -> list[ResultRow]:
    """Prefill/TTFT with and without flash-attn, in this process: ``flash_on`` (a
    :func:`time_first_request` result, the backend as configured) against a fresh engine
    with the backend off (:func:`flash_backend.disabled
    <compiled_attn.ops.flash_backend.disabled>`: our Triton kernel), first and later request.
    ``timer(model, prompt_len, kv_cache_dtype)`` times one engine. Empty (said once through
    ``log``) without a flash-attn library, or over an fp8 KV cache (prefills then read the
    cache through ``paged_attention`` on our kernel: flash-attn takes no fp8 cache here)."""
    library = flash_backend.find_library()
    if library is None:
        log("flash-attn: no library found (flash_attn.cute, flash_attn_interface, flash_attn) or "
            "COMPILED_ATTN_FLASH=0: no prefill/TTFT rows with and without flash-attn")
        return []
    if resolve_kv_cache_dtype(kv_cache_dtype, next(model.parameters()).dtype) == torch.float8_e4m3fn:
        log(f"flash-attn: {library.name} found, but prefills over an fp8 KV cache read it through "
            "paged_attention (our kernel): no prefill/TTFT rows with and without flash-attn")
        return []
    with flash_backend.disabled():
        off = timer(model, prompt_len, kv_cache_dtype)
    from .ops.triton_kernels.attention import prefill_kernel_serves

    hopper = prefill_kernel_serves(model.config.head_dim, next(model.parameters()))  # differential stays ours
    configured = "two calls" if flash_backend.FLASH_DIFFERENTIAL and not hopper else "on our fused kernel"
    name = f"{library.name} backend (differential {configured})"
    log(f"flash-attn off (our Triton kernel): TTFT first {off['first_s'] * 1e3:.1f} ms, "
        f"later {off['later_s'] * 1e3:.1f} ms")
    log(f"{name}: TTFT first {flash_on['first_s'] * 1e3:.1f} ms, later {flash_on['later_s'] * 1e3:.1f} ms")
    return [ResultRow(f"TTFT, prompt {prompt_len}, {request} request: {name}", "ms", flash_on[f"{request}_s"] * 1e3,
                      "flash-attn off (our Triton) ms", off[f"{request}_s"] * 1e3) for request in ("first", "later")]


def time_hf(model_dir: Path, batch: int, prompt_len: int, new_tokens: int, dtype) -> float:
    """Decode-step latency of transformers' DiffLlama ``generate`` with a static cache
    (compiled by transformers): (time of ``new_tokens`` - time of 1 token) / (new_tokens - 1)."""
    from transformers import DiffLlamaForCausalLM

    hf = DiffLlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    ids = torch.tensor(_prompts(batch, prompt_len, hf.config.vocab_size), device="cuda")

    def run(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                    cache_implementation="static", pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run(new_tokens)  # compiles
    run(1)
    full, one = run(new_tokens), run(1)
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return (full - one) / (new_tokens - 1)


def run_bench(batch_sizes=(1, 64), prompt_len: int = 512, new_tokens: int = 256,
              modes=("eager", "compiled", "graphs", "reduce-overhead", "hf"),
              results_dir: str | Path = "profiling/results", seed: int = 0,
              log=print, max_batch_size: int = 64, kv_cache_dtype: str = "auto") -> str:
    """Measure every mode at every batch size; append each batch size's rows as soon as
    they are measured and return the Markdown tables. A runtime that fails is logged and
    left out. Engines serve up to ``max(max_batch_size, *batch_sizes)`` rows (the graphs
    mode captures the default sizes up to that) over a ``kv_cache_dtype`` KV cache
    (``"auto"``: bfloat16; ``"fp8"``/``"fp8_e4m3"``: float8_e4m3fn, scales 1.0).

    Raises:
        ValueError: no CUDA device; an unknown ``kv_cache_dtype``.
    """
    if not torch.cuda.is_available():
        raise ValueError("compiled-attn bench needs a CUDA device")
    device = torch.device("cuda")
    dtype = torch.bfloat16
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
    bandwidth = copy_bandwidth(device)
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    with tempfile.TemporaryDirectory() as model_dir:
        model = build_random_model(BENCH_CONFIG, seed=seed, dtype=dtype, device=device)
        if "hf" in modes:
            save_diffllama(model, model_dir)
        tables = []
        for batch in batch_sizes:
            rows: list[ResultRow] = []
            step: dict[str, float] = {}
            floor = floor_seconds(model, batch, prompt_len + new_tokens / 2, bandwidth, kv_dtype)
            for mode in modes:
                started = time.perf_counter()
                try:
                    if mode == "hf":
                        step[mode] = time_hf(Path(model_dir), batch, prompt_len, new_tokens, dtype)
                    else:
                        res = time_engine(model, mode, batch, prompt_len, new_tokens,
                                          max(max_batch_size, *batch_sizes),
                                          profile_steps=16 if mode == "graphs" else 0,
                                          kv_cache_dtype=kv_cache_dtype)
                        step[mode] = res["step_s"]
                        if mode == "graphs":
                            for name, us in res["kernels_us"]:
                                log(f"  kernel {us:8.1f} us/step  {name[:110]}")
                            capture = res["capture"]
                            rows.append(ResultRow(f"B={batch} graphs", "device busy / step wall", res["device_busy"], "1", 1.0, ">= 0.9"))
                            if batch == batch_sizes[0]:
                                rows.append(ResultRow(f"capture {len(capture.sizes)} sizes <= {max(capture.sizes)} (x2 sampling variants)", "seconds", capture.seconds, "60 s", 60.0, "<= 1"))
                                rows.append(ResultRow("graph memory", "MiB", capture.memory_bytes / 2**20, "-", 1.0))
                except Exception as err:  # report and go on with the other runtimes
                    log(f"B={batch} {mode}: FAILED {type(err).__name__}: {str(err)[:300]}")
                    continue
                log(f"B={batch} {mode}: {step[mode] * 1e3:.3f} ms/step ({time.perf_counter() - started:.0f} s)")
            if batch == batch_sizes[0]:
                first = time_first_request(model, prompt_len, kv_cache_dtype)
                log(f"first request TTFT {first['first_s'] * 1e3:.1f} ms, later {first['later_s'] * 1e3:.1f} ms, "
                    f"warm-up {first['warmup_s']:.1f} s")
                rows.append(ResultRow(f"TTFT, prompt {prompt_len}, first request of a new engine", "ms",
                                      first["first_s"] * 1e3, "a later request", first["later_s"] * 1e3, "<= 1.5"))
                rows.append(ResultRow("engine warm-up before the first request", "seconds", first["warmup_s"], "-", 1.0))
                try:
                    rows += flash_ttft_rows(model, prompt_len, kv_cache_dtype, first, log)
                except Exception as err:  # report and keep the decode rows
                    log(f"TTFT with and without flash-attn: FAILED {type(err).__name__}: {str(err)[:300]}")
            rows += _ratios(batch, step, floor)
            tables.append(write_results(rows, results_dir, "decode", f"Decode step B={batch}, DiffLlama "
                                        f"~1.1B bf16, KV cache {str(kv_dtype).removeprefix('torch.')}, "
                                        f"prompt {prompt_len}, {new_tokens} new tokens, "
                                        f"copy {bandwidth / 1e12:.2f} TB/s"))
    return "".join(tables)


def _ratios(batch: int, step: dict[str, float], floor: float) -> list[ResultRow]:
    """Step times against the floor, and every other runtime against ours (``graphs``):
    ratio = their step time / ours, i.e. our speedup. Targets apply at B = 1 (reduce-overhead: every B)."""
    ours = step.get("graphs")
    rows = [ResultRow(f"B={batch} {mode}", "step ms", s * 1e3, "floor ms", floor * 1e3,
                      "<= 1.35" if mode == "graphs" and batch == 1 else "")
            for mode, s in step.items()]
    if ours is None:
        return rows
    targets = {"eager": (">= 3", ""), "compiled": ("<= 3", ""), "reduce-overhead": ("<= 1.3", "<= 1.3"),
               "hf": (">= 1.3", "")}
    for mode, (target_b1, target) in targets.items():
        if mode in step:
            rows.append(ResultRow(f"B={batch} {mode} / graphs", "step ms", step[mode] * 1e3, "graphs ms",
                                  ours * 1e3, target_b1 if batch == 1 else target))
    return rows
