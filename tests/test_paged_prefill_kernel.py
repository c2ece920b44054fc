"""The Hopper prefill kernel's paged path (``prefill_kernel.paged_prefill``) against the float64 oracle.

Without a GPU the kernel runs on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, set by ``conftest.py``) at small tiles, with q/out through TMA
descriptors and through pointers (K/V are pointer loads from the tile's cache blocks either
way); with a GPU the same cases run compiled. Every case draws fresh random inputs
(:func:`paged_batches.make_paged_batch`: blocks handed out in a random permutation, padding
columns of the block table holding other sequences' blocks), puts NaN in every cache slot
no sequence owns (a read past ``seq_len`` or from a wrong block fails), fills the output
with NaN (every element must be written) and compares with :func:`oracle.oracle_paged`.
Tiles are chosen so that a key tile spans several blocks (ids broadcast to rows), exactly
one block, or part of one. ``test_broken_variants_fail`` shows that these cases catch a
kernel that reads the wrong block or slot.
"""

from __future__ import annotations

import importlib

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed: these tests exercise Triton kernels")
import triton.language as tl  # noqa: E402

from oracle import assert_close_to_oracle, oracle_paged  # noqa: E402
from paged_batches import kernel_device, make_lambda, make_paged_batch, pad  # noqa: E402

from compiled_attn.ops.attention import output_shape  # noqa: E402
from compiled_attn.ops.triton_kernels import attention as attention_launchers  # noqa: E402
from compiled_attn.ops.triton_kernels.prefill import (  # noqa: E402
    PAGED_SWEEP_TILES,
    PAGED_TILES,
    PrefillTiles,
    covers_paged,
    paged_prefill,
)

# the kernel's module (the package's attribute ``prefill_kernel`` is the kernel itself)
kernel_module = importlib.import_module("compiled_attn.ops.triton_kernels.prefill_kernel")

DEVICE = kernel_device()
INTERPRETED = DEVICE == "cpu"

# (context_len, query_len): a length-1 sequence, query chunks longer than a query tile with
# partial last tiles and blocks, contexts that are and are not multiples of the block sizes,
# a prefill without context, unequal lengths throughout.
SEQS = [(0, 1), (37, 45), (32, 20), (5, 3), (64, 17), (0, 33), (100, 7)]
# BLOCK_N against the block size: several blocks a key tile, one, or part of one.
TILES = {"n64": PrefillTiles(16, 64, 4, 1), "n32": PrefillTiles(32, 32, 4, 1), "n16": PrefillTiles(16, 16, 4, 1),
         # the p v product of the previous key tile in flight during this one's softmax
         "n16-overlap": PrefillTiles(16, 16, 4, 1, overlap=True)}


def run(seqs, *, block_size=16, num_heads=4, num_kv_heads=2, head_size=16, dtype=torch.float32, lam=None,
        tiles=TILES["n64"], use_tma=None, seed=0, window=(-1, -1), **options):
    """Kernel vs oracle on a fresh batch: NaN in unowned cache slots, NaN-poisoned output."""
    batch = make_paged_batch(seqs, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_size=head_size, dtype=dtype, seed=seed, unused_fill="nan")
    args = [t.to(DEVICE) for t in batch.attention_args()]
    out = torch.full(output_shape(batch.query, lam is not None), float("nan"), dtype=dtype, device=DEVICE)
    if use_tma is None:  # interpreter: forced on; GPU: the launcher's own choice
        use_tma = True if INTERPRETED else None
    got = paged_prefill(*args, None if lam is None else lam.to(DEVICE), window_left=window[0],
                        window_right=window[1], out=out, tiles=tiles, use_tma=use_tma, **options)
    assert got is out
    expected = oracle_paged(*batch.attention_args(), lambda_full=lam, window=window, **options)
    assert_close_to_oracle(out, expected)
    if batch.pad_rows:
        assert bool((out[batch.pad_rows] == 0).all()), "padded rows (no key) must be exact zeros"


# Every pair of values of (tiles, block size, GQA group) meets in some case, not every triple
# (12 cases, not 36: the interpreter's time): tiles t and block size b take group (t + b) % 3.
BLOCK_SIZES, GROUPS = (16, 32, 64), (1, 4, 8)
PAIRWISE = [(tiles, block_size, GROUPS[(t + b) % 3]) for t, tiles in enumerate(TILES)
            for b, block_size in enumerate(BLOCK_SIZES)]


@pytest.mark.parametrize("tiles, block_size, group", PAIRWISE,
                         ids=[f"{tiles}-block{block}-gqa{group}" for tiles, block, group in PAIRWISE])
def test_causal_blocks_and_groups(group, block_size, tiles):
    run(SEQS, block_size=block_size, num_heads=group, num_kv_heads=1, tiles=TILES[tiles],
        seed=block_size + group + len(tiles))


@pytest.mark.parametrize("use_tma", [True, False] if INTERPRETED else [None, False],
                         ids=lambda t: "ptr" if t is False else "tma")
def test_padded_rows_and_empty_queries(use_tma):
    """Padded rows (``seq_len`` 0: zeros), sequences with no query this step, decode rows."""
    run([(20, 40), pad(3), (9, 0), (50, 1), (0, 18), pad(1)], block_size=16, num_heads=8, num_kv_heads=2,
        use_tma=use_tma, seed=3)


@pytest.mark.parametrize("kind", ["diff-scalar", "diff-pair", "diff-split", "diff-split-overlap", "diff-sequential",
                                  "diff-sequential-overlap"])
@pytest.mark.parametrize("block_size", [16, 64])
def test_differential(kind, block_size):
    lam = make_lambda(8, per_pair=kind != "diff-scalar", seed=len(kind))
    tiles = PrefillTiles(16, 32, 4, 1, value_split="split" in kind, overlap="overlap" in kind,
                         sequential="sequential" in kind)
    run(SEQS, block_size=block_size, num_heads=8, num_kv_heads=2, lam=lam, tiles=tiles, seed=block_size)


@pytest.mark.parametrize("window, causal", [((7, -1), True), ((40, -1), True), ((5, 3), False), ((-1, -1), False)],
                         ids=["left7", "left40", "both", "none-noncausal"])
def test_windows_and_softcap(window, causal):
    for tiles in (TILES["n64"], TILES["n16-overlap"]):
        run(SEQS, block_size=16, num_heads=4, num_kv_heads=2, window=window, causal=causal, softcap=3.0, scale=0.3,
            tiles=tiles, seed=sum(window) + 9)


@pytest.mark.parametrize("head_size", [64, 128])
def test_head_sizes_fp16(head_size):
    run([(40, 20), (0, 1), (17, 5)], block_size=16, num_heads=4, num_kv_heads=1, head_size=head_size,
        dtype=torch.float16, tiles=PrefillTiles(16, 32, 4, 1), seed=head_size)


def test_many_sequences():
    g = torch.Generator().manual_seed(5)
    seqs = [(int(torch.randint(0, 70, (), generator=g)), int(torch.randint(1, 40, (), generator=g)))
            for _ in range(10)]
    run(seqs, block_size=16, num_heads=2, num_kv_heads=1, seed=6)


@triton.jit
def _rows_first_block_only(table_row, start, keys_left, ROWS: tl.constexpr,
                           BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """Broken: every row of the tile in the tile's first block."""
    rows = tl.arange(0, ROWS)
    block = tl.load(table_row + start // BLOCK_SIZE).to(tl.int64)
    return tl.full([ROWS], 0, tl.int64) + block, (start + rows) % BLOCK_SIZE


@triton.jit
def _rows_block_order_reversed(table_row, start, keys_left, ROWS: tl.constexpr,
                               BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """Broken: the tile's blocks read in reverse order."""
    rows = tl.arange(0, ROWS)
    nth = (ROWS - 1 - rows) // BLOCK_SIZE
    block = tl.load(table_row + start // BLOCK_SIZE + nth, mask=rows < keys_left, other=0).to(tl.int64)
    return block, rows % BLOCK_SIZE


@pytest.mark.skipif(not INTERPRETED, reason="patches a jit helper the interpreter looks up at run time")
@pytest.mark.parametrize("broken", [_rows_first_block_only, _rows_block_order_reversed],
                         ids=["first-block-only", "blocks-reversed"])
def test_broken_variants_fail(broken, monkeypatch):
    """A kernel that gathers the wrong rows fails these comparisons (and the correct one,
    on the same batch, passes)."""
    run(SEQS, block_size=16, seed=21)
    monkeypatch.setattr(kernel_module, "_paged_rows", broken)
    with pytest.raises(AssertionError):
        run(SEQS, block_size=16, seed=21)


def test_covers_paged_and_routing_switch():
    """The predicate: fp16/bf16 caches of the query's dtype, Hopper head sizes, no ALiBi, a
    power-of-two block size, ``T >= block_m * B``; the op keeps the unified kernel until
    ``PAGED_PREFILL_KERNEL`` is flipped."""
    assert attention_launchers.PAGED_PREFILL_KERNEL == "unified"
    bf16 = dict(dtype=torch.bfloat16)
    block_m = PAGED_TILES[(128, False)].block_m
    cache = torch.empty(4, 16, 2, 128, **bf16)
    query = torch.empty(2 * block_m, 8, 128, **bf16)
    assert covers_paged(query, cache, cache, 2, None, None)
    assert covers_paged(query, cache, cache, 2, torch.tensor(0.5), None)  # differential D 128
    assert not covers_paged(query, cache, cache, 3, None, None)  # runs shorter than a query tile on average
    assert not covers_paged(query[:2], cache, cache, 2, None, None)  # a decode step
    assert not covers_paged(query, cache, cache, 2, None, torch.ones(8))  # ALiBi
    fp8 = cache.to(torch.float8_e4m3fn)
    assert not covers_paged(query, fp8, fp8, 2, None, None)  # float8 cache
    odd = torch.empty(4, 24, 2, 128, **bf16)
    assert not covers_paged(query, odd, odd, 2, None, None)  # block size not a power of two
    q96, c96 = torch.empty(2 * block_m, 8, 96, **bf16), torch.empty(4, 16, 2, 96, **bf16)
    assert not covers_paged(q96, c96, c96, 2, None, None)
    assert not covers_paged(query.float(), cache.float(), cache.float(), 2, None, None)
    assert set(PAGED_SWEEP_TILES) == set(PAGED_TILES)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="needs a CUDA GPU (sm90 for the TMA q/out)")
@pytest.mark.parametrize("tiles_from", ["default", "sweep"])
@pytest.mark.parametrize("head_size, differential", [(64, False), (128, False), (256, False), (64, True),
                                                     (128, True)])
def test_gpu_real_tiles(head_size, differential, tiles_from):
    """bf16 at :data:`PAGED_TILES` (and every alternative the benchmark sweeps), block 16 and
    64: chunks after cached prefixes longer than a tile, a single token, GQA 4
    (``pytest -m gpu tests/test_paged_prefill_kernel.py`` on the H200)."""
    key = (head_size, differential)
    every = (PAGED_TILES[key],) if tiles_from == "default" else PAGED_SWEEP_TILES[key]
    lam = make_lambda(8, per_pair=True, seed=head_size) if differential else None
    for block_size in (16, 64):
        batch = make_paged_batch([(300, 150), (0, 1), (129, 260), (1000, 129)], block_size=block_size,
                                 num_heads=8, num_kv_heads=2, head_size=head_size, dtype=torch.bfloat16,
                                 seed=head_size, unused_fill="nan")
        expected = oracle_paged(*batch.attention_args(), lambda_full=lam)  # once: the oracle is slow
        args = [t.to(DEVICE) for t in batch.attention_args()]
        for tiles in every:
            out = torch.full(expected.shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)
            paged_prefill(*args, None if lam is None else lam.to(DEVICE), out=out, tiles=tiles)
            assert_close_to_oracle(out, expected)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="needs a CUDA GPU")
def test_gpu_op_routes_when_switched(monkeypatch):
    """With ``PAGED_PREFILL_KERNEL = "hopper"`` the paged launcher gives the unified kernel's
    result through the prefill kernel for a covered call (the Gluon prefill kernel, which would
    take this plain call first, switched off: ``GLUON_PREFILL``)."""
    monkeypatch.setattr(attention_launchers, "GLUON_PREFILL", False)
    batch = make_paged_batch([(500, 200), (37, 300)], block_size=16, num_heads=8, num_kv_heads=2, head_size=128,
                             dtype=torch.bfloat16, seed=3)
    args = [t.to(DEVICE) for t in batch.attention_args()]
    assert covers_paged(args[0], args[1], args[2], 2, None, None)
    unified = attention_launchers.paged_attention(*args)
    monkeypatch.setattr(attention_launchers, "PAGED_PREFILL_KERNEL", "hopper")
    routed = attention_launchers.paged_attention(*args)
    torch.testing.assert_close(routed, unified, atol=2e-2, rtol=2e-2)
