"""A prefill kernel for varlen attention, contiguous or paged K/V, specialised for Hopper (sm90).

The unified kernel (:mod:`.attention_kernel`) serves every batch: paged or contiguous K/V,
decode and prefill rows mixed, GQA group rows packed into one tile, split-KV. This kernel
serves long query runs only: the ``varlen_attention`` op's packed contiguous
``q``/``k``/``v`` (:func:`.prefill.varlen_prefill`) and, ``PAGED``, chunked prefill over the paged
cache of ``paged_attention`` (:func:`.prefill.paged_prefill`). It is laid out as Triton's
Hopper attention tutorial (``python/tutorials/06-fused-attention.py``, Triton 3.6) and
FlashAttention-3's forward:

* one program = ``BLOCK_M`` query tokens x one query head (plain) or one query head pair
  (differential; or, ``VALUE_SPLIT``, a pair and one of its two value heads), the query
  tile held in shared memory across the key loop (the wgmma A operand); differential with
  ``SEQUENTIAL``: the pair's two components one after the other (below);
* Q, K, V tiles read and the output tile written through TMA tensor descriptors built on
  the device per sequence (``tl.make_tensor_descriptor`` over the sequence's ``[len, H * D]``
  rows: the TMA unit zero-fills reads and clips writes past the sequence's end, so no
  load or store needs a mask), K/V software-pipelined over ``num_stages`` buffers; a
  constexpr (``USE_TMA``) swaps them for masked pointer loads and stores (unaligned or
  strided tensors, GPUs before sm90);
* the key range of a tile is cut in three: window-edge tiles (masked), interior tiles
  (every row sees every key: no mask, no ``-inf`` guard) and the diagonal / last partial
  tiles (masked), so causal prefill runs the unmasked loop except on the diagonal; with
  ``OVERLAP`` (a tile option, :class:`.prefill.PrefillTiles`) the unmasked loop leaves each
  tile's ``p v`` product in flight while the next tile's softmax runs (FlashAttention-3's
  intra-warpgroup overlap);
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
``SEQUENTIAL`` (the D 128 default): one program per pair runs component 1 over all its key
tiles with one ``[BLOCK_M, 2D]`` accumulator (``q1 k1ᵀ`` and ``p1 [v1 | v2]``), stores
``acc_1 / l_1`` in its own output rows (the output dtype), then component 2 likewise and
writes ``o_1 - lambda_j * acc_2 / l_2`` over them: per key tile and pair 6 head-size GEMM
units and 2 softmaxes (the split schedule: 8 and 4), as flash-attn 4's two calls with a
``2D`` value head and their combine, in one launch. Each component reads the K head of its
own and the whole ``[v1 | v2]`` tile (the V tile twice a program, the second time mostly
from L2). ``o_1`` is rounded to the output dtype once more than in the other schedules.

ALiBi, float8 caches, float32 and head sizes other than 64/128/256 (differential: 64/128)
stay on the unified kernel (:func:`.prefill.covers`). The op routes covered calls here when
:data:`compiled_attn.ops.triton_kernels.attention.PREFILL_KERNEL` is ``"hopper"``.

Paged prefill (``PAGED``, :func:`.prefill.paged_prefill`; the ``paged_attention`` op routes
:func:`.prefill.covers_paged` calls here when ``attention.PAGED_PREFILL_KERNEL`` is ``"hopper"``):
K/V come from caches ``[num_blocks, block_size, Hkv, D]`` through the block table; each key
tile reads its ``BLOCK_N // block_size`` block ids once (one id when a block holds the
tile) and loads its rows with pointer loads, which Triton's pipeliner turns into cp.async
copies into the shared buffers that wgmma reads (at 3+ stages the id load is pipelined a
stage ahead as well); q and out keep TMA. Masks, windows, softcap, GQA and differential
pairs as above, with ``k_len = seq_lens[b]``. Paged calls run at :data:`.prefill.PAGED_TILES`; the tiles, routing and
launchers are in :mod:`.prefill`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention_kernel import _tanh

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
        row_offsets = (row + tl.arange(0, ROWS)).to(tl.int64) * stride_t
        return _gather_rows(src, row_offsets, num_rows, head, stride_h, stride_d, ROWS, COLS, HEAD_SIZE, MASKED)


@triton.jit
def _gather_rows(base, row_offsets, num_rows, head, stride_h, stride_d, ROWS: tl.constexpr, COLS: tl.constexpr,
                 HEAD_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """``[ROWS, COLS]`` by pointer loads: row ``r`` at ``base + row_offsets[r]``, heads
    ``head ..`` (``COLS / HEAD_SIZE`` adjacent heads); rows at or past ``num_rows`` read as
    zeros when ``MASKED`` (unmasked loads must be in range)."""
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, COLS)
    ptrs = (base + row_offsets[:, None]
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
    return _gather_rows(cache, block * stride_b + slot * stride_s, keys_left, head, stride_h, stride_d, ROWS, COLS,
                        HEAD_SIZE, MASKED)


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
    m_new, l, p, alpha = _softmax(m, l, s, qk_scale, MASKED, RAW_MAX)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    return m_new, l, acc


@triton.jit
def _softmax(m, l, s, qk_scale, MASKED: tl.constexpr, RAW_MAX: tl.constexpr):
    """The softmax half of :func:`_softmax_step`: ``(m_new, l_new, p, alpha)``, where the
    accumulator's update is ``acc * alpha + p v``."""
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
    return m_new, l * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def _tile_rows(table_row, kv_len, tile, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
               MASKED: tl.constexpr):
    """``PAGED``: ``(block, slot)`` of key tile ``tile``'s rows (:func:`_paged_rows`), read
    once for its K and V; else ``(0, 0)`` (unused)."""
    if PAGED:
        start = tile * BLOCK_N
        return _paged_rows(table_row, start, kv_len - start, BLOCK_N, BLOCK_SIZE, MASKED)
    else:
        return 0, 0


@triton.jit
def _kv_tile(src, block, slot, kv_len, head, tile, stride_b, stride_t, stride_h, stride_d, COLS: tl.constexpr,
             MASKED: tl.constexpr, USE_TMA: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
             PAGED: tl.constexpr):
    """``[BLOCK_N, COLS]`` of key tile ``tile`` of K or V, heads ``head ..``: through the
    sequence's descriptor or pointer (:func:`_load_tile`), or, ``PAGED``, from the cache's
    rows at ``(block, slot)`` (:func:`_tile_rows`); rows past ``kv_len`` read as zeros when
    ``MASKED``."""
    start = tile * BLOCK_N
    if PAGED:
        return _load_paged_tile(src, block, slot, kv_len - start, head, stride_b, stride_t, stride_h, stride_d,
                                BLOCK_N, COLS, HEAD_SIZE, MASKED)
    else:
        return _load_tile(src, start, kv_len - start, head, stride_t, stride_h, stride_d, BLOCK_N, COLS, HEAD_SIZE,
                          MASKED, USE_TMA)


@triton.jit
def _mask_scores(s1, s2, tile, pos, kv_len, min_dist, max_dist, DIFFERENTIAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Scores of key tile ``tile`` with ``-inf`` where a key is past ``kv_len`` or outside
    ``min_dist <= pos - key <= max_dist``."""
    kpos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    in_seq = kpos < kv_len
    dist = pos[:, None] - kpos[None, :]
    visible = (dist >= min_dist) & (dist <= max_dist) & in_seq[None, :]
    s1 = tl.where(visible, s1, float("-inf"))
    if DIFFERENTIAL:
        s2 = tl.where(visible, s2, float("-inf"))
    return s1, s2


@triton.jit
def _key_steps(m1, l1, acc1, m2, l2, acc2, q1, q2, k_src, v_src, table_row, kv_len, kv_head, v_head,
               tile_begin, tile_end, pos, qk_scale, scale, softcap, min_dist, max_dist,
               stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
               DIFFERENTIAL: tl.constexpr, MASKED: tl.constexpr, SOFTCAP: tl.constexpr,
               RUNTIME_SCALARS: tl.constexpr, USE_TMA: tl.constexpr, HEAD_SIZE: tl.constexpr,
               VALUE_COLS: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
               RAW_MAX: tl.constexpr, OVERLAP: tl.constexpr):
    """Key tiles ``[tile_begin, tile_end)`` of one sequence (``k_src``/``v_src`` start there;
    ``PAGED``: they are the caches and ``table_row`` the sequence's block-table row, and
    ``stride_kt``/``stride_vt`` the slot strides): one online-softmax state (plain) or two
    over the same loaded tiles (differential); values ``[BLOCK_N, VALUE_COLS]`` from head
    ``v_head`` on.

    ``OVERLAP``: the ``p v`` product of tile ``j - 1`` is left in flight while the softmax
    of tile ``j`` runs (FlashAttention-3's intra-warpgroup overlap, Shah et al. 2024, arXiv
    2407.08608, §3.2). Each step computes the scores of ``j`` (Triton waits for every
    pending wgmma after a dot whose result the loop reads), issues ``acc * alpha_{j-1} +
    p_{j-1} v_{j-1}``, then runs the softmax of ``j``; the first step's product is empty
    (``p = 0``) and the last one follows the loop, unconditionally (no ``if`` around the
    loop: ptxas serializes every wgmma of the kernel when a branch joins accumulators), so
    with no tile it adds ``0 x`` the values of tile ``tile_begin`` read masked (zeros past
    the keys, never a foreign block's rows, which may hold NaN)."""
    if OVERLAP:
        p1 = tl.zeros([pos.shape[0], BLOCK_N], tl.float32)
        alpha1 = tl.full([pos.shape[0]], 1.0, tl.float32)
        p2, alpha2 = p1, alpha1
        block, slot = _tile_rows(table_row, kv_len, tile_begin, BLOCK_N, PAGED, BLOCK_SIZE, True)
        for tile in tl.range(tile_begin, tile_end):
            prev_block, prev_slot = block, slot
            block, slot = _tile_rows(table_row, kv_len, tile, BLOCK_N, PAGED, BLOCK_SIZE, MASKED)
            s1 = _scores(q1, _kv_tile(k_src, block, slot, kv_len, kv_head, tile, stride_kb, stride_kt, stride_kh,
                                      stride_kd, HEAD_SIZE, MASKED, USE_TMA, HEAD_SIZE, BLOCK_N, PAGED),
                         qk_scale, scale, softcap, SOFTCAP, RUNTIME_SCALARS, RAW_MAX)
            s2 = s1
            if DIFFERENTIAL:
                s2 = _scores(q2, _kv_tile(k_src, block, slot, kv_len, kv_head + 1, tile, stride_kb, stride_kt,
                                          stride_kh, stride_kd, HEAD_SIZE, MASKED, USE_TMA, HEAD_SIZE, BLOCK_N, PAGED),
                             qk_scale, scale, softcap, SOFTCAP, RUNTIME_SCALARS, RAW_MAX)
            if MASKED:
                s1, s2 = _mask_scores(s1, s2, tile, pos, kv_len, min_dist, max_dist, DIFFERENTIAL, BLOCK_N)
            v = _kv_tile(v_src, prev_block, prev_slot, kv_len, v_head, tl.maximum(tile - 1, tile_begin), stride_vb,
                         stride_vt, stride_vh, stride_vd, VALUE_COLS, MASKED, USE_TMA, HEAD_SIZE, BLOCK_N, PAGED)
            acc1 = tl.dot(p1.to(v.dtype), v, acc1 * alpha1[:, None], input_precision="ieee")
            if DIFFERENTIAL:
                acc2 = tl.dot(p2.to(v.dtype), v, acc2 * alpha2[:, None], input_precision="ieee")
            m1, l1, p1, alpha1 = _softmax(m1, l1, s1, qk_scale, MASKED, RAW_MAX)
            if DIFFERENTIAL:
                m2, l2, p2, alpha2 = _softmax(m2, l2, s2, qk_scale, MASKED, RAW_MAX)
        v = _kv_tile(v_src, block, slot, kv_len, v_head, tl.maximum(tile_end - 1, tile_begin), stride_vb, stride_vt,
                     stride_vh, stride_vd, VALUE_COLS, True, USE_TMA, HEAD_SIZE, BLOCK_N, PAGED)
        acc1 = tl.dot(p1.to(v.dtype), v, acc1 * alpha1[:, None], input_precision="ieee")
        if DIFFERENTIAL:
            acc2 = tl.dot(p2.to(v.dtype), v, acc2 * alpha2[:, None], input_precision="ieee")
    else:
        for tile in tl.range(tile_begin, tile_end):
            block, slot = _tile_rows(table_row, kv_len, tile, BLOCK_N, PAGED, BLOCK_SIZE, MASKED)
            k1 = _kv_tile(k_src, block, slot, kv_len, kv_head, tile, stride_kb, stride_kt, stride_kh, stride_kd,
                          HEAD_SIZE, MASKED, USE_TMA, HEAD_SIZE, BLOCK_N, PAGED)
            v = _kv_tile(v_src, block, slot, kv_len, v_head, tile, stride_vb, stride_vt, stride_vh, stride_vd,
                         VALUE_COLS, MASKED, USE_TMA, HEAD_SIZE, BLOCK_N, PAGED)
            s1 = _scores(q1, k1, qk_scale, scale, softcap, SOFTCAP, RUNTIME_SCALARS, RAW_MAX)
            s2 = s1
            if DIFFERENTIAL:
                k2 = _kv_tile(k_src, block, slot, kv_len, kv_head + 1, tile, stride_kb, stride_kt, stride_kh,
                              stride_kd, HEAD_SIZE, MASKED, USE_TMA, HEAD_SIZE, BLOCK_N, PAGED)
                s2 = _scores(q2, k2, qk_scale, scale, softcap, SOFTCAP, RUNTIME_SCALARS, RAW_MAX)
            if MASKED:
                s1, s2 = _mask_scores(s1, s2, tile, pos, kv_len, min_dist, max_dist, DIFFERENTIAL, BLOCK_N)
            m1, l1, acc1 = _softmax_step(m1, l1, acc1, s1, v, qk_scale, MASKED, RAW_MAX)
            if DIFFERENTIAL:
                m2, l2, acc2 = _softmax_step(m2, l2, acc2, s2, v, qk_scale, MASKED, RAW_MAX)
    return m1, l1, acc1, m2, l2, acc2


@triton.jit
def _key_ranges(q1, q2, k_src, v_src, table_row, kv_len, kv_head, v_head, tile_lo, mid_lo, mid_hi, tile_hi, pos,
                qk_scale, scale, softcap, min_dist, max_dist,
                stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
                DIFFERENTIAL: tl.constexpr, SOFTCAP: tl.constexpr, RUNTIME_SCALARS: tl.constexpr,
                USE_TMA: tl.constexpr, HEAD_SIZE: tl.constexpr, VALUE_COLS: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr, RAW_MAX: tl.constexpr,
                OVERLAP: tl.constexpr, WINDOW_LEFT: tl.constexpr):
    """``(m1, l1, acc1, m2, l2, acc2)`` of one query tile over all the key tiles it sees
    (:func:`_key_steps` from a fresh state): masked window-edge tiles ``[tile_lo, mid_lo)``
    (``WINDOW_LEFT`` only), unmasked interior tiles ``[mid_lo, mid_hi)`` (``OVERLAP`` applies
    here), masked diagonal / last tiles ``[mid_hi, tile_hi)``. Plain: the second state is a
    placeholder (never read)."""
    m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l1 = tl.zeros([BLOCK_M], tl.float32)
    acc1 = tl.zeros([BLOCK_M, VALUE_COLS], tl.float32)
    m2, l2, acc2 = m1, l1, acc1
    if WINDOW_LEFT:
        m1, l1, acc1, m2, l2, acc2 = _key_steps(
            m1, l1, acc1, m2, l2, acc2, q1, q2, k_src, v_src, table_row, kv_len, kv_head, v_head, tile_lo, mid_lo,
            pos, qk_scale, scale, softcap, min_dist, max_dist, stride_kb, stride_kt, stride_kh, stride_kd,
            stride_vb, stride_vt, stride_vh, stride_vd, DIFFERENTIAL, True, SOFTCAP, RUNTIME_SCALARS, USE_TMA,
            HEAD_SIZE, VALUE_COLS, BLOCK_N, PAGED, BLOCK_SIZE, RAW_MAX, False)
    m1, l1, acc1, m2, l2, acc2 = _key_steps(
        m1, l1, acc1, m2, l2, acc2, q1, q2, k_src, v_src, table_row, kv_len, kv_head, v_head, mid_lo, mid_hi,
        pos, qk_scale, scale, softcap, min_dist, max_dist, stride_kb, stride_kt, stride_kh, stride_kd,
        stride_vb, stride_vt, stride_vh, stride_vd, DIFFERENTIAL, False, SOFTCAP, RUNTIME_SCALARS, USE_TMA,
        HEAD_SIZE, VALUE_COLS, BLOCK_N, PAGED, BLOCK_SIZE, RAW_MAX, OVERLAP)
    return _key_steps(
        m1, l1, acc1, m2, l2, acc2, q1, q2, k_src, v_src, table_row, kv_len, kv_head, v_head, mid_hi, tile_hi,
        pos, qk_scale, scale, softcap, min_dist, max_dist, stride_kb, stride_kt, stride_kh, stride_kd,
        stride_vb, stride_vt, stride_vh, stride_vd, DIFFERENTIAL, True, SOFTCAP, RUNTIME_SCALARS, USE_TMA,
        HEAD_SIZE, VALUE_COLS, BLOCK_N, PAGED, BLOCK_SIZE, RAW_MAX, False)


@triton.jit
def _normalize(acc, l):
    """``acc / l`` per row, zeros for rows that saw no key (``l == 0``)."""
    return tl.where(l[:, None] > 0, acc / tl.where(l > 0, l, 1.0)[:, None], 0.0)


@triton.jit
def _out_ptrs(o_seq, q_first, queries_left, head_offset, col, stride_ot, stride_od, ROWS: tl.constexpr,
              COLS: tl.constexpr):
    """Pointers ``[ROWS, COLS]`` to the output rows ``q_first ..`` of a sequence (``o_seq``
    its first row), columns ``col ..`` of the head at ``head_offset``; and the mask of rows
    before ``queries_left``."""
    rows = tl.arange(0, ROWS)
    ptrs = (o_seq + (q_first + rows).to(tl.int64)[:, None] * stride_ot + head_offset
            + (col + tl.arange(0, COLS))[None, :] * stride_od)
    return ptrs, (rows < queries_left)[:, None]


@triton.jit
def _store_out(o_seq, value, q_first, queries_left, head_offset, col, stride_ot, stride_od, ROWS: tl.constexpr,
               COLS: tl.constexpr):
    """Pointer store of an output tile (:func:`_out_ptrs`), rows past the queries skipped."""
    ptrs, rows = _out_ptrs(o_seq, q_first, queries_left, head_offset, col, stride_ot, stride_od, ROWS, COLS)
    tl.store(ptrs, value, mask=rows)


@triton.jit
def _load_out(o_seq, q_first, queries_left, head_offset, col, stride_ot, stride_od, ROWS: tl.constexpr,
              COLS: tl.constexpr):
    """The output tile :func:`_store_out` wrote, as float32 (zeros past the queries)."""
    ptrs, rows = _out_ptrs(o_seq, q_first, queries_left, head_offset, col, stride_ot, stride_od, ROWS, COLS)
    return tl.load(ptrs, mask=rows, other=0.0).to(tl.float32)


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
    PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr, RAW_MAX: tl.constexpr, OVERLAP: tl.constexpr,
    SEQUENTIAL: tl.constexpr,
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
        SEQUENTIAL: differential only, not with ``VALUE_SPLIT``: the two components one
            after the other over ``[v1 | v2]``, component 1 parked in the output rows
            (pointer stores and loads, a CTA barrier between; the output store then goes
            through pointers too, never mixing TMA and pointer writes of one address).
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
    # address as written (it would copy cu_seqlens_q around each launch). At most B - 1: tokens
    # past cu_seqlens_q[B] (the op's contract rules them out) land in sequence B - 1's empty
    # tiles, never past the metadata.
    seq: tl.int32 = 0
    right = num_seqs - 1
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

    q1 = _load_tile(q_src, q_first, queries_left, q_head, stride_qt, stride_qh, stride_qd,
                    BLOCK_M, HEAD_SIZE, HEAD_SIZE, True, USE_TMA)
    if DIFFERENTIAL and not SEQUENTIAL:  # both components over each loaded key tile
        q2 = _load_tile(q_src, q_first, queries_left, q_head + 1, stride_qt, stride_qh, stride_qd,
                        BLOCK_M, HEAD_SIZE, HEAD_SIZE, True, USE_TMA)
    else:  # placeholder (never read)
        q2 = q1
    m1, l1, acc1, m2, l2, acc2 = _key_ranges(
        q1, q2, k_src, v_src, table_row, kv_len, kv_head, v_head, tile_lo, mid_lo, mid_hi, tile_hi, pos,
        qk_scale, scale, softcap, min_dist, max_dist, stride_kb, stride_kt, stride_kh, stride_kd,
        stride_vb, stride_vt, stride_vh, stride_vd, DIFFERENTIAL and not SEQUENTIAL, SOFTCAP, RUNTIME_SCALARS,
        USE_TMA, HEAD_SIZE, VALUE_COLS, BLOCK_M, BLOCK_N, PAGED, BLOCK_SIZE, RAW_MAX, OVERLAP, WINDOW_LEFT)
    result = _normalize(acc1, l1)
    if SEQUENTIAL:  # component 1's [v1 | v2] result waits in this program's output rows
        _store_out(o_seq, result.to(out_ptr.dtype.element_ty), q_first, queries_left, unit * stride_oh,
                   half * HEAD_SIZE, stride_ot, stride_od, BLOCK_M, VALUE_COLS)
        q2 = _load_tile(q_src, q_first, queries_left, q_head + 1, stride_qt, stride_qh, stride_qd,
                        BLOCK_M, HEAD_SIZE, HEAD_SIZE, True, USE_TMA)
        m2, l2, acc2, _, _, _ = _key_ranges(
            q2, q2, k_src, v_src, table_row, kv_len, kv_head + 1, v_head, tile_lo, mid_lo, mid_hi, tile_hi, pos,
            qk_scale, scale, softcap, min_dist, max_dist, stride_kb, stride_kt, stride_kh, stride_kd,
            stride_vb, stride_vt, stride_vh, stride_vd, False, SOFTCAP, RUNTIME_SCALARS,
            USE_TMA, HEAD_SIZE, VALUE_COLS, BLOCK_M, BLOCK_N, PAGED, BLOCK_SIZE, RAW_MAX, OVERLAP, WINDOW_LEFT)
        # CTA barriers: every thread's part of component 1 stored before any is read back, and
        # read back before any is overwritten (Triton 3.6 keeps one layout for the three
        # accesses, so each thread touches its own elements; the barriers hold for any layout)
        tl.debug_barrier()
        result = _load_out(o_seq, q_first, queries_left, unit * stride_oh, half * HEAD_SIZE, stride_ot, stride_od,
                           BLOCK_M, VALUE_COLS)
        tl.debug_barrier()
    if DIFFERENTIAL:
        if LAMBDA_PER_PAIR:
            lam = tl.load(lambda_ptr + unit).to(tl.float32)
        else:
            lam = tl.load(lambda_ptr).to(tl.float32)
        result = result - lam * _normalize(acc2, l2)
    result = result.to(out_ptr.dtype.element_ty)
    if USE_TMA and not SEQUENTIAL:  # the descriptor ends at the sequence's last query: rows past it are clipped
        OUT_COLS: tl.constexpr = 2 * HEAD_SIZE if DIFFERENTIAL else HEAD_SIZE
        OUT_HEADS: tl.constexpr = NUM_HEADS // 2 if DIFFERENTIAL else NUM_HEADS
        o_desc = tl.make_tensor_descriptor(o_seq, shape=[q_len, OUT_HEADS * OUT_COLS], strides=[stride_ot, 1],
                                           block_shape=[BLOCK_M, VALUE_COLS])
        o_desc.store([q_first, unit * OUT_COLS + half * HEAD_SIZE], result)
    else:  # (SEQUENTIAL: the rows that held component 1, rewritten through the same pointers)
        _store_out(o_seq, result, q_first, queries_left, unit * stride_oh, half * HEAD_SIZE, stride_ot, stride_od,
                   BLOCK_M, VALUE_COLS)
