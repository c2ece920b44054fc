"""A prefill kernel for varlen attention, contiguous or paged K/V, specialised for Hopper (sm90).

The unified kernel (:mod:`.attention_kernel`) serves every batch: paged or contiguous K/V,
decode and prefill rows mixed, GQA group rows packed into one tile, split-KV. This kernel
serves long query runs only: the ``varlen_attention`` op's packed contiguous
``q``/``k``/``v`` (:func:`varlen_prefill`) and, ``PAGED``, chunked prefill over the paged
cache of ``paged_attention`` (:func:`paged_prefill`, below). It is laid out as Triton's
Hopper attention tutorial (``python/tutorials/06-fused-attention.py``, Triton 3.6) and
FlashAttention-3's forward:

* one program = ``BLOCK_M`` query tokens x one query head (plain) or one query head pair
  (differential; or, ``VALUE_SPLIT``, a pair and one of its two value heads), the query
  tile held in shared memory across the key loop (the wgmma A operand);
* Q, K, V tiles read and the output tile written through TMA tensor descriptors built on
  the device per sequence (``tl.make_tensor_descriptor`` over the sequence's ``[len, H * D]``
  rows: the TMA unit zero-fills reads and clips writes past the sequence's end, so no
  load or store needs a mask), K/V software-pipelined over ``num_stages`` buffers; a
  constexpr (``USE_TMA``) swaps them for masked pointer loads and stores (unaligned or
  strided tensors, GPUs before sm90);
* the key range of a tile is cut in three: window-edge tiles (masked), interior tiles
  (every row sees every key: no mask, no ``-inf`` guard) and the diagonal / last partial
  tiles (masked), so causal prefill runs the unmasked loop except on the diagonal;
* base-2 softmax with ``scale * log2(e)`` folded into one multiply (FMA with the max); for a
  positive scale without softcap (``RAW_MAX``) the row max is taken over unscaled scores and
  the scale enters the exponent's FMA (no separate multiply of the score tile: 62 fewer
  instructions a thread per 128x128 step on sm90);
* grid ``(units, num_q_tiles)``, units fastest: a wave starts the same query tile of
  every head, and the tile axis runs *reversed*, so each sequence's last (causal: heaviest)
  tiles start first and the lightest finish the launch (FlashAttention-3's
  longest-processing-time order within a sequence, without sorting sequences).

Shapes (token-major, as ``flash_attn_varlen_func``)::

    q        [Tq, Hq, D]      query tokens of all sequences, packed
    k, v     [Tk, Hkv, D]     key/value tokens, packed (differential: heads 2u, 2u+1 = pair u)
    cu_seqlens_q, cu_seqlens_k   [B + 1] int32
    lambda_full  [] or [Hq / 2] (differential only)
    out      [Tq, Hq, D]  plain;  [Tq, Hq / 2, 2D] differential ([v1 | v2] columns)
    paged (in place of k, v, cu_seqlens_k):
    key_cache, value_cache   [num_blocks, block_size, Hkv, D]   (q's dtype)
    block_table  [B, max_blocks] int32;  seq_lens  [B] int32 (keys of b, its new tokens included)

Varlen without a host sync: ``num_q_tiles = Tq // BLOCK_M + B`` bounds the query tiles of
all sequences (sequence ``b`` owns tiles ``cu_seqlens_q[b] // BLOCK_M + b`` onwards); a
program finds its sequence by a binary search over ``cu_seqlens_q`` written inline (see
the note in :func:`prefill_kernel`) and exits when its tile is past the sequence's queries.

Math: the online softmax of FlashAttention-2 (Dao 2023, arXiv 2307.08691, §3.1 and
algorithm 1) in base 2; masks as ``flash_attn_varlen_func`` (bottom-right aligned: query
``i`` sits at key position ``p = i + k_len - q_len`` and sees key ``j`` when
``min_dist <= p - j <= max_dist``, the launcher folding ``causal`` and the window into the
bounds); softcap ``c * tanh(s / c)`` of the scaled score; rows that see no key are zeros.
Differential (Ye et al. 2024, Differential Transformer, arXiv 2410.05258, §2.1, eq. 1):
the program of query pair ``j`` (heads ``2j``, ``2j + 1``) reads KV pair
``u = j // (Hq / Hkv)`` (heads ``2u``, ``2u + 1``); each key tile is loaded once
(``k1``, ``k2`` and the value pair as one ``[BLOCK_N, 2D]`` tile ``[v1 | v2]``) and feeds
two online softmaxes, ``acc_c = softmax(q_c k_cᵀ) [v1 | v2]`` (with ``VALUE_SPLIT``, two
programs per pair each take one value head: half the accumulators for twice the score
dots, which is what lets 128-row tiles fit at D 128); the output is
``acc_1 / l_1 - lambda_j * acc_2 / l_2`` (float32), as the unified kernel writes it.

ALiBi, float8 caches, float32 and head sizes other than 64/128/256 (differential: 64/128)
stay on the unified kernel (:func:`covers`). The op routes covered calls here when
:data:`compiled_attn.ops.triton_kernels.attention.PREFILL_KERNEL` is ``"hopper"``.

Paged prefill (``PAGED``, :func:`paged_prefill`; the ``paged_attention`` op routes
:func:`covers_paged` calls here when ``attention.PAGED_PREFILL_KERNEL`` is ``"hopper"``):
K/V come from caches ``[num_blocks, block_size, Hkv, D]`` through the block table; each key
tile reads its ``BLOCK_N // block_size`` block ids once (one id when a block holds the
tile) and loads its rows with pointer loads, which Triton's pipeliner turns into cp.async
copies into the shared buffers that wgmma reads (at 3+ stages the id load is pipelined a
stage ahead as well); q and out keep TMA. Masks, windows, softcap, GQA and differential
pairs as above, with ``k_len = seq_lens[b]``. Paged calls run at :data:`PAGED_TILES`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..attention import default_scale, output_buffer
from .attention_kernel import _tanh
from .launch_utils import BoundedCache, CachedLauncher, device_guard, tracing_launches

LOG2E = tl.constexpr(1.4426950408889634)
UNBOUNDED = 1 << 30  # a distance no sequence reaches (as attention.visibility_bounds)


@triton.jit
def _load_tile(src, row, num_rows, head, stride_t, stride_h, stride_d, ROWS: tl.constexpr, COLS: tl.constexpr,
               HEAD_SIZE: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr):
    """``[ROWS, COLS]`` tile of one sequence's tokens ``row ..`` (from the sequence's first
    token) and heads ``head ..`` (``COLS / HEAD_SIZE`` adjacent heads); rows at or past
    ``num_rows`` (the sequence's end) read as zeros. ``USE_TMA``: ``src`` is a descriptor
    over the sequence's ``[len, H * D]`` view (the TMA unit zero-fills past its end); else a
    pointer to the sequence's first token, rows masked when ``MASKED`` (unmasked loads must
    be in range)."""
    if USE_TMA:
        return src.load([row, head * HEAD_SIZE])
    else:
        rows = tl.arange(0, ROWS)
        cols = tl.arange(0, COLS)
        ptrs = (src + (row + rows).to(tl.int64)[:, None] * stride_t
                + ((head + cols // HEAD_SIZE) * stride_h + (cols % HEAD_SIZE) * stride_d)[None, :])
        if MASKED:
            return tl.load(ptrs, mask=(rows < num_rows)[:, None], other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def _paged_rows(table_row, start, keys_left, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """``(block, slot)``, ``[ROWS]`` each, of a sequence's keys ``start ..`` in a paged
    cache: the tile's ``ROWS // BLOCK_SIZE`` block ids read once from the sequence's
    block-table row ``table_row`` (one id when a block holds the whole tile) and broadcast
    to their rows. ``MASKED``: ids of blocks at or past ``keys_left`` are not read (0; the
    rows' loads are masked)."""
    rows = tl.arange(0, ROWS)
    if BLOCK_SIZE >= ROWS:  # the tile lies in one block (powers of two, start % ROWS == 0)
        block = tl.load(table_row + start // BLOCK_SIZE).to(tl.int64)
        return tl.full([ROWS], 0, tl.int64) + block, start % BLOCK_SIZE + rows
    else:
        BLOCKS: tl.constexpr = ROWS // BLOCK_SIZE
        nth = tl.arange(0, BLOCKS)
        if MASKED:
            ids = tl.load(table_row + start // BLOCK_SIZE + nth, mask=nth * BLOCK_SIZE < keys_left, other=0)
        else:
            ids = tl.load(table_row + start // BLOCK_SIZE + nth)
        ids = tl.reshape(tl.broadcast_to(ids.to(tl.int64)[:, None], (BLOCKS, BLOCK_SIZE)), (ROWS,))
        return ids, rows % BLOCK_SIZE


@triton.jit
def _load_paged_tile(cache, block, slot, keys_left, head, stride_b, stride_s, stride_h, stride_d, ROWS: tl.constexpr,
                     COLS: tl.constexpr, HEAD_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """``[ROWS, COLS]`` tile of a paged cache ``[num_blocks, BLOCK_SIZE, H, D]``: rows at
    ``(block, slot)`` (:func:`_paged_rows`), heads ``head ..`` (``COLS / HEAD_SIZE``
    adjacent heads); rows at or past ``keys_left`` read as zeros when ``MASKED``. Pointer
    loads: the pipeliner issues them as cp.async into shared memory (each row one
    contiguous ``HEAD_SIZE`` run of 16-byte vectors)."""
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, COLS)
    ptrs = (cache + (block * stride_b + slot * stride_s)[:, None]
            + ((head + cols // HEAD_SIZE) * stride_h + (cols % HEAD_SIZE) * stride_d)[None, :])
    if MASKED:
        return tl.load(ptrs, mask=(rows < keys_left)[:, None], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _scores(q, k, qk_scale, scale, softcap, SOFTCAP: tl.constexpr, RUNTIME_SCALARS: tl.constexpr,
            RAW_MAX: tl.constexpr):
    """``q kᵀ`` in base-2 log units: scaled by ``qk_scale = scale * log2(e)``, or softcapped
    (``softcap * tanh(scale * s / softcap)``; with ``RUNTIME_SCALARS`` a softcap of 0 is off).
    ``RAW_MAX``: unscaled (:func:`_softmax_step` scales them inside its exponent)."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    if RAW_MAX:
        return s
    if SOFTCAP:
        s = s * scale
        if RUNTIME_SCALARS:
            capped = softcap * _tanh(s / tl.where(softcap > 0, softcap, 1.0))
            s = tl.where(softcap > 0, capped, s)
        else:
            s = softcap * _tanh(s / softcap)
        s = s * LOG2E
    else:
        s = s * qk_scale
    return s


@triton.jit
def _softmax_step(m, l, acc, s, v, qk_scale, MASKED: tl.constexpr, RAW_MAX: tl.constexpr):
    """One online-softmax step of scores ``s`` (base 2, ``-inf`` where masked) against the
    value tile ``v``. Masked steps guard rows that have seen no key yet (max ``-inf``);
    in unmasked steps every row sees every key, so the running max is finite.
    ``RAW_MAX`` (``qk_scale > 0``): ``s`` and ``m`` are unscaled scores, the max is taken
    before scaling and the scale enters the exponent as one FMA ``s * qk_scale - m * qk_scale``
    (FlashAttention-3's form: no separate multiply of the score tile)."""
    m_new = tl.maximum(m, tl.max(s, 1))
    if MASKED:
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_safe = m_new
    if RAW_MAX:
        m_scaled = m_new_safe * qk_scale
        p = tl.exp2(s * qk_scale - m_scaled[:, None])
        alpha = tl.exp2(m * qk_scale - m_scaled)
    else:
        p = tl.exp2(s - m_new_safe[:, None])
        alpha = tl.exp2(m - m_new_safe)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    return m_new, l, acc


@triton.jit
def _key_steps(m1, l1, acc1, m2, l2, acc2, q1, q2, k_src, v_src, table_row, kv_len, kv_head, v_head,
               tile_begin, tile_end, pos, qk_scale, scale, softcap, min_dist, max_dist,
               stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
               DIFFERENTIAL: tl.constexpr, MASKED: tl.constexpr, SOFTCAP: tl.constexpr,
               RUNTIME_SCALARS: tl.constexpr, USE_TMA: tl.constexpr, HEAD_SIZE: tl.constexpr,
               VALUE_COLS: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
               RAW_MAX: tl.constexpr):
    """Key tiles ``[tile_begin, tile_end)`` of one sequence (``k_src``/``v_src`` start there;
    ``PAGED``: they are the caches and ``table_row`` the sequence's block-table row, and
    ``stride_kt``/``stride_vt`` the slot strides): one online-softmax state (plain) or two
    over the same loaded tiles (differential); values ``[BLOCK_N, VALUE_COLS]`` from head
    ``v_head`` on."""
    offs_n = tl.arange(0, BLOCK_N)
    for tile in tl.range(tile_begin, tile_end):
        start = tile * BLOCK_N
        keys_left = kv_len - start
        if PAGED:  # the tile's block ids, read once for K and V (and k2)
            block, slot = _paged_rows(table_row, start, keys_left, BLOCK_N, BLOCK_SIZE, MASKED)
            k1 = _load_paged_tile(k_src, block, slot, keys_left, kv_head, stride_kb, stride_kt, stride_kh, stride_kd,
                                  BLOCK_N, HEAD_SIZE, HEAD_SIZE, MASKED)
            v = _load_paged_tile(v_src, block, slot, keys_left, v_head, stride_vb, stride_vt, stride_vh, stride_vd,
                                 BLOCK_N, VALUE_COLS, HEAD_SIZE, MASKED)
        else:
            k1 = _load_tile(k_src, start, keys_left, kv_head, stride_kt, stride_kh, stride_kd,
                            BLOCK_N, HEAD_SIZE, HEAD_SIZE, MASKED, USE_TMA)
            v = _load_tile(v_src, start, keys_left, v_head, stride_vt, stride_vh, stride_vd,
                           BLOCK_N, VALUE_COLS, HEAD_SIZE, MASKED, USE_TMA)
        s1 = _scores(q1, k1, qk_scale, scale, softcap, SOFTCAP, RUNTIME_SCALARS, RAW_MAX)
        if DIFFERENTIAL:
            if PAGED:
                k2 = _load_paged_tile(k_src, block, slot, keys_left, kv_head + 1, stride_kb, stride_kt, stride_kh,
                                      stride_kd, BLOCK_N, HEAD_SIZE, HEAD_SIZE, MASKED)
            else:
                k2 = _load_tile(k_src, start, keys_left, kv_head + 1, stride_kt, stride_kh, stride_kd,
                                BLOCK_N, HEAD_SIZE, HEAD_SIZE, MASKED, USE_TMA)
            s2 = _scores(q2, k2, qk_scale, scale, softcap, SOFTCAP, RUNTIME_SCALARS, RAW_MAX)
        if MASKED:
            kpos = start + offs_n
            in_seq = kpos < kv_len
            dist = pos[:, None] - kpos[None, :]
            visible = (dist >= min_dist) & (dist <= max_dist) & in_seq[None, :]
            s1 = tl.where(visible, s1, float("-inf"))
            if DIFFERENTIAL:
                s2 = tl.where(visible, s2, float("-inf"))
        m1, l1, acc1 = _softmax_step(m1, l1, acc1, s1, v, qk_scale, MASKED, RAW_MAX)
        if DIFFERENTIAL:
            m2, l2, acc2 = _softmax_step(m2, l2, acc2, s2, v, qk_scale, MASKED, RAW_MAX)
    return m1, l1, acc1, m2, l2, acc2


@triton.jit
def _normalize(acc, l):
    """``acc / l`` per row, zeros for rows that saw no key (``l == 0``)."""
    return tl.where(l[:, None] > 0, acc / tl.where(l > 0, l, 1.0)[:, None], 0.0)


@triton.jit(do_not_specialize=["num_seqs", "min_dist", "max_dist"])
def prefill_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, block_table_ptr, lambda_ptr, scalars_ptr,
    num_seqs, scale, softcap, min_dist, max_dist,
    stride_qt, stride_qh, stride_qd, stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od, stride_bt,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    DIFFERENTIAL: tl.constexpr, LAMBDA_PER_PAIR: tl.constexpr, SOFTCAP: tl.constexpr,
    RUNTIME_SCALARS: tl.constexpr, WINDOW_LEFT: tl.constexpr, USE_TMA: tl.constexpr,
    VALUE_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr, RAW_MAX: tl.constexpr,
):
    """Attention of ``BLOCK_M`` query tokens x one query head (pair) of one sequence.

    Args:
        out_ptr: ``[Tq, Hq, D]`` or, differential, ``[Tq, Hq/2, 2D]``, the query's dtype.
        q_ptr: ``[Tq, Hq, D]``; k_ptr, v_ptr: ``[Tk, Hkv, D]``. ``USE_TMA``: q, k, v and out
            have dense heads and dims (head stride = the last dim, dim stride 1), token
            strides and base addresses multiples of 16 bytes; loads and the output store go
            through per-sequence TMA descriptors.
        cu_seqlens_q_ptr, cu_seqlens_k_ptr: ``[B + 1]`` int32.
        PAGED: k_ptr, v_ptr are caches ``[num_blocks, BLOCK_SIZE, Hkv, D]`` (strides
            ``stride_kb``, ``stride_kt`` (slot), ``stride_kh``, ``stride_kd``; v likewise),
            ``cu_seqlens_k_ptr`` is ``seq_lens`` ``[B]`` int32 and ``block_table_ptr`` the
            ``[B, max_blocks]`` int32 table (row stride ``stride_bt``). K/V tiles are read
            with pointer loads from the tile's ``BLOCK_N // BLOCK_SIZE`` blocks (ids read once
            a tile); ``USE_TMA`` then covers q and out only. ``BLOCK_SIZE`` a power of two.
        lambda_ptr: differential lambda, ``[]`` or ``[Hq/2]`` (``LAMBDA_PER_PAIR``).
        scalars_ptr: ``RUNTIME_SCALARS``: float32 ``[2]`` ``(scale, softcap)`` replacing the
            ``scale``/``softcap`` arguments.
        min_dist, max_dist: key ``j`` is visible from key position ``p`` when
            ``min_dist <= p - j <= max_dist``. ``WINDOW_LEFT``: ``max_dist`` is finite
            (a left window edge; else the first key tile is never masked on that side).
        VALUE_SPLIT: differential only: two programs per query pair, one per value head
            (``v1`` or ``v2``, output columns ``[0, D)`` or ``[D, 2D)``), each running both
            softmaxes: half the accumulators of a program (so 128-row tiles fit in
            registers at D 128) for twice the score dots.
        RAW_MAX: the launcher's ``scale > 0`` without softcap: scores stay unscaled through
            the row max (:func:`_softmax_step`).
    """
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS  # query heads (pairs) per KV head (pair)
    VALUE_COLS: tl.constexpr = 2 * HEAD_SIZE if DIFFERENTIAL and not VALUE_SPLIT else HEAD_SIZE
    if RUNTIME_SCALARS:
        scale = tl.load(scalars_ptr)
        softcap = tl.load(scalars_ptr + 1)
    else:  # Inductor passes a float that float32 cannot hold exactly as float64
        scale = tl.cast(scale, tl.float32)
        softcap = tl.cast(softcap, tl.float32)
    qk_scale = scale * LOG2E
    if VALUE_SPLIT:
        unit = tl.program_id(0) // 2  # query head pair; value head of the pair below
        half = tl.program_id(0) % 2
    else:
        unit = tl.program_id(0)  # query head (plain) or query head pair (differential)
        half = 0
    q_tile = tl.num_programs(1) - 1 - tl.program_id(1)  # reversed: last (heaviest) tiles first

    # The sequence ``seq`` with ``start(seq) <= q_tile < start(seq + 1)``, where
    # ``start(b) = cu_seqlens_q[b] // BLOCK_M + b`` (strictly increasing in ``b``): a binary
    # search written inline, not as a called function: Inductor's mutation analysis of a
    # traced kernel counts every pointer passed to a call whose result reaches a store
    # address as written (it would copy cu_seqlens_q around each launch).
    seq: tl.int32 = 0
    right = num_seqs
    while seq < right:
        mid = (seq + right + 1) // 2
        if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_M + mid <= q_tile:
            seq = mid
        else:
            right = mid - 1
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_first = (q_tile - q_start // BLOCK_M - seq) * BLOCK_M
    if q_first >= q_len:
        return
    if PAGED:
        kv_start = 0
        kv_len = tl.load(cu_seqlens_k_ptr + seq)
    else:
        kv_start = tl.load(cu_seqlens_k_ptr + seq)
        kv_len = tl.load(cu_seqlens_k_ptr + seq + 1) - kv_start

    if DIFFERENTIAL:
        q_head = 2 * unit
        kv_head = 2 * (unit // GROUP)
    else:
        q_head = unit
        kv_head = unit // GROUP
    v_head = kv_head + half
    # This sequence's tokens: descriptors (or pointers) start at its first token, and the
    # descriptors end at its last, so the TMA unit zero-fills rows past the sequence (never
    # another sequence's keys: p = 0 never meets an inf or NaN there) and clips stores.
    q_seq = q_ptr + q_start.to(tl.int64) * stride_qt
    o_seq = out_ptr + q_start.to(tl.int64) * stride_ot
    table_row = block_table_ptr + seq * stride_bt  # PAGED only (a table of < 2**31 entries)
    if USE_TMA:
        q_src = tl.make_tensor_descriptor(q_seq, shape=[q_len, NUM_HEADS * HEAD_SIZE],
                                          strides=[stride_qt, 1], block_shape=[BLOCK_M, HEAD_SIZE])
    else:
        q_src = q_seq
    if PAGED:  # the caches themselves (rows by block id and slot)
        k_src = k_ptr
        v_src = v_ptr
    elif USE_TMA:
        keys = tl.maximum(kv_len, 1)  # a descriptor dimension is at least 1 (no key is read when 0)
        k_src = tl.make_tensor_descriptor(k_ptr + kv_start.to(tl.int64) * stride_kt,
                                          shape=[keys, NUM_KV_HEADS * HEAD_SIZE],
                                          strides=[stride_kt, 1], block_shape=[BLOCK_N, HEAD_SIZE])
        v_src = tl.make_tensor_descriptor(v_ptr + kv_start.to(tl.int64) * stride_vt,
                                          shape=[keys, NUM_KV_HEADS * HEAD_SIZE],
                                          strides=[stride_vt, 1], block_shape=[BLOCK_N, VALUE_COLS])
    else:
        k_src = k_ptr + kv_start.to(tl.int64) * stride_kt
        v_src = v_ptr + kv_start.to(tl.int64) * stride_vt
    queries_left = q_len - q_first
    q1 = _load_tile(q_src, q_first, queries_left, q_head, stride_qt, stride_qh, stride_qd,
                    BLOCK_M, HEAD_SIZE, HEAD_SIZE, True, USE_TMA)
    m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l1 = tl.zeros([BLOCK_M], tl.float32)
    acc1 = tl.zeros([BLOCK_M, VALUE_COLS], tl.float32)
    if DIFFERENTIAL:
        q2 = _load_tile(q_src, q_first, queries_left, q_head + 1, stride_qt, stride_qh, stride_qd,
                        BLOCK_M, HEAD_SIZE, HEAD_SIZE, True, USE_TMA)
        m2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l2 = tl.zeros([BLOCK_M], tl.float32)
        acc2 = tl.zeros([BLOCK_M, VALUE_COLS], tl.float32)
    else:  # placeholders (never read)
        q2 = q1
        m2 = m1
        l2 = l1
        acc2 = acc1

    # Key tiles this query tile sees, and the interior ones that every row sees whole:
    # masked [tile_lo, mid_lo), unmasked [mid_lo, mid_hi), masked [mid_hi, tile_hi).
    # (Clamped to >= 0 before dividing: Triton's integer division truncates.)
    pos = q_first + tl.arange(0, BLOCK_M) + kv_len - q_len
    pos_first = q_first + kv_len - q_len
    pos_last = tl.minimum(q_first + BLOCK_M, q_len) - 1 + kv_len - q_len
    kv_hi = tl.minimum(tl.maximum(pos_last - min_dist + 1, 0), kv_len)
    tile_hi = tl.cdiv(kv_hi, BLOCK_N)
    full_hi = tl.maximum(tl.minimum(pos_first - min_dist + 1, kv_len), 0)
    if WINDOW_LEFT:
        tile_lo = tl.minimum(tl.maximum(pos_first - max_dist, 0) // BLOCK_N, tile_hi)
        mid_lo = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(pos_last - max_dist, 0), BLOCK_N), tile_lo), tile_hi)
    else:
        tile_lo = 0
        mid_lo = 0
    mid_hi = tl.minimum(tl.maximum(full_hi // BLOCK_N, mid_lo), tile_hi)

    if WINDOW_LEFT:
        m1, l1, acc1, m2, l2, acc2 = _key_steps(
            m1, l1, acc1, m2, l2, acc2, q1, q2, k_src, v_src, table_row, kv_len, kv_head, v_head, tile_lo, mid_lo,
            pos, qk_scale, scale, softcap, min_dist, max_dist, stride_kb, stride_kt, stride_kh, stride_kd,
            stride_vb, stride_vt, stride_vh, stride_vd, DIFFERENTIAL, True, SOFTCAP, RUNTIME_SCALARS, USE_TMA,
            HEAD_SIZE, VALUE_COLS, BLOCK_N, PAGED, BLOCK_SIZE, RAW_MAX)
    m1, l1, acc1, m2, l2, acc2 = _key_steps(
        m1, l1, acc1, m2, l2, acc2, q1, q2, k_src, v_src, table_row, kv_len, kv_head, v_head, mid_lo, mid_hi,
        pos, qk_scale, scale, softcap, min_dist, max_dist, stride_kb, stride_kt, stride_kh, stride_kd,
        stride_vb, stride_vt, stride_vh, stride_vd, DIFFERENTIAL, False, SOFTCAP, RUNTIME_SCALARS, USE_TMA,
        HEAD_SIZE, VALUE_COLS, BLOCK_N, PAGED, BLOCK_SIZE, RAW_MAX)
    m1, l1, acc1, m2, l2, acc2 = _key_steps(
        m1, l1, acc1, m2, l2, acc2, q1, q2, k_src, v_src, table_row, kv_len, kv_head, v_head, mid_hi, tile_hi,
        pos, qk_scale, scale, softcap, min_dist, max_dist, stride_kb, stride_kt, stride_kh, stride_kd,
        stride_vb, stride_vt, stride_vh, stride_vd, DIFFERENTIAL, True, SOFTCAP, RUNTIME_SCALARS, USE_TMA,
        HEAD_SIZE, VALUE_COLS, BLOCK_N, PAGED, BLOCK_SIZE, RAW_MAX)

    if DIFFERENTIAL:
        if LAMBDA_PER_PAIR:
            lam = tl.load(lambda_ptr + unit).to(tl.float32)
        else:
            lam = tl.load(lambda_ptr).to(tl.float32)
        result = _normalize(acc1, l1) - lam * _normalize(acc2, l2)
    else:
        result = _normalize(acc1, l1)
    result = result.to(out_ptr.dtype.element_ty)
    # Output columns of this program: head (pair) ``unit``, value half ``half`` (VALUE_SPLIT).
    if USE_TMA:  # the descriptor ends at the sequence's last query: rows past it are clipped
        OUT_COLS: tl.constexpr = 2 * HEAD_SIZE if DIFFERENTIAL else HEAD_SIZE
        OUT_HEADS: tl.constexpr = NUM_HEADS // 2 if DIFFERENTIAL else NUM_HEADS
        o_desc = tl.make_tensor_descriptor(o_seq, shape=[q_len, OUT_HEADS * OUT_COLS], strides=[stride_ot, 1],
                                           block_shape=[BLOCK_M, VALUE_COLS])
        o_desc.store([q_first, unit * OUT_COLS + half * HEAD_SIZE], result)
    else:
        rows = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, VALUE_COLS)
        out = (o_seq + (q_first + rows).to(tl.int64)[:, None] * stride_ot + unit * stride_oh
               + (half * HEAD_SIZE + cols)[None, :] * stride_od)
        tl.store(out, result, mask=(rows < queries_left)[:, None])


# ---------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------


class PrefillTiles(NamedTuple):
    """``block_m`` query tokens x ``block_n`` keys per step; Triton launch options;
    ``value_split`` (differential): one program per value head of a pair (see
    :func:`prefill_kernel`'s ``VALUE_SPLIT``)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    value_split: bool = False


# Hopper tiles (bf16/fp16) for K/V through TMA (contiguous), by (head size, differential);
# registers a thread and shared memory from ptxas on sm90 with Triton 3.6
# (tests/compile_prefill_sm90.py). Float32 accumulators per program: plain block_m x D;
# differential 2 x block_m x 2D, or with value_split 2 x block_m x D (at 8 warps 32768
# floats are 128 registers a thread). A differential 64-row tile (D 128 unsplit) makes
# Triton replicate the score dot across both warpgroups (mma warpsPerCTA [8, 1] over 64
# rows) and spills: avoided. D 128 chosen on the H200 (2026-12-01, bf16, causal, Hq 32,
# Hkv 8; profiling/bench_kernels.py --parts prefill; ms at B=8 S=2048 / 64 sequences of
# 128-4096 tokens): plain 128x128 w8 s3 0.755 / 8.27 against the unified kernel's
# 0.812 / 9.08 (128x128 w8 s2, the former default, 0.822 / 9.25; 64x64 w4 s3 0.728 / 8.58,
# faster at B=8 S=2048 only); differential 128x64 w8 s2 split 1.436 / 16.45 against the
# unified kernel's 1.678 / 18.71. D 64 and 256: not timed yet.
HOPPER_TILES: dict[tuple[int, bool], PrefillTiles] = {
    (64, False): PrefillTiles(128, 128, 8, 3),  # 211 registers, 113 KiB shared
    (128, False): PrefillTiles(128, 128, 8, 3),  # 233 registers, 225 KiB (of 227)
    (256, False): PrefillTiles(128, 32, 8, 2),  # 198 registers, 128 KiB
    (64, True): PrefillTiles(128, 32, 8, 3),  # 216 registers, 81 KiB
    # 255 registers and a small spill with Triton 3.6 (44 bytes stored, 84 loaded a thread;
    # 252 / 364 with per-call scalars and a window; none with 3.9), timed with it: still the
    # fastest differential tile
    (128, True): PrefillTiles(128, 64, 8, 2, value_split=True),  # 160 KiB
}
# Alternatives the benchmark times against HOPPER_TILES (the former defaults among them);
# ms as above, the last run's (unified 0.812 / 9.08 plain) or, marked ``first``, the day's
# first sweep's (unified 0.806 / 9.02 plain, 1.666 / 18.6 differential).
SWEEP_TILES: dict[tuple[int, bool], tuple[PrefillTiles, ...]] = {
    (64, False): (PrefillTiles(128, 64, 4, 3), PrefillTiles(128, 64, 8, 4)),
    (128, False): (PrefillTiles(128, 128, 8, 2),  # 0.822 / 9.25 ms
                   PrefillTiles(128, 64, 8, 3),  # first 0.776 / 8.61
                   PrefillTiles(64, 64, 4, 3)),  # 0.728 / 8.58
    (256, False): (PrefillTiles(128, 64, 8, 2), PrefillTiles(64, 64, 4, 2)),
    (64, True): (PrefillTiles(128, 64, 8, 3, value_split=True), PrefillTiles(64, 64, 4, 3)),
    (128, True): (PrefillTiles(128, 32, 8, 3, value_split=True),  # first 1.660 / 19.14 ms
                  PrefillTiles(64, 64, 8, 2),  # first 1.555 / 17.98
                  PrefillTiles(64, 32, 8, 3)),  # first 1.892 / 21.62
}
# Tiles of K/V read by pointer loads: paged prefill (chunked prefill over a paged cache)
# and contiguous K/V without TMA (not tma_ready, or a GPU before sm90). ``PAGED`` reads each
# key tile's BLOCK_N // block_size block ids once and loads K/V rows with pointer loads,
# which Triton pipelines as cp.async straight into the swizzled shared buffers that wgmma
# reads (no register copy; at 3+ stages the id load itself is pipelined a stage ahead);
# q and out through TMA. (TMA for K/V would need one [block_size, D] box per block: Triton
# 3.6 then copies each box shared -> registers, joins them and stores the tile back to shared
# for wgmma, and the dots turn synchronous; TMA gather is sm100 only.) The former
# HOPPER_TILES, all spill-free for sm90 at block 16 (tests/compile_prefill_sm90.py: plain
# D 128 243 registers, 160 KiB). On the H200 (2026-12-01, B=8, 512 new tokens after 4096
# cached, block 16, plain D 128, before RAW_MAX reached this path): paged 0.830 ms against
# the unified kernel's 1.169 and contiguous 128x128 w8 s2's 0.720 (paged / contiguous
# 1.15-1.17, target <= 1.1); profiling/bench_kernels.py --parts prefill times
# PAGED_SWEEP_TILES (spill-free too). Apart from HOPPER_TILES: the paged path was timed at
# these, and the D 128 TMA defaults fit pointer loads worse (sm90 offline, contiguous K/V
# without TMA: 224 KiB of shared memory plain, 208 bytes spilled differential).
PAGED_TILES: dict[tuple[int, bool], PrefillTiles] = {
    (64, False): PrefillTiles(128, 128, 8, 3),
    (128, False): PrefillTiles(128, 128, 8, 2),
    (256, False): PrefillTiles(128, 32, 8, 2),
    (64, True): PrefillTiles(128, 32, 8, 3),
    (128, True): PrefillTiles(128, 32, 8, 3, value_split=True),
}
PAGED_SWEEP_TILES: dict[tuple[int, bool], tuple[PrefillTiles, ...]] = {
    (64, False): (PrefillTiles(128, 64, 8, 3), PrefillTiles(128, 128, 8, 2)),
    (128, False): (PrefillTiles(128, 128, 8, 3), PrefillTiles(128, 64, 8, 3), PrefillTiles(64, 64, 4, 3)),
    (256, False): (PrefillTiles(128, 32, 8, 3),),
    (64, True): (PrefillTiles(128, 64, 8, 3, value_split=True), PrefillTiles(128, 32, 8, 2)),
    (128, True): (PrefillTiles(128, 32, 8, 2, value_split=True), PrefillTiles(64, 32, 4, 2, value_split=True)),
}
INTERPRETER_TILES = PrefillTiles(16, 16, 4, 1)  # CPU tensors (the interpreter): small tiles
MAX_GRID_Y = 65535  # CUDA's limit on grid axis 1 (the query tiles)


def covers(q: Tensor, k: Tensor, v: Tensor, lambda_full: Tensor | None, alibi_slopes: Tensor | None) -> bool:
    """Whether :func:`varlen_prefill` serves this ``varlen_attention`` call on a GPU:
    fp16/bf16, head sizes in :data:`HOPPER_TILES`, no ALiBi, a grid within CUDA's limits
    (at either table's tiles: :func:`choose_prefill_tiles`). Reads shapes and dtypes only."""
    if alibi_slopes is not None or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if k.dtype != q.dtype or v.dtype != q.dtype or k.shape[-1] != q.shape[-1]:
        return False
    key = (q.shape[-1], lambda_full is not None)
    if key not in HOPPER_TILES:
        return False
    block_m = min(HOPPER_TILES[key].block_m, PAGED_TILES[key].block_m)
    return q.shape[0] // block_m + 1 <= MAX_GRID_Y


def choose_prefill_tiles(head_size: int, differential: bool, dtype: torch.dtype, on_gpu: bool,
                         kv_tma: bool) -> PrefillTiles:
    """Tiles from shapes only: on a GPU :data:`HOPPER_TILES` when K/V go through TMA
    (``kv_tma``), else :data:`PAGED_TILES` (K/V by pointer loads: paged caches, or
    contiguous K/V without TMA); small tiles on the CPU."""
    if not on_gpu:
        return INTERPRETER_TILES
    tiles = (HOPPER_TILES if kv_tma else PAGED_TILES).get((head_size, differential))
    if tiles is None or dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"no Hopper prefill tiles for head size {head_size}, differential={differential}, "
                         f"{dtype}; check covers() first")
    return tiles


def tma_ready(tensor: Tensor, head_size: int) -> bool:
    """Whether ``tensor`` ``[T, H, D]`` can be read or written through a TMA descriptor over
    its ``[T, H * D]`` view: heads and dims dense, token stride and base address multiples
    of 16 bytes (so is every sequence's first token)."""
    size = tensor.element_size()
    if tracing_launches():  # no addresses: the offset into an (aligned) allocation
        aligned = (tensor.storage_offset() * size) % 16 == 0
    else:
        aligned = tensor.data_ptr() % 16 == 0
    return tensor.stride(2) == 1 and tensor.stride(1) == head_size and (tensor.stride(0) * size) % 16 == 0 and aligned


@functools.cache
def _has_tma(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _torch_scratch(size: int, alignment: int, stream) -> Tensor:
    """Triton's global-scratch allocator (device-side TMA descriptors live there)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_triton_allocator() -> None:
    """Set Triton's scratch allocator in this context if none is set (a kernel that builds
    tensor descriptors on the device needs 128 bytes of global scratch a program; Inductor
    sets its own before launching a traced kernel). The allocation comes from PyTorch's
    caching allocator on the current stream, so it is captured by CUDA graphs as any
    other allocation."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)


_PREFILL = CachedLauncher(prefill_kernel)
_SPECS: BoundedCache = BoundedCache()


class _Spec(NamedTuple):
    grid: tuple[int, int, int]
    int_args: tuple[int, ...]
    constexprs: dict
    options: dict


def varlen_prefill(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    lambda_full: Tensor | None = None, scale: float | None = None, causal: bool = True,
    window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
    alibi_slopes: Tensor | None = None, scale_softcap: Tensor | None = None, *,
    out: Tensor | None = None, tiles: PrefillTiles | None = None, use_tma: bool | None = None,
) -> Tensor:
    """``compiled_attn::varlen_attention`` (arguments as :func:`.attention.varlen_attention`)
    through :func:`prefill_kernel`: plain or fused differential, causal or not, windows,
    softcap (a float or the ``scale_softcap`` tensor), GQA. No ALiBi (use the unified
    kernel: :func:`covers`).

    Args:
        q: ``[Tq, Hq, D]``; k, v: ``[Tk, Hkv, D]`` (heads interleaved in pairs when
            differential); cu_seqlens_q, cu_seqlens_k: ``[B + 1]`` int32.
        lambda_full: ``[]`` or ``[Hq/2]``: differential; ``None``: plain.
        out: optional output buffer (``[Tq, Hq, D]`` or ``[Tq, Hq/2, 2D]``, q's dtype, last
            dim contiguous).
        tiles: override :func:`choose_prefill_tiles` (tests, tile sweeps; default on a GPU:
            :data:`HOPPER_TILES` with TMA, else :data:`PAGED_TILES`).
        use_tma: force TMA descriptors on (``True``, q, k, v and out must pass
            :func:`tma_ready`) or off; default: on for CUDA tensors of an sm90+ GPU that
            pass it, off for CPU tensors (the interpreter tests force it on).

    Returns:
        ``out``.
    """
    if alibi_slopes is not None:
        raise ValueError("varlen_prefill has no ALiBi: use the unified kernel (varlen_attention)")
    return _prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, None, lambda_full, scale, causal, window_left, window_right,
                    softcap, scale_softcap, out, tiles, use_tma)


def covers_paged(query: Tensor, key_cache: Tensor, value_cache: Tensor, num_seqs: int,
                 lambda_full: Tensor | None, alibi_slopes: Tensor | None) -> bool:
    """Whether :func:`paged_prefill` serves this ``paged_attention`` call on a GPU: what
    :func:`covers` takes (fp16/bf16 caches of the query's dtype, so no float8 cache; head
    sizes of :data:`PAGED_TILES`; no ALiBi), a power-of-two block size, and query runs of at
    least one query tile on average: ``T >= block_m * B`` (chunked prefill, prefix hits; a
    decode step or a batch of mostly decode rows stays on the unified kernel, which packs a
    GQA group's rows into one tile where this kernel would spend a ``block_m``-row tile per
    query head on each one-token row). Reads shapes and dtypes only."""
    if not covers(query, key_cache, value_cache, lambda_full, alibi_slopes) or key_cache.dim() != 4:
        return False
    tiles = PAGED_TILES.get((query.shape[-1], lambda_full is not None))
    block_size = key_cache.shape[1]
    num_tokens = query.shape[0]
    return (tiles is not None and block_size > 0 and block_size & (block_size - 1) == 0
            and num_tokens >= tiles.block_m * max(num_seqs, 1)
            and num_tokens // tiles.block_m + num_seqs <= MAX_GRID_Y)


def paged_prefill(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor,
    block_table: Tensor, lambda_full: Tensor | None = None, scale: float | None = None, causal: bool = True,
    window_left: int = -1, window_right: int = -1, softcap: float = 0.0, alibi_slopes: Tensor | None = None,
    scale_softcap: Tensor | None = None, *, out: Tensor | None = None, tiles: PrefillTiles | None = None,
    use_tma: bool | None = None,
) -> Tensor:
    """``compiled_attn::paged_attention`` (arguments as :func:`.attention.paged_attention`)
    through :func:`prefill_kernel` with ``PAGED``: K/V from caches ``[num_blocks,
    block_size, Hkv, D]`` (query's dtype, power-of-two ``block_size``) through
    ``block_table`` ``[B, max_blocks]`` int32, ``seq_lens[b]`` keys of sequence ``b`` (its
    new tokens included, causal bottom-right aligned). ``tiles``: default
    :data:`PAGED_TILES` on a GPU; ``use_tma``: TMA for q and out (K/V always pointer loads).
    No ALiBi, no float8 cache (:func:`covers_paged`)."""
    if alibi_slopes is not None or key_cache.dtype != query.dtype:
        raise ValueError("paged_prefill has no ALiBi and no float8 cache: use the unified kernel (paged_attention)")
    block_size = key_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"paged_prefill needs a power-of-two block size, got {block_size}")
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    return _prefill(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, lambda_full, scale, causal,
                    window_left, window_right, softcap, scale_softcap, out, tiles, use_tma)


def _prefill(q, k, v, cu_seqlens_q, kv_lens, block_table, lambda_full, scale, causal, window_left, window_right,
             softcap, scale_softcap, out, tiles, use_tma) -> Tensor:
    """Launch :func:`prefill_kernel`: contiguous ``k``/``v`` with ``kv_lens =
    cu_seqlens_k`` (``block_table is None``), or paged caches with ``kv_lens = seq_lens``."""
    paged = block_table is not None
    differential = lambda_full is not None
    num_tokens, num_heads, head_size = q.shape
    num_kv_heads = k.shape[-2]
    out = output_buffer(q, differential, out)
    if num_tokens == 0:
        return out
    if head_size & (head_size - 1) or head_size < 16:
        raise ValueError(f"the prefill kernel needs a power-of-two head size >= 16, got {head_size}")
    on_gpu = q.is_cuda
    if use_tma is None:
        tma_tensors = (q,) if paged else (q, k, v)  # paged K/V: pointer loads
        use_tma = (on_gpu and _has_tma(q.get_device()) and all(tma_ready(t, head_size) for t in tma_tensors)
                   and tma_ready(out, out.shape[-1]))
    kv_tma = use_tma and not paged
    tiles = tiles or choose_prefill_tiles(head_size, differential, q.dtype, on_gpu, kv_tma)
    scale = default_scale(scale, head_size)
    cu_seqlens_q, kv_lens = cu_seqlens_q.contiguous(), kv_lens.contiguous()
    lambda_full = None if lambda_full is None else lambda_full.contiguous()
    num_seqs = cu_seqlens_q.shape[0] - 1
    if causal:
        min_dist = 0
    else:
        min_dist = -window_right if window_right >= 0 else -UNBOUNDED
    max_dist = window_left if window_left >= 0 else UNBOUNDED
    window = window_left >= 0
    key = (q.shape, q.stride(), k.shape[1:], k.stride(), v.stride(), out.stride(), q.dtype, num_seqs,
           None if lambda_full is None else lambda_full.numel(), softcap > 0, scale_softcap is None, scale > 0,
           window, tiles, use_tma, q.get_device(),
           None if block_table is None else (block_table.shape, block_table.stride()))
    spec = _SPECS.get(key)
    if spec is None:
        constexprs = dict(
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, DIFFERENTIAL=differential,
            LAMBDA_PER_PAIR=differential and lambda_full.numel() > 1,
            SOFTCAP=softcap > 0 or scale_softcap is not None, RUNTIME_SCALARS=scale_softcap is not None,
            WINDOW_LEFT=window, USE_TMA=use_tma, VALUE_SPLIT=differential and tiles.value_split,
            BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, PAGED=paged, BLOCK_SIZE=k.shape[1] if paged else 1,
            RAW_MAX=softcap <= 0 and scale_softcap is None and scale > 0)
        units = (num_heads if tiles.value_split else num_heads // 2) if differential else num_heads
        # strides: q; k and v as (block, token or slot, head, dim) (block 0 when contiguous); out; table row
        k_strides = k.stride() if paged else (0, *k.stride())
        v_strides = v.stride() if paged else (0, *v.stride())
        spec = _SPECS[key] = _Spec(
            grid=(units, num_tokens // tiles.block_m + num_seqs, 1),
            int_args=(*q.stride(), *k_strides, *v_strides, *out.stride(), block_table.stride(0) if paged else 0),
            constexprs=constexprs, options=dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))
    if use_tma and on_gpu and not tracing_launches():
        ensure_triton_allocator()
    placeholder = q  # pointer arguments of disabled features (never read)
    args = (out, q, k, v, cu_seqlens_q, kv_lens, placeholder if block_table is None else block_table,
            placeholder if lambda_full is None else lambda_full,
            placeholder if scale_softcap is None else scale_softcap, num_seqs, float(scale), float(softcap),
            min_dist, max_dist, *spec.int_args)
    with device_guard(q):
        # The key holds every specialization (strides, flags, tiles); alignments too.
        _PREFILL((key, tuple(t.data_ptr() % 16 for t in args[:9]) if not tracing_launches() else ()),
                 spec.grid, args, q.get_device(), lambda: (spec.constexprs, spec.options))
    return out
