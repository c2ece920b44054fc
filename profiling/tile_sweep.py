"""Sweep the attention kernel's tile configurations on a GPU (one call, printed table).

For each regime (plain/differential decode at two batch shapes, plain/differential
prefill), every candidate ``TileConfig`` (for decode, its ``programs_per_sm`` too, which
sets the flash-decoding splits) replaces the shape heuristic of
:mod:`compiled_attn.ops.triton_kernels.config`, is checked against the float64 reference
(relative L2 < 1e-2) and timed (decode: CUDA-graph replay; prefill: ``do_bench``;
medians). The current heuristic's choice is marked ``*``.

With ``--splits`` it sweeps the flash-decoding split count instead (default tiles, the
heuristic's count marked ``*``) over small-batch decode shapes; with ``--chunk-splits``
over mixed steps as the engine's graphs launch them (prefill chunks, decode rows and a
padding sequence; a block table as wide as a 16k ``max_model_len``); with ``--chunk-tiles``
the tiles and split counts of those mixed steps together.

    python profiling/tile_sweep.py [--splits | --chunk-splits | --chunk-tiles]
"""

from __future__ import annotations

import argparse
import itertools

import torch
from triton.testing import do_bench, do_bench_cudagraph

from compiled_attn.ops import reference, triton_kernels
from compiled_attn.ops.triton_kernels import attention, config

from bench_kernels import BLOCK as BLOCK_SIZE, D as HEAD_SIZE, DTYPE, HKV as NUM_KV_HEADS, HQ as NUM_HEADS, decode_inputs
from bench_kernels import unified_varlen

DEFAULT_TILES, DEFAULT_SPLITS = attention.choose_tiles, attention.choose_num_splits


def use(tiles=None):
    """Make the launcher use ``tiles`` (None: the heuristic's)."""
    attention.choose_tiles = DEFAULT_TILES if tiles is None else (lambda *a: tiles)


def relative_error(out, expected):
    return ((out.double() - expected).norm() / expected.norm()).item()


def sweep(name, run, check, expected, shape_args, candidates, graph):
    """Time ``run`` under each candidate; ``check()`` (a slice of the same output) must match
    ``expected``."""
    use()
    default = DEFAULT_TILES(*shape_args)
    rows = []
    for tiles in candidates:
        use(tiles)
        try:
            err = relative_error(check(), expected)
            ms = (do_bench_cudagraph(run, rep=50, return_mode="median") if graph
                  else do_bench(run, warmup=25, rep=100, return_mode="median"))
        except Exception as error:  # a candidate that does not compile or launch: report it
            rows.append((f" {tiles}", float("inf"), type(error).__name__))
            continue
        mark = "*" if tiles == default else " "
        rows.append((f"{mark}{tiles}", ms, f"err={err:.1e}" + (" BAD" if err > 1e-2 else "")))
    use()
    rows.sort(key=lambda r: r[1])
    print(f"\n== {name}")
    for label, ms, note in rows:
        print(f"{ms:8.4f} ms  {note:14s} {label}")


def decode_regime(batch, context, differential):
    args = decode_inputs(batch, context)
    lam = torch.rand(NUM_HEADS // 2, device="cuda") if differential else None
    expected = reference.paged_attention(*[a.double() if a.is_floating_point() else a for a in args],
                                         lam, HEAD_SIZE ** -0.5, True, -1, -1, 0.0, None)

    def run():
        return triton_kernels.paged_attention(*args, lam)
    tile_ns = (32, 64) if differential else (64, 128)
    candidates = [config.TileConfig(16, n, w, s, pps, stacked=differential) for n, w, s, pps in
                  itertools.product(tile_ns, (4, 8), (2, 3), (4, 8))
                  if w == 4 or n == 64]
    sweep(f"decode B={batch} ctx={context} {'differential' if differential else 'plain'}",
          run, run, expected, (batch, batch, 4, HEAD_SIZE, differential, DTYPE), candidates,
          graph=True)


def prefill_regime(differential):
    batch, seq = 8, 2048
    q = torch.randn(batch * seq, NUM_HEADS, HEAD_SIZE, dtype=DTYPE, device="cuda")
    k = torch.randn(batch * seq, NUM_KV_HEADS, HEAD_SIZE, dtype=DTYPE, device="cuda")
    v = torch.randn_like(k)
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * seq
    lam = torch.rand(NUM_HEADS // 2, device="cuda") if differential else None
    checked = 2 * seq  # the float64 reference covers the first two sequences
    expected = reference.varlen_attention(
        q[:checked].double(), k[:checked].double(), v[:checked].double(), cu[:3], cu[:3], lam,
        HEAD_SIZE ** -0.5, True, -1, -1, 0.0, None)

    def run():  # the unified kernel's tiles: not the Hopper prefill kernel the launcher routes D 128 to
        return unified_varlen(q, k, v, cu, cu, lam)
    if differential:
        shapes = [(64, 64, 8, 2), (64, 32, 8, 3), (64, 128, 8, 1), (128, 32, 8, 2), (32, 64, 4, 2)]
    else:
        shapes = [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (128, 64, 8, 4)]
    sweep(f"prefill B={batch} S={seq} {'differential' if differential else 'plain'}",
          run, lambda: run()[:checked], expected,
          (batch * seq, batch, 4, HEAD_SIZE, differential, DTYPE),
          [config.TileConfig(*shape, programs_per_sm=1) for shape in shapes], graph=False)


def split_regime(batch, context, differential):
    """Time every split count from 1 to ``config.MAX_SPLITS`` (powers of two) with the
    heuristic's tiles; ``*`` marks the heuristic's count."""
    args = decode_inputs(batch, context)
    lam = torch.rand(NUM_HEADS // 2, device="cuda") if differential else None
    chosen = attention.launch_plan(args[0], NUM_KV_HEADS, batch, args[5].shape[1] * BLOCK_SIZE,
                                   differential).num_splits
    rows = []
    for splits in sorted({2 ** i for i in range(7)} | {chosen}):
        ms = do_bench_cudagraph(lambda: triton_kernels.paged_attention(*args, lam, num_splits=splits),
                                rep=50, return_mode="median")
        rows.append((ms, f"{'*' if splits == chosen else ' '}splits={splits}"))
    kind = "differential" if differential else "plain"
    print(f"\n== splits, decode B={batch} ctx={context} {kind}")
    for ms, label in sorted(rows):
        print(f"{ms * 1e3:8.2f} us  {label}")


def chunk_inputs(rows: list[tuple[int, int]], table_width: int, head_size: int):
    """Paged inputs of a mixed step: ``rows`` of ``(cached keys, new tokens)``, a sequence
    with 0 keys for padding tokens, every block-table row ``table_width`` blocks wide."""
    blocks = max(len(rows) * table_width, 1)
    key_cache = torch.randn(blocks, BLOCK_SIZE, NUM_KV_HEADS, head_size, dtype=DTYPE, device="cuda")
    value_cache = torch.randn_like(key_cache)
    table = torch.randperm(blocks).to(device="cuda", dtype=torch.int32).view(len(rows), table_width)
    seq_lens = torch.tensor([c + n for c, n in rows], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0] + list(itertools.accumulate(n for _, n in rows)), dtype=torch.int32, device="cuda")
    query = torch.randn(int(cu[-1]), NUM_HEADS, head_size, dtype=DTYPE, device="cuda")
    return query, key_cache, value_cache, cu, seq_lens, table


def chunk_split_regime(name: str, rows: list[tuple[int, int]], table_width: int = 1024, head_size: int = 64):
    """Time split counts 1 to ``config.MAX_SPLITS`` (powers of two) of a differential mixed
    step (``chunk_inputs``); ``*`` marks the heuristic's count."""
    args = chunk_inputs(rows, table_width, head_size)
    lam = torch.rand(NUM_HEADS // 2, device="cuda")
    chosen = attention.launch_plan(args[0], NUM_KV_HEADS, len(rows), table_width * BLOCK_SIZE, True).num_splits
    expected = triton_kernels.paged_attention(*args, lam, num_splits=1).float()
    results = []
    for splits in sorted({2 ** i for i in range(7)} | {chosen}):
        out = triton_kernels.paged_attention(*args, lam, num_splits=splits)
        err = ((out.float() - expected).norm() / expected.norm()).item()
        ms = do_bench_cudagraph(lambda: triton_kernels.paged_attention(*args, lam, num_splits=splits),
                                rep=50, return_mode="median")
        results.append((ms, f"{'*' if splits == chosen else ' '}splits={splits} err={err:.0e}"))
    print(f"\n== splits, {name} (tokens {args[0].shape[0]}, seqs {len(rows)}, D {head_size})")
    for ms, label in sorted(results):
        print(f"{ms * 1e3:8.2f} us  {label}")


def chunk_tile_regime(name: str, rows: list[tuple[int, int]], table_width: int = 1024, head_size: int = 64):
    """Time tiles x split counts of a differential mixed step (``chunk_inputs``): query rows
    per program 16 to 128, three key-step shapes, 1 to 16 splits; ``*`` marks the
    heuristic's choice. Every output is checked against the float64 reference."""
    args = chunk_inputs(rows, table_width, head_size)
    lam = torch.rand(NUM_HEADS // 2, device="cuda")
    max_kv_len = table_width * BLOCK_SIZE
    plan = attention.launch_plan(args[0], NUM_KV_HEADS, len(rows), max_kv_len, True)
    expected = reference.paged_attention(*[a.double() if a.is_floating_point() else a for a in args],
                                         lam.double(), head_size ** -0.5, True, -1, -1, 0.0, None)
    results = []
    steps = ((64, 4, 3), (128, 8, 1), (32, 4, 3))
    for block_m, (tile_n, warps, stages), splits in itertools.product((16, 32, 64, 128), steps, (1, 2, 4, 8, 16)):
        tiles = config.TileConfig(block_m, tile_n, warps, stages, programs_per_sm=1)

        def run():
            return triton_kernels.paged_attention(*args, lam, num_splits=splits, tiles=tiles)
        try:
            err = relative_error(run(), expected)
            ms = do_bench_cudagraph(run, rep=30, return_mode="median")
        except Exception as error:  # a candidate that does not compile or launch: report it
            print(f"   {block_m}x{tile_n} w{warps} s{stages} splits={splits}: {type(error).__name__}")
            continue
        chosen = (block_m, tile_n, warps, stages, splits) == (
            plan.tiles.block_m, plan.tiles.tile_n, plan.tiles.num_warps, plan.tiles.num_stages, plan.num_splits)
        results.append((ms, f"{'*' if chosen else ' '}{block_m}x{tile_n} w{warps} s{stages} splits={splits} "
                            f"err={err:.0e}" + (" BAD" if err > 1e-2 else "")))
    err = relative_error(triton_kernels.paged_attention(*args, lam), expected)
    default = do_bench_cudagraph(lambda: triton_kernels.paged_attention(*args, lam), rep=30, return_mode="median")
    print(f"\n== tiles, {name} (tokens {args[0].shape[0]}, seqs {len(rows)}, D {head_size}); heuristic "
          f"{plan.tiles.block_m}x{plan.tiles.tile_n} w{plan.tiles.num_warps} s{plan.tiles.num_stages} "
          f"splits={plan.num_splits}: {default * 1e3:.2f} us err={err:.0e}" + (" BAD" if err > 1e-2 else ""))
    for ms, label in sorted(results)[:12]:
        print(f"{ms * 1e3:8.2f} us  {label}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splits", action="store_true", help="sweep split counts instead of tiles")
    parser.add_argument("--chunk-splits", action="store_true", help="sweep split counts of mixed steps")
    parser.add_argument("--chunk-tiles", action="store_true", help="sweep tiles and split counts of mixed steps")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}; Hq={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_SIZE} "
          f"block={BLOCK_SIZE} {DTYPE}")
    if args.chunk_tiles:
        chunk_tile_regime("prefix hit: 60 after 1024, padding", [(1024, 60), (0, 4)])
        chunk_tile_regime("no prefix: 60 tokens, padding", [(0, 60), (0, 4)])
        chunk_tile_regime("prefix hit + 2 decode rows", [(1024, 124), (1100, 1), (1100, 1), (0, 2)])
        chunk_tile_regime("prefix hit, 190 new + 6 decode rows", [(1024, 186), *[(1100, 1)] * 6])
        chunk_tile_regime("prefix hit + 2 decode rows, D 128", [(1024, 124), (1100, 1), (1100, 1), (0, 2)],
                          head_size=128)
        return
    if args.chunk_splits:
        chunk_split_regime("prefix hit: 60 after 1024, padding", [(1024, 60), (0, 4)])
        chunk_split_regime("no prefix: 60 tokens, padding", [(0, 60), (0, 4)])
        chunk_split_regime("prefix hit + 2 decode rows", [(1024, 124), (1100, 1), (1100, 1), (0, 2)])
        chunk_split_regime("chunk of 512 after 4096", [(4096, 512)])
        chunk_split_regime("chunk of 512 after 4096, table of 4608 keys", [(4096, 512)], table_width=288)
        chunk_split_regime("chunk of 512 after 8192 + 64 decode rows at 1k", [(8192, 512)] + [(1024, 1)] * 64
                           + [(0, 448)] + [(0, 0)] * 62)
        chunk_split_regime("prefill of 1100 + 4 decode rows", [(0, 1100), *[(1100, 1)] * 4, (0, 944)])
        return
    if args.splits:
        for batch, context in ((1, 1024), (1, 4096), (1, 16384), (16, 1024), (64, 1024)):
            for differential in (False, True):
                split_regime(batch, context, differential)
        return
    for differential in (False, True):
        decode_regime(8, 8192, differential)
        decode_regime(64, 2048, differential)
    for differential in (False, True):
        prefill_regime(differential)


if __name__ == "__main__":
    main()
