"""Host time of one op call: our raw ops and public functions against torch's own calls.

A call's *host time* is what the launching thread spends per call in a loop of calls that
the device keeps up with (small shapes, no synchronization inside the loop); its *wall time*
adds the device time the loop waits for at the end. Anchors, measured in the same run on
the same inputs:

* ``paged_attention`` / ``varlen_attention`` (raw ``torch.ops.compiled_attn`` calls) against
  ``F.scaled_dot_product_attention`` on the same query/key/value counts, dense;
* ``fused_linear`` against ``torch.addmm`` of its residual, input and weight;
* ``reshape_and_cache`` against ``index_copy_`` of the same rows into the cache viewed as
  rows, once (one of key/value) and twice (both, what our op writes);
* the public ``paged_attention`` (shape checks and value checks) against the raw op: with
  its metadata unchanged since the last check (the layers of one forward), with the metadata
  bumped every call (a value check each call; the anchor then bumps too), and with
  ``COMPILED_ATTN_CHECK_VALUES=0``;
* (CUDA with flash-attn 4 installed) a raw ``varlen_attention`` call on the Gluon prefill
  route (16 sequences of 128-1024 tokens) against flash-attn 4's ``flash_attn_varlen_func``.

cProfile of raw ``paged_attention`` calls (and of the Gluon route) shows where the host time goes. bf16, Hq 32,
Hkv 8, D 128, block 16 on CUDA.

``--model`` adds the decode step of the ~1.1 B model of ``compiled-attn bench`` (forward to
logits, context 512, B=1 and B=64) as a user's ``torch.compile(model)`` runs it: static shapes
(Inductor launches our kernels; also with Inductor's C++ wrapper), a dynamic batch (the ops stay opaque, as in our engine),
``mode="reduce-overhead"``, and eager, against our runner's way (the dynamic compiled step
captured in a CUDA graph and replayed). Appends to ``<results-dir>/host.md`` and
``host.jsonl``.

    python profiling/bench_host.py [--results-dir profiling/results] [--device cuda] [--model] [--no-ops]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

import compiled_attn.ops as ops
from compiled_attn.ops import triton_kernels
from compiled_attn.results import ResultRow, write_results

HQ, HKV, D, BLOCK = 32, 8, 128, 16
RAW = torch.ops.compiled_attn


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fns: dict, device, calls: int = 200, repeats: int = 15) -> dict[str, tuple[float, float]]:
    """Median host and wall microseconds per call of each of ``fns`` over ``calls``
    back-to-back calls, the functions measured in turns (a slow spell of the machine hits
    all of them alike)."""
    for fn in fns.values():
        for _ in range(20):
            fn()
    host = {name: [] for name in fns}
    wall = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            launched = time.perf_counter()
            sync(device)
            done = time.perf_counter()
            host[name].append((launched - start) / calls * 1e6)
            wall[name].append((done - start) / calls * 1e6)
    return {name: (statistics.median(host[name]), statistics.median(wall[name])) for name in fns}


def decode_inputs(batch: int, context: int, device, dtype):
    g = torch.Generator().manual_seed(batch)
    blocks = batch * context // BLOCK
    key_cache = torch.randn(blocks, BLOCK, HKV, D, generator=g).to(device, dtype)
    value_cache = torch.randn(blocks, BLOCK, HKV, D, generator=g).to(device, dtype)
    table = torch.randperm(blocks, generator=g).to(device=device, dtype=torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
    query = torch.randn(batch, HQ, D, generator=g).to(device, dtype)
    return query, key_cache, value_cache, cu, seq_lens, table


def attention_rows(device, dtype) -> list[ResultRow]:
    rows = []
    query, key_cache, value_cache, cu, seq_lens, table = decode_inputs(1, 1024, device, dtype)
    lam = torch.tensor(0.5, device=device)
    scale = D ** -0.5
    args = (query, key_cache, value_cache, cu, seq_lens, table)
    q4 = query.view(1, 1, HQ, D).transpose(1, 2)
    k4 = key_cache.view(1, -1, HKV, D).transpose(1, 2)
    t = timed({"sdpa": lambda: F.scaled_dot_product_attention(q4, k4, k4, enable_gqa=True),
               "plain": lambda: RAW.paged_attention.default(*args, None, scale, True, -1, -1, 0.0, None, None),
               "diff": lambda: RAW.paged_attention.default(*args, lam, scale, True, -1, -1, 0.0, None, None)}, device)
    rows.append(ResultRow("paged_attention raw, decode B=1 ctx 1k", "host us/call", t["plain"][0], "SDPA (same q/k/v)",
                          t["sdpa"][0], "<= 1.2"))
    rows.append(ResultRow("paged_attention raw differential, B=1 ctx 1k", "host us/call", t["diff"][0],
                          "SDPA (same q/k/v)", t["sdpa"][0], "<= 1.2"))

    g = torch.Generator().manual_seed(5)
    q = torch.randn(256, HQ, D, generator=g).to(device, dtype)
    k = torch.randn(256, HKV, D, generator=g).to(device, dtype)
    cu_q = torch.tensor([0, 256], dtype=torch.int32, device=device)
    q4, k4 = q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2)
    t = timed({"sdpa": lambda: F.scaled_dot_product_attention(q4, k4, k4, is_causal=True, enable_gqa=True),
               "ours": lambda: RAW.varlen_attention.default(q, k, k, cu_q, cu_q, None, scale, True, -1, -1, 0.0, None,
                                                            None)}, device)
    rows.append(ResultRow("varlen_attention raw, prefill T=256", "host us/call", t["ours"][0],
                          "SDPA causal (same q/k/v)", t["sdpa"][0], "<= 1.2"))
    return rows


def linear_and_cache_rows(device, dtype) -> list[ResultRow]:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, 2048, generator=g).to(device, dtype)
    weight = torch.randn(2048, 2048, generator=g).to(device, dtype)
    residual = torch.randn(1, 2048, generator=g).to(device, dtype)
    t = timed({"addmm": lambda: torch.addmm(residual, x, weight.t()),
               "ours": lambda: RAW.fused_linear.default(x, weight, None, None, 1e-6, residual, False)}, device)
    rows = [ResultRow("fused_linear raw, 1 row 2048x2048 + residual", "host us/call", t["ours"][0], "torch.addmm",
                      t["addmm"][0], "<= 1.2")]

    key_cache = torch.randn(512, BLOCK, HKV, D, generator=g).to(device, dtype)
    value_cache = torch.randn_like(key_cache)
    for tokens in (1, 64):
        key = torch.randn(tokens, HKV, D, generator=g).to(device, dtype)
        slots = torch.randperm(512 * BLOCK, generator=g)[:tokens].to(device)
        rows_k, rows_v = key_cache.view(-1, HKV, D), value_cache.view(-1, HKV, D)
        t = timed({"one": lambda: rows_k.index_copy_(0, slots, key),
                   "both": lambda: (rows_k.index_copy_(0, slots, key), rows_v.index_copy_(0, slots, key)),
                   "ours": lambda: RAW.reshape_and_cache.default(key, key, key_cache, value_cache, slots)}, device)
        rows.append(ResultRow(f"reshape_and_cache raw, T={tokens}", "host us/call", t["ours"][0], "one index_copy_",
                              t["one"][0], "<= 1.2"))
        rows.append(ResultRow(f"reshape_and_cache raw, T={tokens}", "host us/call", t["ours"][0],
                              "index_copy_ of k and of v", t["both"][0]))
    return rows


def public_rows(device, dtype) -> list[ResultRow]:
    rows = []
    cases = ((1, 1024, "<= 1.3"), (256, 2048, "<= 1.15"))
    for batch, context, target in cases if device.type == "cuda" else cases[:1]:  # CPU: the small one
        args = decode_inputs(batch, context, device, dtype)
        seq_lens = args[4]

        def raw_call():
            return RAW.paged_attention.default(*args, None, D ** -0.5, True, -1, -1, 0.0, None, None)

        t = timed({"raw": raw_call, "public": lambda: ops.paged_attention(*args),
                   "bumped_raw": lambda: (seq_lens.add_(0), raw_call()),
                   "bumped": lambda: (seq_lens.add_(0), ops.paged_attention(*args))}, device)
        os.environ["COMPILED_ATTN_CHECK_VALUES"] = "0"
        t.update(timed({"unchecked": lambda: ops.paged_attention(*args)}, device))
        del os.environ["COMPILED_ATTN_CHECK_VALUES"]
        raw, public, bumped_raw, bumped, unchecked = (t[k] for k in ("raw", "public", "bumped_raw", "bumped", "unchecked"))
        case = f"public paged_attention B={batch} ctx {context}"
        rows.append(ResultRow(f"{case}, metadata checked before", "wall us/call", public[1], "raw op", raw[1], target))
        rows.append(ResultRow(f"{case}, metadata checked every call", "wall us/call", bumped[1],
                              "raw op + the same seq_lens bump", bumped_raw[1]))
        rows.append(ResultRow(f"{case}, COMPILED_ATTN_CHECK_VALUES=0", "wall us/call", unchecked[1], "raw op", raw[1]))
    return rows


def model_step_rows(device, dtype, batches=(1, 64), context: int = 512) -> list[ResultRow]:
    """Step time of the bench model's decode forward, per runtime (see the module docstring)."""
    from compiled_attn.benchmark import BENCH_CONFIG
    from compiled_attn.compile import CompiledFunction
    from compiled_attn.kv_cache import allocate_kv_caches
    from compiled_attn.metadata import SequenceChunk, build_metadata
    from compiled_attn.models import build_random_model

    config = BENCH_CONFIG
    model = build_random_model(config, seed=0, dtype=dtype, device=device)

    width = context // BLOCK + 1
    caches = allocate_kv_caches(model.num_cache_layers, max(batches) * width, BLOCK, config.num_key_value_heads,
                                config.head_dim, dtype, device)  # one cache for every batch size, as an engine

    def decode_batch(batch: int):
        tables = [list(range(b * width, (b + 1) * width)) for b in range(batch)]
        return build_metadata([SequenceChunk([1 + b], context - 1, t) for b, t in enumerate(tables)], BLOCK,
                              width, device)

    dynamic = CompiledFunction(model)
    dynamic(decode_batch(2), caches)  # traced at B=2 first, so that B=1 stays symbolic (as the engine's warm-up)
    rows = []
    for batch in batches:
        md = decode_batch(batch)
        static = torch.compile(model, fullgraph=True, dynamic=False)  # as a user's first call: static shapes
        overhead = torch.compile(model, fullgraph=True, dynamic=False, mode="reduce-overhead")
        cpp_wrapper = torch.compile(model, fullgraph=True, dynamic=False, options={"cpp_wrapper": True})
        md_dynamic = decode_batch(batch)  # its tensors get marked dynamic; md's stay static
        for fn, inputs in ((static, md), (overhead, md), (cpp_wrapper, md), (dynamic, md_dynamic)):
            for _ in range(3):
                fn(inputs, caches)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dynamic(md_dynamic, caches)
        t = timed({"graph": graph.replay, "static": lambda: static(md, caches),
                   "overhead": lambda: overhead(md, caches), "dynamic": lambda: dynamic(md_dynamic, caches),
                   "cpp_wrapper": lambda: cpp_wrapper(md, caches),
                   "eager": lambda: model(md, caches)}, device, calls=20, repeats=5)
        runner = t["graph"][1] / 1e3
        case = f"model decode step B={batch} ctx {context}"
        rows += [
            ResultRow(f"{case}, torch.compile(model) static shapes", "wall ms/step", t["static"][1] / 1e3,
                      "our runner (CUDA graph replay)", runner, "<= 3" if batch == 1 else ""),
            ResultRow(f"{case}, torch.compile(model, options=cpp_wrapper) static", "wall ms/step",
                      t["cpp_wrapper"][1] / 1e3, "our runner (CUDA graph replay)", runner, "<= 3" if batch == 1 else ""),
            ResultRow(f"{case}, torch.compile(model, mode=reduce-overhead) static", "wall ms/step",
                      t["overhead"][1] / 1e3, "our runner (CUDA graph replay)", runner, "<= 1.3"),
            ResultRow(f"{case}, torch.compile dynamic batch (ops opaque)", "wall ms/step", t["dynamic"][1] / 1e3,
                      "our runner (CUDA graph replay)", runner),
            ResultRow(f"{case}, eager", "wall ms/step", t["eager"][1] / 1e3, "our runner (CUDA graph replay)", runner),
        ]
        del graph, static, overhead, cpp_wrapper
        torch.cuda.empty_cache()
    return rows


def gluon_prefill_call(device, dtype):
    """A raw ``varlen_attention`` call the Gluon prefill kernel takes (the 16 causal sequences
    of 128-1024 tokens of ``bench_kernels.short_varlen_batch``; inside
    ``flash_backend.disabled()``), and flash-attn 4's ``flash_attn_varlen_func`` on the same
    q/k/v (``None`` without it)."""
    from bench_kernels import short_varlen_batch

    from compiled_attn.ops import flash_backend

    lens = short_varlen_batch()
    g = torch.Generator().manual_seed(6)
    q = torch.randn(sum(lens), HQ, D, generator=g).to(device, dtype)
    k, v = (torch.randn(sum(lens), HKV, D, generator=g).to(device, dtype) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)

    def ours():
        with flash_backend.disabled():
            return RAW.varlen_attention.default(q, k, v, cu, cu, None, D ** -0.5, True, -1, -1, 0.0, None, None)
    library = flash_backend.find_library()
    theirs = None
    if library is not None and library.name == "flash-attn 4":
        theirs = lambda: library.varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)  # noqa: E731
    return ours, theirs


def gluon_prefill_rows(ours, theirs, device) -> list[ResultRow]:
    """Host time of ``ours`` and ``theirs``, the calls of :func:`gluon_prefill_call`."""
    t = timed({"ours": ours, "fa4": theirs}, device)
    return [ResultRow("varlen_attention raw, prefill 16 seqs 128-1024 (Gluon route)", "host us/call", t["ours"][0],
                      "flash-attn 4 flash_attn_varlen_func", t["fa4"][0], "<= 1.0"),
            ResultRow("varlen_attention raw, prefill 16 seqs 128-1024 (Gluon route)", "wall us/call", t["ours"][1],
                      "flash-attn 4 flash_attn_varlen_func", t["fa4"][1], "<= 1.0")]


def profile(call) -> str:
    """cProfile of 2000 calls of ``call``: top functions by own time."""
    for _ in range(20):
        call()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(2000):
        call()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(14)
    return out.getvalue()


def profile_raw_call(device, dtype) -> str:
    """cProfile of 2000 raw paged_attention calls (decode B=1 ctx 1k): top functions by own time."""
    args = decode_inputs(1, 1024, device, dtype)
    report = profile(lambda: RAW.paged_attention.default(*args, None, D ** -0.5, True, -1, -1, 0.0, None, None))
    sync(device)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results-dir", default="profiling/results")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", action="store_true", help="add the model decode-step rows (CUDA)")
    parser.add_argument("--no-ops", dest="ops", action="store_false", help="leave out the per-op rows")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    if args.ops:
        rows += attention_rows(device, dtype) + linear_and_cache_rows(device, dtype) + public_rows(device, dtype)
        print(profile_raw_call(device, dtype))
        if device.type == "cuda" and triton_kernels.attention.GLUON_PREFILL:
            ours, theirs = gluon_prefill_call(device, dtype)
            if theirs is not None:  # flash-attn 4 installed
                rows += gluon_prefill_rows(ours, theirs, device)
                print("Gluon prefill route:\n" + profile(ours))
                sync(device)
    if args.model:
        rows += model_step_rows(device, dtype)
    print(write_results(rows, args.results_dir, "host", f"Host time per op call ({device.type}, {dtype})"))


if __name__ == "__main__":
    main()
