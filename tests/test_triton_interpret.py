"""The Triton kernels, called directly, against the float64 oracle.

Without a GPU the kernels run on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, set by ``conftest.py`` before Triton is imported), so shapes are
tiny and cases few; with a GPU the same cases run compiled on it. Every case draws fresh
random inputs (never zeros; cache slots that no sequence owns hold NaN, so a kernel that
reads past ``seq_len`` fails), fills the output with NaN before the launch (so every element
must be written) and compares with :mod:`oracle`; padded rows must be exact zeros.

bfloat16 runs only on a GPU: Triton's interpreter multiplies bfloat16 ``tl.dot`` operands as
their raw 16-bit integer storage (``triton/runtime/interpreter.py``, ``create_dot``).
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed: these tests exercise Triton kernels")

from oracle import assert_close_to_oracle, oracle_paged, oracle_varlen  # noqa: E402
from paged_batches import (  # noqa: E402
    alibi_slopes,
    make_lambda,
    make_paged_batch,
    make_varlen_batch,
    pad,
)

from compiled_attn.ops import triton_kernels  # noqa: E402
from compiled_attn.ops.attention import output_shape  # noqa: E402
from compiled_attn.ops.triton_kernels import attention as triton_attention  # noqa: E402
from compiled_attn.ops.triton_kernels.attention import launch_plan, split_buffers  # noqa: E402
from compiled_attn.ops.triton_kernels.merge_kernel import merge_block_v  # noqa: E402
from compiled_attn.ops.triton_kernels.config import (  # noqa: E402
    MAX_SPLITS,
    TileConfig,
    choose_num_splits,
    choose_tiles,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1 (tests/conftest.py sets it unless the "
                "environment overrides it)", allow_module_level=True)
if DEVICE == "cpu" and tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
    pytest.skip(f"Triton {triton.__version__}'s interpreter cannot use loaded scalars as loop "
                "bounds under NumPy 2 (TypeError in its tensor __index__; 3.6 fails, 3.9 works)",
                allow_module_level=True)

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])

# prefill, chunked prefill / prefix hit, decode, multi-token decode, a padded row, a sequence
# with no query this step, length-1 sequences; lengths leave partial last blocks.
MIXED = [(0, 20), (37, 5), (50, 1), pad(1), (3, 0), (16, 3), (0, 1), (9, 4), pad(2)]


def on_device(*tensors):
    return [None if t is None else t.to(DEVICE) for t in tensors]


def launcher_options(options: dict, tensor_scalars: bool = False) -> dict:
    """``options`` in the launchers' schema form: ``window_size`` as ``window_left`` and
    ``window_right``; with ``tensor_scalars``, ``scale`` (then required) and ``softcap``
    travel as the ``scale_softcap`` tensor and the floats get values that must be ignored."""
    launch = dict(options)
    launch["window_left"], launch["window_right"] = launch.pop("window_size", (-1, -1))
    if tensor_scalars:
        values = [launch.pop("scale"), launch.pop("softcap", 0.0)]
        launch.update(scale=123.0, softcap=0.0, scale_softcap=on_device(torch.tensor(values))[0])
    return launch


def run_paged(batch, lambda_full=None, num_splits=None, tensor_scalars=False, **options):
    """Kernel vs oracle on ``batch``; NaN-poisoned output; padded rows exact zeros."""
    args = on_device(*batch.attention_args())
    lam, slopes = on_device(lambda_full, options.pop("alibi_slopes", None))
    out = torch.full(output_shape(batch.query, lam is not None), float("nan"),
                     dtype=batch.dtype, device=DEVICE)
    got = triton_kernels.paged_attention(*args, lam, alibi_slopes=slopes, out=out,
                                         num_splits=num_splits, **launcher_options(options, tensor_scalars))
    assert got is out
    window = options.pop("window_size", (-1, -1))
    expected = oracle_paged(*batch.attention_args(), window=window, alibi_slopes=slopes,
                            lambda_full=lambda_full, **options)
    assert_close_to_oracle(out, expected)
    if batch.pad_rows:
        assert bool((out[batch.pad_rows] == 0).all()), "padded rows must be exact zeros"
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_size, block_size",
    [(4, 4, 32, 16), (4, 2, 40, 16), (6, 2, 24, 8), (8, 2, 64, 32), (8, 1, 16, 16)],
    ids=["gqa1", "gqa2-d40", "gqa3-d24-bs8", "gqa4-d64-bs32", "gqa8-d16"],
)
def test_paged_mixed_batch(dtype, num_heads, num_kv_heads, head_size, block_size):
    batch = make_paged_batch(MIXED, block_size=block_size, num_heads=num_heads,
                             num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype,
                             seed=head_size, unused_fill="nan")
    run_paged(batch)


def test_paged_many_sequences():
    """Many sequences whose query counts straddle tile boundaries (the binary search over
    ``cu_seqlens_q`` and the ``T // BLOCK_Q + B`` tile bound)."""
    g = torch.Generator().manual_seed(5)
    seqs = [(int(torch.randint(0, 40, (), generator=g)), int(torch.randint(1, 19, (), generator=g)))
            for _ in range(12)]
    batch = make_paged_batch(seqs, num_heads=2, num_kv_heads=2, head_size=16, seed=5,
                             unused_fill="nan")
    run_paged(batch)


@pytest.mark.parametrize(
    "seqs, window",
    [([(c, 1) for c in range(58, 70)], (3, -1)), ([(c, 3) for c in range(58, 70)], (-1, -1)),
     ([(c, 3) for c in range(127, 141)], (70, -1))],
    ids=["window-start", "causal-edge", "window-interior"],
)
def test_paged_key_tile_edges(seqs, window):
    """Visibility edges at every offset around a key-tile boundary (tiles of 64 keys here):
    the first key of a window, the causal diagonal of the first query of a tile, and the
    last tile whose keys every query of the tile sees (no mask) must all be exact."""
    batch = make_paged_batch(seqs, num_heads=4, num_kv_heads=2, head_size=32, seed=8,
                             unused_fill="nan")
    assert choose_tiles(batch.num_tokens, batch.num_seqs, 2, 32, False, torch.float32).tile_n == 64
    run_paged(batch, window_size=window)
    run_paged(batch, window_size=window, num_splits=3)


OPTIONS = {
    "window-left": dict(window_size=(8, -1)),
    "window-both-noncausal": dict(window_size=(4, 2), causal=False),
    "noncausal": dict(causal=False),
    "softcap": dict(softcap=2.0),
    "alibi": dict(alibi=True),
    "alibi-noncausal": dict(alibi=True, causal=False, window_size=(-1, 9)),
    "all": dict(window_size=(6, 0), softcap=3.0, alibi=True, scale=0.3),
}


@pytest.mark.parametrize("name", OPTIONS)
def test_paged_options(name):
    options = dict(OPTIONS[name])
    if options.pop("alibi", False):
        options["alibi_slopes"] = alibi_slopes(8)
    batch = make_paged_batch(MIXED, num_heads=8, num_kv_heads=2, head_size=32, seed=11,
                             unused_fill="nan", value_scale=2.0)
    run_paged(batch, **options)


@pytest.mark.parametrize("num_splits", [2, 7, 40])
@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
def test_paged_split_kv(num_splits, differential, monkeypatch):
    """Flash-decoding forced on: partials and log-sum-exp merged; 7 splits leave some
    splits without keys; the window leaves early splits of long rows empty too. 40 splits
    (64 padded) at head size 24 merge in value-column blocks of 32
    (``merge_block_v``), the last one part masked (value size 24 or 48). The split
    buffers start as NaN: splits without keys write no partial, and the merge must not
    read one."""
    def poisoned(shape, device):
        return tuple(buffer.fill_(float("nan")) for buffer in split_buffers(shape, device))

    monkeypatch.setattr(triton_attention, "split_buffers", poisoned)
    head_size = 24 if num_splits == 40 else 32
    if num_splits == 40:
        assert merge_block_v(64, 64) == 32
    batch = make_paged_batch([(70, 1), (5, 1), (40, 3), pad(1), (33, 0), (0, 2)],
                             num_heads=8, num_kv_heads=4, head_size=head_size, seed=num_splits,
                             unused_fill="nan")
    lam = make_lambda(8, per_pair=True) if differential else None
    run_paged(batch, lam, num_splits=num_splits)
    run_paged(batch, lam, num_splits=num_splits, window_size=(20, -1), softcap=4.0,
              alibi_slopes=alibi_slopes(8))


def test_paged_forced_tiles():
    """Tiles and splits forced through the launcher (``profiling/bench_kernels.py
    --fp8-sweep``): each forced configuration launches as given (a wider query tile, fewer
    keys a step, a register cap) and is exact."""
    batch = make_paged_batch([(70, 1), (5, 1), (40, 3), pad(1)], num_heads=8, num_kv_heads=4,
                             head_size=32, seed=21, unused_fill="nan")
    for tiles in (TileConfig(16, 16, 4, 3, 1, max_registers=128), TileConfig(32, 64, 4, 5, 1)):
        args = on_device(*batch.attention_args())
        out = triton_kernels.paged_attention(*args, tiles=tiles, num_splits=3)
        assert_close_to_oracle(out, oracle_paged(*batch.attention_args()))
        assert bool((out[batch.pad_rows] == 0).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("per_pair", [False, True], ids=["scalar-lambda", "per-pair-lambda"])
@pytest.mark.parametrize("num_kv_heads", [2, 4], ids=["pair-gqa4", "pair-gqa2"])
def test_differential_paged(dtype, per_pair, num_kv_heads):
    batch = make_paged_batch(MIXED, num_heads=8, num_kv_heads=num_kv_heads, head_size=32,
                             dtype=dtype, seed=21, unused_fill="nan")
    run_paged(batch, make_lambda(8, per_pair=per_pair))


def test_differential_paged_options():
    batch = make_paged_batch(MIXED, num_heads=4, num_kv_heads=2, head_size=24, seed=3,
                             unused_fill="nan", value_scale=2.0)
    run_paged(batch, make_lambda(4, per_pair=True), window_size=(7, -1), softcap=3.0,
              alibi_slopes=alibi_slopes(4))
    run_paged(batch, make_lambda(4, per_pair=False), causal=False, window_size=(3, 5))


# Decode rows, a padded row, a multi-token row longer than a stacked tile's 8 // pairs-per-KV-pair
# tokens, a row with no query: few query rows per sequence, so the differential tiles stack.
DECODE_ROWS = [(70, 1), (5, 1), (33, 1), pad(1), (0, 1), (17, 0), (1, 1)]
DECODE_MIX = DECODE_ROWS + [(40, 7)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 4), (8, 2), (16, 2)],
                         ids=["pair-gqa1", "pair-gqa2", "pair-gqa4", "pair-gqa8"])
@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "three-splits"])
def test_differential_stacked_decode(dtype, num_heads, num_kv_heads, num_splits):
    """Stacked q1/q2 rows (decode-shaped differential tiles) against the oracle, with and
    without flash-decoding, per-pair and scalar lambda, and with every option at once."""
    # 8 pairs per KV pair fill a stacked tile's 8 rows with one token: decode rows only
    seqs = DECODE_ROWS if num_heads // num_kv_heads == 8 else DECODE_MIX
    batch = make_paged_batch(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_size=32, dtype=dtype, seed=num_heads + num_splits,
                             unused_fill="nan", value_scale=2.0)
    group_pad = num_heads // num_kv_heads
    assert choose_tiles(batch.num_tokens, batch.num_seqs, group_pad, 32, True, dtype).stacked
    run_paged(batch, make_lambda(num_heads, per_pair=True), num_splits=num_splits)
    run_paged(batch, make_lambda(num_heads, per_pair=False), num_splits=num_splits,
              window_size=(9, -1), softcap=3.0, alibi_slopes=alibi_slopes(num_heads))


# Head sizes flash-attn accepts that are neither powers of two nor multiples of 8: the
# launchers pad them to HEAD_SIZE_PAD (128, 128, 16, 16) and the kernels mask every dim past D.
ODD_HEAD_SIZES = [72, 111, 3, 1]


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
@pytest.mark.parametrize("head_size", ODD_HEAD_SIZES)
def test_odd_head_size_paged(head_size, differential):
    """Mixed prefill (GQA; differential: two online-softmax states) and decode with forced
    splits, some empty (differential: stacked q1/q2 tiles, partials and merge of ``2D`` rows)."""
    lam = make_lambda(8, per_pair=True) if differential else None
    mixed = make_paged_batch([(0, 20), (13, 5), pad(1), (20, 1), (5, 0)], block_size=8, num_heads=8,
                             num_kv_heads=2, head_size=head_size, seed=head_size, unused_fill="nan")
    decode = make_paged_batch([(20, 1), (5, 1), pad(1), (0, 1)], block_size=8, num_heads=8, num_kv_heads=2,
                              head_size=head_size, seed=head_size + 1, unused_fill="nan")
    for batch, stacked in ((mixed, False), (decode, differential)):
        plan = launch_plan(batch.query, 2, batch.num_seqs, batch.block_table.shape[1] * 8, differential)
        assert plan.tiles.stacked == stacked
    run_paged(mixed, lam)
    run_paged(decode, lam, num_splits=3)
    run_paged(decode, lam, num_splits=3, window_size=(6, -1), softcap=3.0, alibi_slopes=alibi_slopes(8))


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
@pytest.mark.parametrize("head_size", ODD_HEAD_SIZES)
def test_odd_head_size_varlen(head_size, differential):
    """Varlen self- and cross-attention (a sequence with no keys) in float16."""
    batch = make_varlen_batch([5, 9, 2], [9, 9, 0], num_heads=4, num_kv_heads=2, head_size=head_size,
                              dtype=torch.float16, seed=head_size)
    lam = make_lambda(4, per_pair=False) if differential else None
    run_varlen(batch, lam)
    run_varlen(batch, lam, causal=False, window_size=(4, 3))


def test_stacking_is_for_decode_tiles_only():
    """Tiles stack q1 over q2 rows only when one component fills at most half of 16 rows."""
    def stacked(num_tokens, num_seqs, group_pad):
        return choose_tiles(num_tokens, num_seqs, group_pad, 128, True, torch.bfloat16).stacked

    assert stacked(64, 64, 4) and stacked(1, 1, 8) and stacked(16, 8, 2)
    assert not stacked(64, 64, 16) and not stacked(4096, 2, 4) and not stacked(24, 8, 4)
    assert not choose_tiles(64, 64, 4, 128, False, torch.bfloat16).stacked


def test_short_differential_chunks_take_pipelined_64_row_tiles():
    """Differential launches of at most SHORT_CHUNK_TOKENS tokens a sequence (a prefix hit's
    suffix beside decode rows) with heads of up to 64 take 64-row tiles of pipelined 64-key
    steps; long prefill, wider heads and plain launches keep the prefill tiles."""
    def tiles(num_tokens, num_seqs, differential=True, head_size_pad=64):
        return choose_tiles(num_tokens, num_seqs, 4, head_size_pad, differential, torch.bfloat16)

    for tokens, seqs in ((64, 2), (128, 4), (192, 7), (64 * 8, 8)):
        short = tiles(tokens, seqs)
        assert (short.block_m, short.tile_n, short.num_warps, short.num_stages) == (64, 64, 4, 3)
    wide = tiles(128, 4, head_size_pad=128)
    assert (wide.block_m, wide.tile_n, wide.num_stages) == (64, 128, 1)
    long = tiles(65 * 2, 2)
    assert (long.block_m, long.tile_n, long.num_stages) == (128, 128, 1)
    assert tiles(64, 2, differential=False).block_m == 128


def run_varlen(batch, lambda_full=None, tensor_scalars=False, **options):
    args = on_device(*batch.attention_args())
    (lam,) = on_device(lambda_full)
    out = torch.full(output_shape(batch.q, lam is not None), float("nan"), dtype=batch.dtype,
                     device=DEVICE)
    triton_kernels.varlen_attention(*args, lam, out=out, **launcher_options(options, tensor_scalars))
    window = options.pop("window_size", (-1, -1))
    expected = oracle_varlen(*batch.attention_args(), window=window, lambda_full=lambda_full,
                             **options)
    assert_close_to_oracle(out, expected)
    if batch.empty_rows:
        assert bool((out[batch.empty_rows] == 0).all()), "rows with no key must be exact zeros"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
def test_varlen(dtype, differential):
    """Self- and cross-attention (q_len != k_len, a sequence with no keys), causal
    (bottom-right aligned: early queries of a longer query run see nothing) and not."""
    batch = make_varlen_batch([5, 17, 3, 1, 9], [9, 17, 0, 4, 6], num_heads=4,
                              num_kv_heads=2, head_size=32, dtype=dtype, seed=7)
    lam = make_lambda(4, per_pair=True) if differential else None
    run_varlen(batch, lam)
    run_varlen(batch, lam, causal=False, window_size=(4, 3), softcap=5.0)


@pytest.mark.parametrize("softcap", [0.0, 3.0], ids=["no-softcap", "softcap"])
@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
def test_scale_softcap_from_a_tensor(differential, softcap):
    """Scale and softcap read from ``scale_softcap`` (traced per-call floats) give the
    oracle's result for those values, with and without splits; a softcap of 0 is off."""
    lam = make_lambda(4, per_pair=True) if differential else None
    batch = make_paged_batch([(0, 9), (30, 1), (5, 3)], num_heads=4, num_kv_heads=2, head_size=16, seed=21)
    run_paged(batch, lam, tensor_scalars=True, scale=0.3, softcap=softcap)
    run_paged(batch, lam, num_splits=3, tensor_scalars=True, scale=0.3, softcap=softcap, window_size=(6, -1))
    varlen = make_varlen_batch([5, 1, 7], [5, 3, 9], num_heads=4, num_kv_heads=2, head_size=16, seed=22)
    run_varlen(varlen, lam, tensor_scalars=True, scale=0.2, softcap=softcap, causal=False)


def test_varlen_tokens_past_the_last_sequence_are_left_alone():
    """Query tokens past ``cu_seqlens_q[B]`` (outside the op's contract, which its value checks
    enforce in eager calls) are never read as a sequence: their rows keep their NaN, the
    sequences' rows are right (the search stops at sequence ``B - 1``, never past the metadata)."""
    batch = make_varlen_batch([5, 19], [9, 19], num_heads=4, num_kv_heads=2, head_size=32, seed=41)
    q, k, v, cu_q, cu_k = batch.attention_args()
    out = torch.full((q.shape[0] + 40, 4, 32), float("nan"), device=DEVICE)
    args = on_device(torch.cat([q, torch.randn(40, 4, 32)]), k, v, cu_q, cu_k)
    triton_kernels.varlen_attention(*args, out=out)
    assert_close_to_oracle(out[:q.shape[0]], oracle_varlen(q, k, v, cu_q, cu_k))
    assert bool(out[q.shape[0]:].isnan().all()), "rows past the last sequence were written"


def test_varlen_matches_paged_cache_view():
    """A paged batch and its contiguous ``to_varlen`` view give the same rows."""
    batch = make_paged_batch([(0, 12), (20, 6), (7, 1)], num_heads=4, num_kv_heads=1,
                             head_size=16, seed=9)
    run_varlen(batch.to_varlen())


@pytest.mark.parametrize("head_size", [24, *ODD_HEAD_SIZES])
def test_reshape_and_cache(head_size):
    """New keys/values land in their slots; slot -1 (padded rows) writes nothing; every
    other cache element is untouched (bit-exact comparison of the whole caches)."""
    batch = make_paged_batch(MIXED, block_size=8, num_heads=4, num_kv_heads=2, head_size=head_size,
                             dtype=torch.float16, seed=13)
    assert (batch.slot_mapping == -1).any()
    key_cache, value_cache = on_device(*batch.caches_before_write())
    key, value, slots = on_device(batch.key, batch.value, batch.slot_mapping)
    triton_kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache.cpu(), batch.key_cache)
    assert torch.equal(value_cache.cpu(), batch.value_cache)


def test_reshape_and_cache_strided_input():
    """Key/value views of a fused projection (non-contiguous token stride)."""
    g = torch.Generator().manual_seed(17)
    fused = torch.randn(6, 3, 2, 16, generator=g)
    key, value = fused[:, 1], fused[:, 2]
    cache_k = torch.randn(3, 4, 2, 16, generator=g)
    cache_v = torch.randn(3, 4, 2, 16, generator=g)
    slots = torch.tensor([5, -1, 0, 11, -1, 7])
    expected_k, expected_v = cache_k.clone(), cache_v.clone()
    keep = slots >= 0
    expected_k.view(-1, 2, 16)[slots[keep]] = key[keep]
    expected_v.view(-1, 2, 16)[slots[keep]] = value[keep]
    cache_k, cache_v, key, value, slots = on_device(cache_k, cache_v, key, value, slots)
    triton_kernels.reshape_and_cache(key, value, cache_k, cache_v, slots)
    assert torch.equal(cache_k.cpu(), expected_k) and torch.equal(cache_v.cpu(), expected_v)


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as ``t`` in a view whose last dim has stride 2."""
    return torch.stack([t, torch.full_like(t, 7)], dim=-1)[..., 0]


def test_strided_metadata_reads_the_same_values():
    """Metadata views that are not dense (sliced from wider tensors) give the dense result:
    the launchers honour only query/key/value strides and make the rest dense."""
    batch = make_paged_batch(DECODE_MIX, num_heads=8, num_kv_heads=4, head_size=16, seed=4,
                             unused_fill="nan")
    query, key_cache, value_cache, cu, seq_lens, table = on_device(*batch.attention_args())
    lam, slopes = on_device(make_lambda(8, per_pair=True), alibi_slopes(8))
    dense = triton_kernels.paged_attention(query, key_cache, value_cache, cu, seq_lens, table, lam,
                                           alibi_slopes=slopes)
    views = [strided(t) for t in (cu, seq_lens, table, lam, slopes)]
    assert not any(v.is_contiguous() for v in views)
    got = triton_kernels.paged_attention(query, key_cache, value_cache, *views[:3], views[3],
                                         alibi_slopes=views[4])
    assert torch.equal(got, dense)

    key_cache, value_cache = on_device(*batch.caches_before_write())
    expected = (key_cache.clone(), value_cache.clone())
    key, value, slots = on_device(batch.key, batch.value, batch.slot_mapping)
    triton_kernels.reshape_and_cache(key, value, *expected, slots)
    triton_kernels.reshape_and_cache(key, value, key_cache, value_cache, strided(slots))
    for cache, want in zip((key_cache, value_cache), expected):  # bit-exact; unused slots NaN
        torch.testing.assert_close(cache, want, rtol=0, atol=0, equal_nan=True)


def test_split_heuristic_reads_shapes_only():
    """Few programs and long block tables split; full grids, short tables and query tiles
    of several tokens (beyond filling the multiprocessors) do not."""
    decode = dict(num_tokens=1, block_q=4, num_kv_units=8, programs_per_sm=8, num_sms=132)
    assert 8 < choose_num_splits(num_seqs=1, max_kv_len=32768, **decode) <= MAX_SPLITS
    assert choose_num_splits(num_seqs=1, max_kv_len=64, **decode) == 1
    # A lone sequence of 1024 keys: 8 programs on 132 multiprocessors split to 16 of 64 keys.
    assert choose_num_splits(num_seqs=1, max_kv_len=1024, **decode) == 16
    # 64 sequences fill the multiprocessors: splits only add whole waves in flight.
    assert choose_num_splits(num_seqs=64, max_kv_len=1024, **{**decode, "num_tokens": 64}) == 2
    assert choose_num_splits(num_seqs=256, num_tokens=256, block_q=4, num_kv_units=8,
                             max_kv_len=32768, programs_per_sm=4, num_sms=132) == 1
    # Query tiles of several tokens split only to fill the multiprocessors: 64 tokens in 2
    # sequences, 2 tiles x 4 KV pairs, a 16k key bound (the in-flight rule would pick 64).
    chunk = dict(num_seqs=2, num_tokens=64, block_q=32, num_kv_units=4, max_kv_len=16384, num_sms=132)
    assert choose_num_splits(programs_per_sm=4, **chunk) == 17
    assert choose_num_splits(programs_per_sm=4, **{**chunk, "num_tokens": 2048}) == 1
    tiles = choose_tiles(num_tokens=8, num_seqs=8, group_pad=4, head_size_pad=128,
                         differential=False, dtype=torch.bfloat16)
    assert tiles.block_m == 16  # decode: the smallest tl.dot tile
    tiles = choose_tiles(num_tokens=4096, num_seqs=2, group_pad=4, head_size_pad=128,
                         differential=False, dtype=torch.bfloat16)
    assert tiles.block_m == 128


def test_distinct_variants_keeps_the_first_launch_of_each_compiled_variant():
    """What the engine's warm-up launches: one (num_seqs, num_tokens) per kernel variant,
    the first in the given order, covering the variant of every candidate."""
    from compiled_attn.ops.triton_kernels.attention import _launch_plan, distinct_variants, kernel_variant

    candidates = [(b, b * n) for b in (1, 2, 3, 8, 17) for n in (1, 2, 3, 5, 9, 17, 33, 65, 300)]
    for differential in (False, True):
        chosen = distinct_variants(candidates, 8, 4, 32, differential, torch.float16, torch.device("cpu"))
        assert chosen[0] == (1, 1) and set(chosen) <= set(candidates)

        def variant(launch):
            b, t = launch
            return kernel_variant(_launch_plan(t, 8, 32, 4, b, t, differential, torch.float16, 1))

        variants = [variant(launch) for launch in chosen]
        assert len(set(variants)) == len(chosen) > 2  # tiles change with the query rows
        assert {variant(launch) for launch in candidates} == set(variants)
        first = {}
        for launch in candidates:
            first.setdefault(variant(launch), launch)
        assert chosen == list(first.values())
