"""The warp-specialized Gluon prefill kernel (``ops/triton_kernels/gluon_prefill_kernel.py``)
against the float64 oracle.

Gluon kernels do not run under Triton's interpreter, so without a GPU only two things run
here: :func:`test_compiles_for_sm90` compiles the kernel for sm90 (contiguous and paged,
D 64 and 128) down to a cubin with Triton's bundled ptxas, and the ``covers`` predicates
are checked on shapes. With an sm90 GPU (``pytest -m gpu``) every case draws fresh random
inputs at the kernel's real 128-row work tiles and 128-key steps, fills the output with
NaN (every element must be written), puts NaN in K/V rows past the last sequence and in
every cache slot no sequence owns (a value read there unmasked turns ``0 * NaN`` into NaN),
and compares with :mod:`oracle`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed: these tests exercise Triton kernels")

from oracle import assert_close_to_oracle, oracle_paged, oracle_varlen  # noqa: E402
from paged_batches import make_lambda, make_paged_batch, make_varlen_batch, pad  # noqa: E402

from compiled_attn.ops.attention import output_shape  # noqa: E402
from compiled_attn.ops.triton_kernels import gluon_prefill  # noqa: E402

ON_SM90 = (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
           and gluon_prefill.gluon_available())
gpu = pytest.mark.skipif(not ON_SM90, reason="needs an sm90 GPU (H100/H200) and Triton's Gluon")


# FlashAttention-3's schedules: intra-warpgroup overlap (its step's p v issued first or last, its
# key/value waits in the step or a step early), inter-warpgroup ping-pong, both; without flash-attn 4's
# lazy rescaling (the defaults have it)
SCHEDULES = {"overlap-pingpong": gluon_prefill.TILES, "plain": gluon_prefill.GluonTiles(),
             "scores-first": gluon_prefill.TILES._replace(values_first=False),
             "step-waits": gluon_prefill.TILES._replace(early_waits=False),
             "scores-first-step-waits": gluon_prefill.TILES._replace(values_first=False, early_waits=False),
             "overlap": gluon_prefill.GluonTiles(overlap=True),
             "pingpong": gluon_prefill.GluonTiles(pingpong=True),
             "n64-overlap-pingpong": gluon_prefill.GluonTiles(64, 64, 3, overlap=True, pingpong=True),
             "n64-s3": gluon_prefill.TILES._replace(block_n=64, stages=3),
             "dynamic": gluon_prefill.TILES._replace(dynamic=True),
             "eager-rescale": gluon_prefill.TILES._replace(lazy_rescale=False)}


def run_varlen(q_lens, k_lens=None, *, num_heads=8, num_kv_heads=2, head_size=128, dtype=torch.bfloat16,
               causal=True, window_right=-1, scale=None, seed=0, tiles=None, lam=None):
    """Kernel vs oracle (differential with ``lam``); NaN-poisoned output and NaN K/V rows past
    the last sequence."""
    batch = make_varlen_batch(q_lens, k_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                              dtype=dtype, seed=seed)
    q, k, v, cu_q, cu_k = batch.attention_args()
    nan = torch.full((130, num_kv_heads, head_size), float("nan"), dtype=dtype)  # a whole key tile past the end
    k_dev, v_dev = torch.cat([k, nan]).cuda(), torch.cat([v, nan]).cuda()
    out = torch.full(output_shape(q, lam is not None), float("nan"), dtype=dtype, device="cuda")
    lam_dev = None if lam is None else lam.cuda()
    assert gluon_prefill.covers(q.cuda(), k_dev, v_dev, lam_dev, scale, -1, 0.0, None, None)
    got = gluon_prefill.varlen_prefill(q.cuda(), k_dev, v_dev, cu_q.cuda(), cu_k.cuda(), lam_dev, scale=scale,
                                       causal=causal, window_right=window_right, out=out, tiles=tiles)
    assert got is out
    expected = oracle_varlen(q, k, v, cu_q, cu_k, scale=scale, causal=causal, window=(-1, window_right),
                             lambda_full=lam)
    assert_close_to_oracle(out, expected)
    if batch.empty_rows:
        assert bool((out[batch.empty_rows] == 0).all()), "rows with no key must be exact zeros"


def run_paged(seqs, *, block_size=16, num_heads=8, num_kv_heads=2, head_size=128, dtype=torch.bfloat16, causal=True,
              window_right=-1, scale=None, seed=0, tiles=None, lam=None):
    """Kernel vs oracle on a fresh paged batch (differential with ``lam``): NaN in unowned
    cache slots, NaN-poisoned output."""
    batch = make_paged_batch(seqs, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_size=head_size, dtype=dtype, seed=seed, unused_fill="nan")
    args = [t.cuda() for t in batch.attention_args()]
    out = torch.full(output_shape(batch.query, lam is not None), float("nan"), dtype=dtype, device="cuda")
    lam_dev = None if lam is None else lam.cuda()
    assert gluon_prefill.covers_paged(args[0], args[1], args[2], lam_dev, None, -1, 0.0, None, None)
    got = gluon_prefill.paged_prefill(*args, lam_dev, scale=scale, causal=causal, window_right=window_right, out=out,
                                      tiles=tiles)
    assert got is out
    assert_close_to_oracle(out, oracle_paged(*batch.attention_args(), scale=scale, causal=causal,
                                             window=(-1, window_right), lambda_full=lam))
    if batch.pad_rows:
        assert bool((out[batch.pad_rows] == 0).all()), "padded rows (no key) must be exact zeros"


# Query runs of one token, one short of a 64-row consumer half, a whole 128-row tile and one
# past it, several tiles with a partial last one; keys fewer than, as many as and more than
# the queries (causal bottom-right: early queries of a longer run see nothing), a sequence
# with no keys, key counts on and off the 128-key steps.
LENS_Q = [1, 63, 128, 129, 300, 7, 5]
LENS_K = [1, 63, 128, 200, 300, 0, 140]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_causal_varlen(head_size, dtype):
    run_varlen(LENS_Q, LENS_K, head_size=head_size, dtype=dtype, seed=head_size)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("schedule", list(SCHEDULES)[1:])
def test_schedules(schedule):
    """Each schedule on causal varlen (D 64 and 128), right windows, many sequences and paged
    blocks of 16."""
    tiles = SCHEDULES[schedule]
    run_varlen(LENS_Q, LENS_K, tiles=tiles, seed=1)
    run_varlen(LENS_Q, LENS_K, head_size=64, dtype=torch.float16, tiles=tiles, seed=2)
    run_varlen([200, 1, 129], [333, 77, 129], causal=False, window_right=37, scale=0.07, tiles=tiles, seed=3)
    g = torch.Generator().manual_seed(4)
    q_lens = [int(x) for x in torch.randint(1, 400, (24,), generator=g)]
    run_varlen(q_lens, [q + int(torch.randint(0, 150, (), generator=g)) for q in q_lens], num_heads=16,
               num_kv_heads=4, tiles=tiles, seed=5)
    run_paged([(0, 130), (1000, 300), (17, 1), (256, 128), (5, 200), pad(3), (33, 64)], tiles=tiles, seed=6)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("per_pair", [True, False], ids=["lambda-per-pair", "lambda-scalar"])
def test_differential(head_size, per_pair):
    """The fused differential schedule (components on the two consumers, ``o_2`` handed over
    in shared memory): causal varlen at the real tiles, GQA 4 (4 pairs on one KV pair), fp16,
    non-causal over whole key tiles, paged blocks of 16 and 64, and the real tiles without
    the two overlaps, with the other tile schedule (round-robin, the default being dynamic),
    with the other order of a step's two wgmma (``values_first``), with the key/value
    waits a step early (``early_waits``, varlen and paged) and with the other
    ``lazy_rescale`` (the default has it at D 128)."""
    lam = make_lambda(8, per_pair=per_pair, seed=head_size)
    run_varlen(LENS_Q, LENS_K, head_size=head_size, lam=lam, seed=head_size + per_pair)
    run_varlen([257, 64], [300, 64], num_heads=8, num_kv_heads=2, head_size=head_size, dtype=torch.float16, lam=lam,
               seed=3)
    run_varlen([128, 256, 1000], [128, 256, 1024], causal=False, head_size=head_size, lam=lam, seed=4)
    for block_size in (16, 64):
        run_paged([(0, 130), (1000, 300), (17, 1), (5, 200), pad(3), (33, 64)], block_size=block_size,
                  head_size=head_size, lam=lam, seed=block_size)
    tiles = gluon_prefill.DIFFERENTIAL_TILES[head_size]
    run_varlen(LENS_Q, LENS_K, head_size=head_size, lam=lam, seed=5,
               tiles=tiles._replace(overlap=False, pingpong=False))
    run_varlen(LENS_Q, LENS_K, head_size=head_size, lam=lam, seed=6, tiles=tiles._replace(dynamic=not tiles.dynamic))
    run_varlen(LENS_Q, LENS_K, head_size=head_size, lam=lam, seed=7,
               tiles=tiles._replace(values_first=not tiles.values_first))
    run_varlen(LENS_Q, LENS_K, head_size=head_size, lam=lam, seed=10,
               tiles=tiles._replace(lazy_rescale=not tiles.lazy_rescale))
    early = tiles._replace(early_waits=True)
    run_varlen(LENS_Q, LENS_K, head_size=head_size, lam=lam, seed=8, tiles=early)
    run_paged([(0, 130), (1000, 300), (17, 1), (5, 200), pad(3), (33, 64)], head_size=head_size, lam=lam, seed=9,
              tiles=early)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_lazy_rescale_large_scores(dtype):
    """Lazy rescaling (plain and differential) where row maxima move a lot: softmax scale 1
    (scores about 11 apart between a row's tiles, against the ``2^8`` threshold of 8 exponent
    units: some tiles move a row's maximum, others stay within it and raise ``p`` up to 256),
    varlen and paged, fp16 included (``p`` rounded to it)."""
    lazy = gluon_prefill.TILES._replace(lazy_rescale=True)
    run_varlen([1000, 129, 1], [1100, 300, 1], head_size=128, dtype=dtype, scale=1.0, tiles=lazy, seed=30)
    lam = make_lambda(8, per_pair=True, seed=31)
    run_varlen([1000, 129, 1], [1100, 300, 1], head_size=128, dtype=dtype, scale=1.0, lam=lam, seed=32,
               tiles=gluon_prefill.DIFFERENTIAL_TILES[128])
    run_paged([(700, 300), (5, 200)], dtype=dtype, scale=1.0, seed=33, tiles=lazy)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 2), (8, 1)], ids=["gqa1", "gqa4", "gqa8"])
def test_gqa(num_heads, num_kv_heads):
    run_varlen([257, 64], [300, 64], num_heads=num_heads, num_kv_heads=num_kv_heads, seed=num_heads + num_kv_heads)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (8, 2), (16, 2), (6, 2), (4, 4)],
                         ids=["gqa2", "gqa4", "gqa8", "gqa3", "gqa1"])
def test_pair_tails(num_heads, num_kv_heads):
    """Sequences whose last 128-row tile holds 1, 63, 64 or 65 rows, alone or after whole
    tiles, with and without a key prefix: pair tails (two query heads of a KV head, one a
    consumer: ``gluon_prefill_kernel._pair_tail``) at even query heads a KV head, whole (the
    TMA store) and partial (pointer stores); the unpaired tile at 65 rows and at odd ratios.
    Contiguous (round-robin and claimed) and paged."""
    q_lens = [1, 63, 64, 65, 129, 191, 192, 193]
    k_lens = [q + 40 * (i % 2) for i, q in enumerate(q_lens)]
    seed = 30 + num_heads + num_kv_heads
    for dynamic in (False, True):
        run_varlen(q_lens, k_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, seed=seed + dynamic,
                   tiles=gluon_prefill.TILES._replace(dynamic=dynamic))
    run_paged([(0, 64), (100, 63), (17, 192), (256, 1), (5, 65), (0, 129)], num_heads=num_heads,
              num_kv_heads=num_kv_heads, seed=seed + 2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("window_right", [-1, 0, 37], ids=["none", "w0", "w37"])
def test_noncausal(window_right):
    run_varlen([200, 1, 129], [333, 77, 129], causal=False, window_right=window_right, scale=0.07,
               seed=window_right + 10)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_noncausal_whole_key_tiles(schedule):
    """Non-causal over key counts that are multiples of the 128-key step: no tile of a row
    is masked (once wrong rows and a fault: the kernel now masks the first step anyway)."""
    run_varlen([128, 256, 2048, 1000], [128, 256, 2048, 1024], causal=False, num_heads=32, num_kv_heads=8,
               tiles=SCHEDULES[schedule], seed=21)


@gpu
@pytest.mark.gpu
def test_many_sequences():
    """Sequences straddling tile boundaries in number (the binary search, the ``Tq // 128 + B``
    bound, empty work tiles) and more work tiles than multiprocessors (the persistent loop)."""
    g = torch.Generator().manual_seed(5)
    q_lens = [int(x) for x in torch.randint(1, 400, (40,), generator=g)]
    k_lens = [q + int(torch.randint(0, 150, (), generator=g)) for q in q_lens]
    q_lens[3] = 0
    run_varlen(q_lens, k_lens, num_heads=16, num_kv_heads=4, seed=6)


@gpu
@pytest.mark.gpu
def test_one_unit_many_sequences():
    """One query head (one head pair, differential) over 300 short sequences, some empty:
    about 600 work tiles for 132 programs, whose consecutive tiles lie about 132 query tiles
    apart (claimed: both defaults take the dynamic schedule here) and skip one sequence or
    several, so the sequence a program keeps (``_locate``) is left on most of its tiles and
    found again as the one before (``_seek``'s first test) or by the binary search; also with
    the other ``early_waits`` of each (plain: the default has it, differential: not), plain
    then dealt round-robin (132 apart exactly)."""
    g = torch.Generator().manual_seed(11)
    q_lens = [int(x) for x in torch.randint(1, 300, (300,), generator=g)]
    q_lens[7] = q_lens[20] = q_lens[299] = 0
    k_lens = [q + int(torch.randint(0, 90, (), generator=g)) for q in q_lens]
    run_varlen(q_lens, k_lens, num_heads=1, num_kv_heads=1, seed=12)
    run_varlen(q_lens, k_lens, num_heads=2, num_kv_heads=2, lam=make_lambda(2, per_pair=True), seed=13)
    # early_waits on and off across a program's work tiles (a tile's last step waits for no next keys)
    run_varlen(q_lens, k_lens, num_heads=2, num_kv_heads=2, lam=make_lambda(2, per_pair=True), seed=14,
               tiles=gluon_prefill.DIFFERENTIAL_TILES[128]._replace(early_waits=True))
    run_varlen(q_lens, k_lens, num_heads=1, num_kv_heads=1, seed=15,
               tiles=gluon_prefill.TILES._replace(early_waits=False, dynamic=False))


@gpu
@pytest.mark.gpu
def test_strided_out():
    """An ``out`` whose token stride exceeds ``Hq * D`` (heads of a wider buffer): the TMA
    store of whole rows and the pointer stores of partial ones write its heads alone."""
    batch = make_varlen_batch([300, 129, 64], [300, 200, 64], num_heads=8, num_kv_heads=2, head_size=128,
                              dtype=torch.bfloat16, seed=14)
    q, k, v, cu_q, cu_k = batch.attention_args()
    wide = torch.full((q.shape[0], 10, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = gluon_prefill.varlen_prefill(q.cuda(), k.cuda(), v.cuda(), cu_q.cuda(), cu_k.cuda(), out=wide[:, :8])
    assert out.data_ptr() == wide.data_ptr()
    assert_close_to_oracle(out, oracle_varlen(q, k, v, cu_q, cu_k))
    assert bool(wide[:, 8:].isnan().all()), "heads past out's were written"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 64, 128, 256])
@pytest.mark.parametrize("head_size", [64, 128])
def test_paged(block_size, head_size):
    # chunks after contexts on and off block and tile boundaries, a prefill with no context,
    # a one-token decode row, a padded row (no keys)
    run_paged([(0, 130), (1000, 300), (17, 1), (256, 128), (5, 200), pad(3), (33, 64)], block_size=block_size,
              head_size=head_size, seed=block_size + head_size)


@gpu
@pytest.mark.gpu
def test_paged_noncausal_fp16():
    run_paged([(100, 150), (0, 7)], block_size=32, dtype=torch.float16, causal=False, seed=3)
    run_paged([(100, 150), (0, 7), (300, 129)], block_size=16, causal=False, window_right=21, seed=4)


def test_covers(monkeypatch):
    """Shapes, dtypes and options: fp16/bf16 at D 64/128 with a positive scale, plain or
    differential (even head counts), no softcap, left window or ALiBi, TMA-readable strides;
    paged: power-of-two blocks of 16 and up. On fake CUDA tensors of a pretended sm90 GPU (as
    ``torch.compile`` asks it: no address or value is read), so it runs without a GPU; never
    on the CPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q = torch.empty(8, 4, 128, dtype=torch.bfloat16)
    assert not gluon_prefill.covers(q, q[:, :2], q[:, :2], None, None, -1, 0.0, None, None)  # a CPU tensor
    monkeypatch.setattr(gluon_prefill, "is_hopper", lambda index: True)
    monkeypatch.setattr(gluon_prefill, "gluon_available", lambda: True)
    with FakeTensorMode():
        def tensors(heads=4, kv_heads=2, size=128, dtype=torch.bfloat16):
            return (torch.empty(8, heads, size, dtype=dtype, device="cuda"),
                    torch.empty(8, kv_heads, size, dtype=dtype, device="cuda"))

        q, kv = tensors()
        assert gluon_prefill.covers(q, kv, kv, None, None, -1, 0.0, None, None)
        assert gluon_prefill.covers(q, kv, kv, torch.ones(2, device="cuda"), None, -1, 0.0, None, None)
        for lam, scale, left, softcap, alibi, scalars in (
                (None, -0.1, -1, 0.0, None, None), (None, None, 5, 0.0, None, None),
                (None, None, -1, 3.0, None, None), (None, None, -1, 0.0, torch.ones(4, device="cuda"), None),
                (None, None, -1, 0.0, None, torch.ones(2, device="cuda"))):
            assert not gluon_prefill.covers(q, kv, kv, lam, scale, left, softcap, alibi, scalars)
        for q_bad, kv_bad in (tensors(size=96), tensors(dtype=torch.float32), tensors(size=256)):
            assert not gluon_prefill.covers(q_bad, kv_bad, kv_bad, None, None, -1, 0.0, None, None)
        q3, kv3 = tensors(heads=3, kv_heads=1)
        assert gluon_prefill.covers(q3, kv3, kv3, None, None, -1, 0.0, None, None)
        assert not gluon_prefill.covers(q3, kv3, kv3, torch.ones(1, device="cuda"), None, -1, 0.0, None, None)
        # (strided tensors made whole: views of fake CUDA tensors need a CUDA build)
        every_other_head = torch.empty_strided((8, 4, 128), (1024, 256, 1), dtype=torch.bfloat16, device="cuda")
        assert not gluon_prefill.covers(every_other_head, kv, kv, None, None, -1, 0.0, None, None)
        odd_rows = torch.empty_strided((8, 2, 128), (260, 128, 1), dtype=torch.bfloat16, device="cuda")
        assert not gluon_prefill.covers(q, odd_rows, kv, None, None, -1, 0.0, None, None)  # rows not 16-byte apart
        _, v64 = tensors(size=64)
        assert not gluon_prefill.covers(q, kv, v64, None, None, -1, 0.0, None, None)  # v's head size
        assert not gluon_prefill.covers(q, kv, odd_rows, None, None, -1, 0.0, None, None)  # v's rows
        _, v16 = tensors(dtype=torch.float16)
        assert not gluon_prefill.covers(q, kv, v16, None, None, -1, 0.0, None, None)  # v's dtype
        q6, kv4 = tensors(heads=6, kv_heads=4)
        assert not gluon_prefill.covers(q6, kv4, kv4, None, None, -1, 0.0, None, None)  # no whole GQA groups
        broadcast = torch.empty_strided((8, 2, 128), (0, 128, 1), dtype=torch.bfloat16, device="cuda")
        assert not gluon_prefill.covers(q, broadcast, kv, None, None, -1, 0.0, None, None)  # rows overlap
        # one row: any 16-byte multiple apart (a contiguous [1, H, D] made by a transpose)
        one_row = torch.empty_strided((1, 4, 128), (128, 128, 1), dtype=torch.bfloat16, device="cuda")
        assert gluon_prefill.covers(one_row, kv, kv, None, None, -1, 0.0, None, None)
        assert not gluon_prefill.covers(q, kv, torch.empty(4, 2, 128, dtype=torch.bfloat16, device="cuda"), None,
                                        None, -1, 0.0, None, None)  # v not shaped as k
        no_heads = torch.empty(8, 0, 128, dtype=torch.bfloat16, device="cuda")
        assert not gluon_prefill.covers(q, no_heads, no_heads, None, None, -1, 0.0, None, None)
        half_blocks = torch.empty_strided((2, 16, 2, 128), (32 * 256, 256, 128, 1), dtype=torch.bfloat16,
                                          device="cuda")  # the first 16 rows of blocks of 32
        assert not gluon_prefill.covers_paged(q, half_blocks, half_blocks, None, None, -1, 0.0, None, None)
        for block_size, expected in ((8, False), (16, True), (48, False), (256, True)):
            cache = torch.empty(32, block_size, 2, 128, dtype=torch.bfloat16, device="cuda")
            assert gluon_prefill.covers_paged(q, cache, cache, None, None, -1, 0.0, None, None) is expected


def test_paged_calls_of_a_query_tile_a_sequence_take_this_kernel(monkeypatch):
    """``attention.gluon_takes_paged`` (shapes alone, the cache covered): a paged call of at
    least one work tile of queries (128 rows) a sequence takes this kernel; fewer (a decode
    step, a batch of mostly decode rows) stays on the unified kernel, as does every call
    with ``GLUON_PREFILL`` off and a differential one with ``GLUON_DIFFERENTIAL`` off."""
    from compiled_attn.ops.triton_kernels import attention

    monkeypatch.setattr(gluon_prefill, "covers_paged", lambda *args: True)
    cache, table = torch.empty(4, 16, 2, 128, dtype=torch.bfloat16), torch.zeros(3, 4, dtype=torch.int32)
    lens, cu = torch.zeros(3, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    for tokens, expected in ((384, True), (383, False), (3, False)):
        q = torch.empty(tokens, 4, 128, dtype=torch.bfloat16)
        assert attention.gluon_takes_paged(q, cache, cache, cu, lens, table) is expected, tokens
    q = torch.empty(384, 4, 128, dtype=torch.bfloat16)
    assert attention.gluon_takes_paged(q, cache, cache, cu, lens, table, torch.ones(2))
    monkeypatch.setattr(attention, "GLUON_DIFFERENTIAL", False)
    assert attention.gluon_takes_paged(q, cache, cache, cu, lens, table)
    assert not attention.gluon_takes_paged(q, cache, cache, cu, lens, table, torch.ones(2))
    monkeypatch.setattr(attention, "GLUON_PREFILL", False)
    assert not attention.gluon_takes_paged(q, cache, cache, cu, lens, table)


def test_default_tiles_pass_the_tile_checks(monkeypatch):
    """The tiles a launch takes when it names none (:func:`gluon_prefill.default_tiles`, claimed
    or dealt, plain, paged or differential, at every head size) pass the checks that named
    tiles must (``_validate_tiles``), which the ops' path (``gluon_prefill.launch``) skips."""
    monkeypatch.setattr(gluon_prefill, "multiprocessor_count", lambda device: 132)
    taken = set()
    for head_size in gluon_prefill.HEAD_SIZES:
        for tokens in (128, 1 << 20):
            q = torch.empty(1, 8, head_size, dtype=torch.bfloat16).expand(tokens, 8, head_size)
            for differential, paged in ((False, False), (False, True), (True, False), (True, True)):
                tiles = gluon_prefill.default_tiles(q, 2, differential, paged)
                gluon_prefill._validate_tiles(tiles, head_size, differential)
                taken.add(tiles)
    assert len(taken) >= 4  # plain claimed and dealt, paged, differential at each head size


@pytest.mark.skipif(not gluon_prefill.gluon_available(), reason="this Triton has no Gluon warp specialization")
def test_default_tiles_claim_when_work_is_few_waves(monkeypatch):
    """With no tiles named, a plain varlen launch of fewer than ``DYNAMIC_MAX_WAVES`` waves
    of work tiles (``Hq * (Tq // 128 + B)`` over 132 programs) claims its tiles (``DYNAMIC``),
    one of more is dealt round-robin; paged launches are dealt round-robin without early
    waits, differential ones take the differential tiles (dynamic); lazy rescaling in all
    of them at D 128. The launches run on CPU tensors (taken for an sm90 GPU's), recorded
    instead of made."""
    launches = []
    monkeypatch.setattr(gluon_prefill, "_run", lambda grid, args, constexprs: launches.append(constexprs))
    monkeypatch.setattr(gluon_prefill, "_on_sm90", lambda tensor: True)
    monkeypatch.setattr(gluon_prefill, "multiprocessor_count", lambda device: 132)
    kv = torch.randn(64, 2, 128).to(torch.bfloat16)

    def plain(tokens, seqs, heads):
        q = torch.empty(tokens, heads, 128, dtype=torch.bfloat16)
        keys = torch.empty(tokens, 2, 128, dtype=torch.bfloat16)
        cu = torch.linspace(0, tokens, seqs + 1).to(torch.int32)
        gluon_prefill.varlen_prefill(q, keys, keys, cu, cu)
        return launches[-1]["DYNAMIC"], launches[-1]["EARLY_WAITS"]

    waves = gluon_prefill.DYNAMIC_MAX_WAVES
    # work tiles: heads * (tokens // 128 + seqs); one query tile (8 work tiles) short of the bound, then on it
    assert plain(128 * (waves * 132 // 8 - 2) - 1, 2, 8) == (True, True)
    assert plain(128 * (waves * 132 // 8 - 2), 2, 8) == (False, True)
    assert plain(128, 1, 32) == (True, True)
    q = torch.randn(256, 8, 128).to(torch.bfloat16)
    cache = torch.randn(8, 16, 2, 128).to(torch.bfloat16)
    cu, lens, table = (torch.tensor(x, dtype=torch.int32) for x in ([0, 256], [100], [[0, 1, 2, 3, 4, 5, 6]]))
    gluon_prefill.paged_prefill(q, cache, cache, cu, lens, table)
    assert (launches[-1]["DYNAMIC"], launches[-1]["EARLY_WAITS"]) == (False, False)
    gluon_prefill.varlen_prefill(q, kv, kv, cu, torch.tensor([0, 64], dtype=torch.int32), torch.ones(4))
    assert launches[-1]["DYNAMIC"] and launches[-1]["BLOCK_N"] == gluon_prefill.DIFFERENTIAL_TILES[128].block_n
    assert len(launches) == 5 and all(launch["LAZY_RESCALE"] for launch in launches)


@pytest.mark.skipif(not gluon_prefill.gluon_available(), reason="this Triton has no Gluon warp specialization")
def test_compiles_for_sm90():
    """The kernel lowers to a cubin for sm90 (plain contiguous and paged at blocks 16/64/256,
    D 64 and 128; differential contiguous and paged; the other ``early_waits`` of plain
    contiguous, plain paged and differential) within 227 KiB of shared memory, its wgmma not
    serialized by ptxas and with at most small register spills (``tests/compile_sm90.py
    gluon``, no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_sm90.py")
    done = subprocess.run([sys.executable, str(script), "gluon"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report) == 13
    for row in report:
        assert 0 < row["shared"] <= gluon_prefill.SHARED_MEMORY, row
        assert not row["wgmma_serialized"], row
        # what ptxas counts as spills here is reloaded outside the key steps' loops (once a
        # work tile or a program): Triton 3.6 up to 24 / 24 bytes (differential paged), 3.9 up
        # to 28 / 44 (plain paged); the producer's key loop at 40 registers spilled up to 96 / 128
        assert row["spill_stores"] <= 40 and row["spill_loads"] <= 48, row


def _count_calls(monkeypatch, kind: str) -> list:
    """Record each launch of this kernel that the ops make (``gluon_prefill.launch``, reached
    through its module) over contiguous K/V (``kind`` ``"varlen"``) or a paged cache
    (``"paged"``: a ``block_table`` given)."""
    calls, launch = [], gluon_prefill.launch

    def record(*a):
        if (a[5] is not None) == (kind == "paged"):
            calls.append(a)
        return launch(*a)
    monkeypatch.setattr(gluon_prefill, "launch", record)
    return calls


@gpu
@pytest.mark.gpu
def test_op_routes_prefill_here(monkeypatch):
    """The ops (through the dispatcher) run covered varlen prefill, plain and differential,
    and prefill-heavy paged calls (``T >= 128 B``) on this kernel, with the oracle's result;
    a decode batch, differential calls with ``GLUON_DIFFERENTIAL`` off and every call with
    ``GLUON_PREFILL`` off go elsewhere."""
    import compiled_attn.ops as ops
    from compiled_attn.ops.triton_kernels import attention

    varlen_calls, paged_calls = _count_calls(monkeypatch, "varlen"), _count_calls(monkeypatch, "paged")
    batch = make_varlen_batch([300, 17], [300, 40], num_heads=8, num_kv_heads=2, head_size=128, dtype=torch.bfloat16,
                              seed=7)
    args = [t.cuda() for t in batch.attention_args()]
    assert_close_to_oracle(ops.varlen_attention(*args), oracle_varlen(*batch.attention_args()))
    assert len(varlen_calls) == 1
    lam = make_lambda(8, per_pair=True)
    assert_close_to_oracle(ops.varlen_attention(*args, lam.cuda()),
                           oracle_varlen(*batch.attention_args(), lambda_full=lam))
    assert len(varlen_calls) == 2
    monkeypatch.setattr(attention, "GLUON_DIFFERENTIAL", False)
    ops.varlen_attention(*args, lam.cuda())
    assert len(varlen_calls) == 2
    monkeypatch.setattr(attention, "GLUON_DIFFERENTIAL", True)
    monkeypatch.setattr(attention, "GLUON_PREFILL", False)
    ops.varlen_attention(*args)
    ops.varlen_attention(*args, lam.cuda())
    assert len(varlen_calls) == 2
    monkeypatch.setattr(attention, "GLUON_PREFILL", True)
    prefill = make_paged_batch([(100, 300), (0, 200)], num_heads=8, num_kv_heads=2, head_size=128,
                               dtype=torch.bfloat16, seed=8, unused_fill="nan")
    got = ops.paged_attention(*[t.cuda() for t in prefill.attention_args()])
    assert_close_to_oracle(got, oracle_paged(*prefill.attention_args()))
    got = ops.paged_attention(*[t.cuda() for t in prefill.attention_args()], lam.cuda())
    assert_close_to_oracle(got, oracle_paged(*prefill.attention_args(), lambda_full=lam))
    monkeypatch.setattr(attention, "GLUON_DIFFERENTIAL", False)
    got = ops.paged_attention(*[t.cuda() for t in prefill.attention_args()], lam.cuda())
    assert_close_to_oracle(got, oracle_paged(*prefill.attention_args(), lambda_full=lam))
    decode = make_paged_batch([(100, 1), (300, 2)], num_heads=8, num_kv_heads=2, head_size=128,
                              dtype=torch.bfloat16, seed=9, unused_fill="nan")
    ops.paged_attention(*[t.cuda() for t in decode.attention_args()])
    assert len(paged_calls) == 2


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("differential", [False, True])
def test_compiled_call_stays_opaque(differential, monkeypatch):
    """Under ``torch.compile(fullgraph=True)`` with static shapes, a covered call stays one op
    call in Inductor's code (a Gluon kernel is not traced), no graph break, and runs here;
    its backward (the op's gradient formula) gives eager's gradients."""
    import compiled_attn.ops as ops
    from torch._inductor.utils import run_and_get_code

    calls = _count_calls(monkeypatch, "varlen")
    batch = make_varlen_batch([200, 65], num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, seed=10)
    q, k, v, cu_q, cu_k = (t.cuda() for t in batch.attention_args())
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    lam = make_lambda(8, per_pair=True) if differential else None
    extra = (lam.cuda(),) if differential else ()

    def f(q, k, v):
        return ops.varlen_attention(q, k, v, cu_q, cu_k, *extra) * 2.0

    torch._dynamo.reset()
    got, code = run_and_get_code(torch.compile(f, fullgraph=True), q, k, v)
    assert "torch.ops.compiled_attn.varlen_attention.default" in "\n".join(code)
    assert len(calls) >= 1
    assert_close_to_oracle(got, 2.0 * oracle_varlen(*batch.attention_args(), lambda_full=lam))
    weights = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), weights),
                    torch.autograd.grad(f(q, k, v), (q, k, v), weights)):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=2e-2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("differential", [False, True])
def test_paged_prefill_in_a_cuda_graph(differential, monkeypatch):
    """Captured once, replayed after the metadata changes (lengths, block tables, a padded
    row): each replay equals the eager call bit for bit and the oracle within tolerance
    (differential: its dynamic schedule's counter is zeroed inside the graph)."""
    import compiled_attn.ops as ops

    calls = _count_calls(monkeypatch, "paged")
    rounds = [[(200, 300), (0, 200), (17, 12)], [(1000, 500), (5, 1), pad(11)], [(0, 512), (64, 0), (300, 0)]]
    batches = [make_paged_batch(seqs, num_heads=8, num_kv_heads=2, head_size=128, dtype=torch.bfloat16, seed=20 + i,
                                unused_fill="nan", extra_columns=80 - len(seqs)) for i, seqs in enumerate(rounds)]
    width = max(b.block_table.shape[1] for b in batches)
    blocks = max(b.key_cache.shape[0] for b in batches)
    static = [torch.zeros((512, 8, 128), dtype=torch.bfloat16, device="cuda"),
              torch.full((blocks, 16, 2, 128), float("nan"), dtype=torch.bfloat16, device="cuda"),
              torch.full((blocks, 16, 2, 128), float("nan"), dtype=torch.bfloat16, device="cuda"),
              torch.zeros(4, dtype=torch.int32, device="cuda"), torch.zeros(3, dtype=torch.int32, device="cuda"),
              torch.zeros((3, width), dtype=torch.int32, device="cuda")]
    lam = make_lambda(8, per_pair=True) if differential else None
    static += [lam.cuda()] if differential else []

    def load(batch):
        query, key_cache, value_cache, cu_q, seq_lens, table = batch.attention_args()
        static[0].copy_(torch.nn.functional.pad(query, (0, 0, 0, 0, 0, 512 - query.shape[0])))
        for dst, src in ((static[1], key_cache), (static[2], value_cache)):
            dst.fill_(float("nan"))
            dst[:src.shape[0]].copy_(src)
        static[3].copy_(torch.nn.functional.pad(cu_q, (0, 4 - cu_q.shape[0]), value=int(cu_q[-1])))
        static[4].copy_(seq_lens)
        static[5].copy_(torch.nn.functional.pad(table, (0, width - table.shape[1])))

    load(batches[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.paged_attention(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.paged_attention(*static)
    for number, batch in enumerate(batches):
        load(batch)
        out.fill_(float("nan"))
        graph.replay()
        rows = batch.query.shape[0]  # (the rows past them belong to no sequence: left unwritten)
        assert torch.equal(out[:rows], ops.paged_attention(*static)[:rows]), f"round {number}"
        assert_close_to_oracle(out[:rows], oracle_paged(*batch.attention_args(), lambda_full=lam))
    assert calls  # captured and eager calls took this kernel


def test_launch_problems_are_named(monkeypatch):
    """The launchers refuse what the kernel cannot read, or what the ops refuse, with a
    ValueError (a dtype or type: a TypeError) naming the argument, tiles it does not run
    with a ValueError naming them (their field types: a TypeError), tensors off an sm90 GPU
    (here: CPU tensors, after every other check), and (the device taken for one) metadata
    values the ops refuse, before any launch (a launch would fail the test)."""
    monkeypatch.setattr(gluon_prefill, "_run", lambda *args: pytest.fail("launched"))
    bf16 = dict(dtype=torch.bfloat16)
    q, kv = torch.zeros(8, 4, 128, **bf16), torch.zeros(8, 2, 128, **bf16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    assert gluon_prefill.launch_problem(q, kv, kv, None) is None
    for args, kwargs, error, match in (
            ((q.float(), kv.float(), kv.float(), cu, cu), {}, TypeError, "q must be float16 or bfloat16"),
            ((q, kv, kv, cu, cu), dict(causal=None), TypeError, "causal must be a bool, got NoneType"),
            ((q, kv, kv, cu, cu), dict(window_right=2.5), TypeError, "window_right must be an int, got float"),
            ((q, kv, kv, cu, cu), dict(window_right=-2), ValueError, "window_right must be >= 0 or -1"),
            ((q, "k", kv, cu, cu), {}, TypeError, "k must be a torch.Tensor, got str"),
            ((q, kv, None, cu, cu), {}, TypeError, "v must be a torch.Tensor, got NoneType"),
            ((q, kv, kv, cu[:0], cu[:0]), {}, ValueError, r"cu_seqlens_q must have num_seqs \+ 1 >= 1 entries"),
            ((q, kv, kv, cu, cu), dict(out=[1]), TypeError, "out must be a torch.Tensor, got list"),
            ((q, kv, kv, cu, cu), dict(out=torch.zeros(8, 512, **bf16)), ValueError, r"out must be \(8, 4, 128\)"),
            ((q, kv, kv, cu, cu), dict(out=torch.zeros(8, 4, 128)), ValueError, r"torch.bfloat16 with a contiguous"),
            ((q, kv, kv, cu, cu), dict(out=torch.zeros(8, 4, 128, device="meta", **bf16)), ValueError,
             "all tensors must be on one device, got q on cpu, out on meta"),
            ((q, kv, kv, cu, cu), dict(out=torch.zeros(1, 4, 128, **bf16).expand(8, 4, 128)), ValueError,
             "out must have dense heads and dims"),
            ((q, torch.zeros(1, 2, 128, **bf16).expand(8, 2, 128), kv, cu, cu), {}, ValueError,
             "k must have dense heads and dims"),
            ((torch.zeros(8 * 512 + 1, **bf16)[1:].view(8, 4, 128), kv, kv, cu, cu), {}, ValueError,
             r"q must have dense heads and dims, rows at least H \* D elements apart \(no broadcast or overlap\) "
             r"and 16-byte aligned, and a 16-byte-aligned address"),
            ((q, kv, kv, cu, cu), dict(scale=torch.tensor(0.1)), TypeError, "scale must be a float or None"),
            ((q, kv, kv, cu, cu), {}, ValueError, "q must be a CUDA tensor on an sm90 GPU"),
            ((q[..., :64].contiguous(), kv, kv, cu, cu), {}, ValueError, r"head_size of k \(128\) must equal q's"),
            ((torch.zeros(8, 4, 96, **bf16), torch.zeros(8, 2, 96, **bf16), torch.zeros(8, 2, 96, **bf16), cu, cu), {},
             ValueError, r"head size in \(64, 128\), got 96"),
            ((torch.zeros(8, 8, 128, **bf16)[:, ::2], kv, kv, cu, cu), {}, ValueError, "q must have dense heads"),
            ((q, kv, kv, cu, cu), dict(out=torch.zeros(8, 8, 128, **bf16)[:, ::2]), ValueError,
             "out must have dense heads"),
            ((q.view(8, 512), kv, kv, cu, cu), {}, ValueError, "q must be 3-D"),
            ((q, kv, torch.zeros(8, 4, 128, **bf16), cu, cu), {}, ValueError, "v must have k's shape"),
            ((torch.zeros(8, 3, 128, **bf16), kv, kv, cu, cu), {}, ValueError, "multiple of num_kv_heads"),
            ((q, kv, kv, cu, cu, torch.ones(3)), {}, ValueError, r"lambda_full must have shape \[\] or \[num_heads"),
            ((q, kv, kv, cu.view(1, 2), cu), {}, ValueError, "cu_seqlens_q must be 1-D"),
            ((q, kv, kv, cu, cu), dict(scale=-1.0), ValueError, "scale must be finite and > 0"),
            ((q, kv, kv, cu, cu.long()), {}, TypeError, r"cu_seqlens_k must have dtype in \(torch.int32\), got torch.int64"),
            ((q, kv, kv, [0, 8], cu), {}, TypeError, "cu_seqlens_q must be a torch.Tensor, got list"),
            ((q, kv, kv, cu, cu), dict(tiles=(64, 128, 2)), TypeError, "tiles must be a GluonTiles, got tuple"),
            ((q, kv, kv, cu, cu), dict(tiles=gluon_prefill.TILES._replace(stages=1.5)), TypeError,
             "stages must be ints"),
            ((q, kv, kv, cu, cu), dict(tiles=gluon_prefill.TILES._replace(overlap=1)), TypeError,
             "the schedules bools")):
        with pytest.raises(error, match=match):
            gluon_prefill.varlen_prefill(*args, **kwargs)
    for tiles, match in ((gluon_prefill.GluonTiles(early_waits=True), "early_waits need overlap=True"),
                         (gluon_prefill.GluonTiles(values_first=True), "values_first and early_waits need overlap"),
                         (gluon_prefill.TILES._replace(stages=1, early_waits=True), "early_waits needs stages >= 2"),
                         (gluon_prefill.TILES._replace(block_m=128), "block_m must be 64"),
                         (gluon_prefill.TILES._replace(block_n=32), "block_n 64 or 128"),
                         (gluon_prefill.TILES._replace(stages=0), "stages at least 1"),
                         (gluon_prefill.TILES._replace(stages=3), "263168 bytes of shared memory at head size 128")):
        with pytest.raises(ValueError, match=match):
            gluon_prefill.varlen_prefill(q, kv, kv, cu, cu, tiles=tiles)
    # a differential schedule over 4 stages of 64 keys would take 353 KiB
    with pytest.raises(ValueError, match=r"\(differential\), over the 232448"):
        gluon_prefill.varlen_prefill(q, kv, kv, cu, cu, torch.ones(2),
                                     tiles=gluon_prefill.DIFFERENTIAL_TILES[128]._replace(stages=4))
    cache, table = torch.zeros(2, 16, 2, 128, **bf16), torch.zeros(1, 2, dtype=torch.int32)
    wide_cache = torch.zeros(2, 16, 4, 128, **bf16)
    lens = torch.tensor([8], dtype=torch.int32)
    for args, error, match in (((q, cache, cache, cu, lens.long(), table), TypeError,
                                r"seq_lens must have dtype in \(torch.int32\), got torch.int64"),
                               ((q, cache, cache, cu, lens, table[0]), ValueError, "block_table must be 2-D"),
                               ((q, cache[0], cache[0], cu, lens, table), ValueError, "key_cache must be 4-D"),
                               ((q, torch.zeros(4, 8, 2, 128, **bf16), torch.zeros(4, 8, 2, 128, **bf16), cu, lens,
                                 table), ValueError, "block size must be a power of two >= 16, got 8"),
                               ((q, wide_cache[:, :, ::2], wide_cache[:, :, ::2], cu, lens, table), ValueError,
                                "key_cache must have dense heads"),
                               ((q, cache.to(torch.float8_e4m3fn), cache.to(torch.float8_e4m3fn), cu, lens, table),
                                TypeError, "key_cache must have query's dtype"),
                               ((q, cache, cache, cu, lens, table), ValueError, "query must be a CUDA tensor")):
        with pytest.raises(error, match=match):
            gluon_prefill.paged_prefill(*args)
    monkeypatch.setattr(gluon_prefill, "_on_sm90", lambda tensor: True)
    launched = []
    monkeypatch.setattr(gluon_prefill, "_run", lambda *args: launched.append(args))
    empty_table = torch.zeros(1, 0, dtype=torch.int32)  # a batch whose one sequence has no key yet
    gluon_prefill.paged_prefill(q[:0], cache, cache, torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                                empty_table)
    for args, match in (((q, cache, cache, cu, torch.tensor([100], dtype=torch.int32), table),
                         r"seq_lens\[0\]=100 is out of range \[0, 32\]"),
                        ((q, cache, cache, cu, lens, torch.tensor([[5, 1]], dtype=torch.int32)),
                         r"block_table\[0\] holds block ids \[5\] outside \[0, 2\)")):
        with pytest.raises(ValueError, match=match):
            gluon_prefill.paged_prefill(*args)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must start at 0, never decrease and end at the token "
                                         r"count 8, got \[0, 7\]"):
        gluon_prefill.varlen_prefill(q, kv, kv, torch.tensor([0, 7], dtype=torch.int32), cu)
    with pytest.raises(ValueError, match=r"cu_seqlens_k must start at 0, never decrease and end at or below the "
                                         r"token count 8, got \[0, 9\]"):
        gluon_prefill.varlen_prefill(q, kv, kv, cu, torch.tensor([0, 9], dtype=torch.int32))
    # keys past the last sequence's (never read) are allowed, as flash-attn allows them
    gluon_prefill.varlen_prefill(q, kv, kv, cu, torch.tensor([0, 7], dtype=torch.int32))
    assert len(launched) == 1  # (no query token: the empty paged batch returned before launching)
