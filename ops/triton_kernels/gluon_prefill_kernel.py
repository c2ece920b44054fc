"""A warp-specialized prefill kernel for Hopper (sm90), written in Gluon.

FlashAttention-3's forward (Shah et al. 2024, arXiv 2407.08608, §3.1: producer/consumer warp
specialization) on Triton's Gluon dialect (``triton.experimental.gluon``, Triton 3.6), where
the Triton-language kernel of :mod:`.prefill_kernel` cannot go: Triton 3.6 schedules every
warp of a program through the same instruction stream, so its tensor cores idle while the
softmax runs. Here each program holds three partitions:

* a **producer** (the default partition, one warpgroup: TMA copies are issued by one
  thread) that streams a query tile and its key/value tiles into shared memory through
  TMA, ``STAGES`` key/value buffers deep, each buffer's arrival signalled on an mbarrier;
* two **consumers** (one warpgroup each, 240 registers a thread), consumer ``c`` owning
  query rows ``[c * BLOCK_M, (c + 1) * BLOCK_M)`` of the ``2 * BLOCK_M``-row tile: per key
  tile ``s = q kᵀ`` (wgmma from shared memory), the online softmax in registers, ``o += p v``
  (wgmma, ``p`` from registers), then the key/value buffer is released. While one consumer
  runs its softmax, the other's wgmma keeps the tensor cores busy (FlashAttention-3's
  ping-pong, left to the warp schedulers).

The program is **persistent**: ``min(work tiles, multiprocessors)`` programs walk the work
tiles ``pid, pid + programs, ...``, a tile being one query head and ``2 * BLOCK_M`` query
tokens of one sequence, units (heads) fastest and query tiles reversed, so the heaviest
(causal: last) tiles start first (:func:`_locate`; the varlen bound and binary search of
:mod:`.prefill_kernel`). The producer loads the next tile's queries while the consumers
finish the current one (two query buffers).

Shapes (token-major, as ``flash_attn_varlen_func``)::

    q        [Tq, Hq, D]   through q_desc, a TMA descriptor over [Tq, Hq * D], box [2 BLOCK_M, D]
    k, v     contiguous:   [Tk, Hkv, D] through descriptors over [Tk, Hkv * D], box [BLOCK_N, D]
             PAGED:        caches [num_blocks, BLOCK_SIZE, Hkv, D] through descriptors over
                           [num_blocks * BLOCK_SIZE, Hkv * D], box [min(BLOCK_SIZE, BLOCK_N), D]
    cu_seqlens_q [B + 1] int32; kv_lens: cu_seqlens_k [B + 1] (contiguous) or seq_lens [B] (PAGED)
    block_table  [B, max_blocks] int32 (PAGED)
    out      [Tq, Hq, D], q's dtype, heads and dims dense

Key tiles of a query tile run from the diagonal down (FlashAttention-3's order): the tiles
some row of a consumer cannot see whole (the diagonal band, the last partial tile) are
masked, the interior ones are not. Keys past a sequence's end are masked in the scores, so
the rows TMA brings in past it (the next sequence's, or zeros past the tensor) never count;
values there would (``0 * NaN``), so the tile holding a sequence's last key takes its values
by masked pointer loads (zeros past the end) that the producer stores into the buffer
(:func:`_gather_values`). PAGED: a key tile's boxes are its blocks (one TMA copy each, the
block id read once), boxes past the sequence read from past the cache (zeros).

Math: the online softmax of FlashAttention-2 (Dao 2023, arXiv 2307.08691, algorithm 1) in
base 2, the row max over unscaled scores and ``scale * log2(e)`` in the exponent's FMA
(``qk_scale > 0``); masks as ``flash_attn_varlen_func`` (bottom-right aligned: query ``i``
sits at key position ``p = i + k_len - q_len`` and sees key ``j`` when ``p - j >= min_dist``:
causal 0, else ``-window_right`` or unbounded); rows that see no key are zeros. No softcap,
no left window, no ALiBi, plain attention only: :mod:`.gluon_prefill` routes the rest to
:mod:`.prefill_kernel`.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

# Triton 3.6 (the H200's) names the TMA load async_copy_global_to_shared; 3.9 async_load
_tma_load = getattr(tma, "async_load", tma.async_copy_global_to_shared)
CONSUMER_REGISTERS = gl.constexpr(240)  # a consumer thread's registers (FlashAttention-3's); the producer keeps the rest (32)


@gluon.constexpr_function
def _mma_layout(cols):
    """The wgmma accumulator layout of one warpgroup over ``[64 * k, cols]`` (bf16/fp16
    operands: instruction k 16)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cols, 16])


@gluon.constexpr_function
def _gather_layout(head_size):
    """Rows of ``head_size`` 16-bit values over one warpgroup, 16 bytes a thread."""
    cols = head_size // 8
    return gl.BlockedLayout([1, 8], [32 // cols, cols], [4, 1], [1, 0])


@gluon.jit
def _locate(tile, cu_seqlens_q_ptr, kv_lens_ptr, num_seqs, num_q_tiles, UNITS: gl.constexpr,
            TILE_M: gl.constexpr, PAGED: gl.constexpr):
    """``(unit, seq, q_start, q_len, q_first, kv_start, kv_len)`` of work tile ``tile``:
    unit (query head) ``tile % UNITS``; query tile ``num_q_tiles - 1 - tile // UNITS`` of the
    varlen bound, which sequence ``seq`` owns from ``cu_seqlens_q[seq] // TILE_M + seq`` on
    (found by binary search); its first query row ``q_first`` (``>= q_len``: an empty tile)."""
    unit = tile % UNITS
    q_tile = num_q_tiles - 1 - tile // UNITS
    seq = 0
    right = num_seqs
    while seq < right:
        mid = (seq + right + 1) // 2
        if gl.load(cu_seqlens_q_ptr + mid) // TILE_M + mid <= q_tile:
            seq = mid
        else:
            right = mid - 1
    q_start = gl.load(cu_seqlens_q_ptr + seq)
    q_len = gl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_first = (q_tile - q_start // TILE_M - seq) * TILE_M
    if PAGED:
        kv_start = 0
        kv_len = gl.load(kv_lens_ptr + seq)
    else:
        kv_start = gl.load(kv_lens_ptr + seq)
        kv_len = gl.load(kv_lens_ptr + seq + 1) - kv_start
    return unit, seq, q_start, q_len, q_first, kv_start, kv_len


@gluon.jit
def _visible_end(first_row, last_row, q_len, kv_len, min_dist, BLOCK_N: gl.constexpr):
    """``(tile_hi, full_hi)``: the key tiles ``[0, tile_hi)`` that rows ``first_row ..
    last_row`` (clipped to the queries) see some key of, and the keys ``[0, full_hi)`` that
    every one of them sees."""
    shift = kv_len - q_len
    kv_hi = gl.minimum(gl.maximum(gl.minimum(last_row, q_len - 1) + shift - min_dist + 1, 0), kv_len)
    full_hi = gl.maximum(gl.minimum(first_row + shift - min_dist + 1, kv_len), 0)
    return gl.cdiv(kv_hi, BLOCK_N), full_hi


# ----------------------------------------------------------------------------- producer
@gluon.jit
def _load_kv_tile(desc, smem, bar, table_row, kv_start, kv_len, start, col, cache_rows, PAGED: gl.constexpr,
                  BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_SIZE: gl.constexpr):
    """TMA copies of keys ``start .. start + BLOCK_N`` (columns ``col ..``) into ``smem``,
    signalled on ``bar``: one box, or (PAGED) one box a block, its id read once; boxes past
    the sequence's keys copy rows past the cache (``cache_rows``: zeros)."""
    mbarrier.expect(bar, BLOCK_N * HEAD_SIZE * desc.dtype.primitive_bitwidth // 8)
    if PAGED:
        BOX: gl.constexpr = BLOCK_SIZE if BLOCK_SIZE < BLOCK_N else BLOCK_N
        for i in gl.static_range(BLOCK_N // BOX):
            key = start + i * BOX
            inside = key < kv_len
            block = gl.load(table_row + key // BLOCK_SIZE, mask=inside, other=0)
            row = gl.where(inside, block * BLOCK_SIZE + key % BLOCK_SIZE, cache_rows)
            _tma_load(desc, [row, col], bar, smem.slice(i * BOX, BOX))
    else:
        _tma_load(desc, [kv_start + start, col], bar, smem)


@gluon.jit
def _gather_values(v_ptr, smem, bar, table_row, kv_start, kv_len, start, col, stride_vb, stride_vt,
                   PAGED: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_SIZE: gl.constexpr):
    """The values of keys ``start .. start + BLOCK_N`` (columns ``col ..``) by masked pointer
    loads, zeros past the sequence's ``kv_len`` keys, stored into ``smem``; then ``bar`` is
    arrived on (the tile that holds the sequence's last key: no foreign row reaches ``p v``)."""
    layout: gl.constexpr = _gather_layout(HEAD_SIZE)
    CHUNK: gl.constexpr = 4 * 32 // (HEAD_SIZE // 8)  # rows a load of the warpgroup covers
    cols = col + gl.arange(0, HEAD_SIZE, layout=gl.SliceLayout(0, layout))
    for r in gl.static_range(0, BLOCK_N, CHUNK):
        key = start + r + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
        inside = key < kv_len
        if PAGED:
            block = gl.load(table_row + key // BLOCK_SIZE, mask=inside, other=0).to(gl.int64)
            rows = block * stride_vb + (key % BLOCK_SIZE).to(gl.int64) * stride_vt
        else:
            rows = (kv_start + key).to(gl.int64) * stride_vt
        values = gl.load(v_ptr + rows[:, None] + cols[None, :], mask=inside[:, None], other=0.0)
        smem.slice(r, CHUNK).store(values)
    fence_async_shared()  # the stores, before wgmma (the async proxy) reads them
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, v_ptr, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty,
              v_empty, cu_seqlens_q_ptr, kv_lens_ptr, block_table_ptr, num_seqs, num_q_tiles, min_dist, cache_rows,
              stride_vb, stride_vt, stride_bt,
              NUM_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr, HEAD_SIZE: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PAGED: gl.constexpr, BLOCK_SIZE: gl.constexpr):
    """Streams each work tile's queries and key/value tiles (diagonal first) into the
    buffers, waiting for both consumers to release a buffer (keys and values apart: a
    consumer is done with a tile's keys one step before its values) before refilling it."""
    TILE_M: gl.constexpr = 2 * BLOCK_M
    GROUP: gl.constexpr = NUM_HEADS // NUM_KV_HEADS
    q_count = 0
    kv_count = 0
    for tile in range(gl.program_id(0), NUM_HEADS * num_q_tiles, gl.num_programs(0)):
        unit, seq, q_start, q_len, q_first, kv_start, kv_len = _locate(
            tile, cu_seqlens_q_ptr, kv_lens_ptr, num_seqs, num_q_tiles, NUM_HEADS, TILE_M, PAGED)
        if q_first < q_len:
            qi = q_count % 2
            mbarrier.wait(q_empty.index(qi), ((q_count // 2) & 1) ^ 1)
            mbarrier.expect(q_ready.index(qi), q_desc.block_type.nbytes)
            _tma_load(q_desc, [q_start + q_first, unit * HEAD_SIZE], q_ready.index(qi), q_bufs.index(qi))
            q_count += 1
            tile_hi, _ = _visible_end(q_first, q_first + TILE_M - 1, q_len, kv_len, min_dist, BLOCK_N)
            col = unit // GROUP * HEAD_SIZE
            table_row = block_table_ptr + seq * stride_bt
            for step in range(tile_hi):
                start = (tile_hi - 1 - step) * BLOCK_N
                s = kv_count % STAGES
                phase = ((kv_count // STAGES) & 1) ^ 1
                mbarrier.wait(k_empty.index(s), phase)
                _load_kv_tile(k_desc, k_bufs.index(s), k_ready.index(s), table_row, kv_start, kv_len, start, col,
                              cache_rows, PAGED, BLOCK_SIZE, BLOCK_N, HEAD_SIZE)
                mbarrier.wait(v_empty.index(s), phase)
                if start + BLOCK_N > kv_len:
                    _gather_values(v_ptr, v_bufs.index(s), v_ready.index(s), table_row, kv_start, kv_len, start, col,
                                   stride_vb, stride_vt, PAGED, BLOCK_SIZE, BLOCK_N, HEAD_SIZE)
                else:
                    _load_kv_tile(v_desc, v_bufs.index(s), v_ready.index(s), table_row, kv_start, kv_len, start, col,
                                  cache_rows, PAGED, BLOCK_SIZE, BLOCK_N, HEAD_SIZE)
                kv_count += 1


# ----------------------------------------------------------------------------- consumers
@gluon.jit
def _await_turn(turns, turn_count, CONSUMER: gl.constexpr, PINGPONG: gl.constexpr):
    """PINGPONG (FlashAttention-3's inter-warpgroup schedule, §3.1): wait until the other
    consumer has issued its wgmma of the previous turn (consumer 0 goes first)."""
    if PINGPONG:
        mbarrier.wait(turns.index(CONSUMER), (turn_count & 1) ^ (1 - CONSUMER))


@gluon.jit
def _pass_turn(turns, CONSUMER: gl.constexpr, PINGPONG: gl.constexpr):
    """PINGPONG: let the other consumer issue its wgmma (this one's are issued)."""
    if PINGPONG:
        mbarrier.arrive(turns.index(1 - CONSUMER), count=1)


@gluon.jit
def _issue_scores(q_smem, k_smem, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """``q kᵀ`` (unscaled), issued asynchronously (wait with ``warpgroup_mma_wait``)."""
    return warpgroup_mma(q_smem, k_smem.permute((1, 0)),
                         gl.zeros([BLOCK_M, BLOCK_N], gl.float32, _mma_layout(BLOCK_N)), use_acc=False, is_async=True)


@gluon.jit
def _softmax(s, m, l, start, pos, kv_len, min_dist, qk_scale, MASKED: gl.constexpr, BLOCK_N: gl.constexpr):
    """One online-softmax step over the scores ``s`` of the key tile from key ``start``,
    masked when ``MASKED`` (keys past ``kv_len`` or unseen from positions ``pos``):
    ``(m_new, l_new, p, alpha)``; the accumulator's update is ``acc * alpha + p v``."""
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    if MASKED:
        keys = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = ((pos[:, None] - keys[None, :]) >= min_dist) & (keys < kv_len)[None, :]
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m, gl.max(s, axis=1))
    if MASKED:  # a row that has seen no key yet keeps max -inf: exponents against 0
        m_new_scaled = gl.where(m_new == float("-inf"), 0.0, m_new) * qk_scale
    else:
        m_new_scaled = m_new * qk_scale
    p = gl.exp2(s * qk_scale - m_new_scaled[:, None])
    alpha = gl.exp2(m * qk_scale - m_new_scaled)
    return m_new, l * alpha + gl.sum(p, axis=1), p, alpha


@gluon.jit
def _rescale(acc, alpha):
    """``acc * alpha`` per row (``alpha`` in the score rows' layout)."""
    return acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]


@gluon.jit
def _as_operand(p, dtype: gl.constexpr, HEAD_SIZE: gl.constexpr):
    """The probabilities as the register A operand of ``p v`` (a no-op layout change: the
    wgmma accumulator's fragment is the next wgmma's A fragment)."""
    return gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=_mma_layout(HEAD_SIZE),
                                                              k_width=2))


@gluon.jit
def _plain_step(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns, m, l, acc, kv_count, turn_count,
                start, pos, kv_len, min_dist, qk_scale, CONSUMER: gl.constexpr, PINGPONG: gl.constexpr,
                MASKED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_SIZE: gl.constexpr,
                STAGES: gl.constexpr):
    """A key tile without overlap: scores, softmax, ``p v``, each waited for in turn."""
    s = kv_count % STAGES
    phase = (kv_count // STAGES) & 1
    mbarrier.wait(k_ready.index(s), phase)
    _await_turn(turns, turn_count, CONSUMER, PINGPONG)
    scores = _issue_scores(q_smem, k_bufs.index(s), BLOCK_M, BLOCK_N)
    _pass_turn(turns, CONSUMER, PINGPONG)
    scores = warpgroup_mma_wait(0, deps=(scores,))
    mbarrier.arrive(k_empty.index(s), count=1)
    m, l, p, alpha = _softmax(scores, m, l, start, pos, kv_len, min_dist, qk_scale, MASKED, BLOCK_N)
    acc = _rescale(acc, alpha)
    mbarrier.wait(v_ready.index(s), phase)
    _await_turn(turns, turn_count + 1, CONSUMER, PINGPONG)
    acc = warpgroup_mma(_as_operand(p, v_bufs.dtype, HEAD_SIZE), v_bufs.index(s), acc, is_async=True)
    _pass_turn(turns, CONSUMER, PINGPONG)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(v_empty.index(s), count=1)
    return m, l, acc, kv_count + 1, turn_count + 2


@gluon.jit
def _overlapped_step(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns, m, l, acc, p, kv_count,
                     turn_count, start, pos, kv_len, min_dist, qk_scale, CONSUMER: gl.constexpr,
                     PINGPONG: gl.constexpr, MASKED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     HEAD_SIZE: gl.constexpr, STAGES: gl.constexpr):
    """FlashAttention-3's intra-warpgroup overlap (§3.2): with the previous key tile's
    probabilities ``p`` (buffer ``kv_count - 1``), issue this tile's ``q kᵀ`` and then the
    previous tile's ``p v``; the scores retire first (wgmma groups retire in order), so this
    tile's softmax runs while ``p v`` is still on the tensor cores."""
    s = kv_count % STAGES
    phase = (kv_count // STAGES) & 1
    prev = (kv_count - 1) % STAGES
    prev_phase = ((kv_count - 1) // STAGES) & 1
    mbarrier.wait(k_ready.index(s), phase)
    _await_turn(turns, turn_count, CONSUMER, PINGPONG)
    scores = _issue_scores(q_smem, k_bufs.index(s), BLOCK_M, BLOCK_N)
    mbarrier.wait(v_ready.index(prev), prev_phase)
    acc = warpgroup_mma(p, v_bufs.index(prev), acc, is_async=True)
    _pass_turn(turns, CONSUMER, PINGPONG)
    scores = warpgroup_mma_wait(1, deps=(scores,))
    mbarrier.arrive(k_empty.index(s), count=1)
    m, l, p_new, alpha = _softmax(scores, m, l, start, pos, kv_len, min_dist, qk_scale, MASKED, BLOCK_N)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(v_empty.index(prev), count=1)
    return m, l, _rescale(acc, alpha), _as_operand(p_new, v_bufs.dtype, HEAD_SIZE), kv_count + 1, turn_count + 1


@gluon.jit
def _consumer(out_ptr, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turns,
              cu_seqlens_q_ptr, kv_lens_ptr, num_seqs, num_q_tiles, qk_scale, min_dist, stride_ot,
              CONSUMER: gl.constexpr, NUM_HEADS: gl.constexpr, HEAD_SIZE: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PAGED: gl.constexpr, OVERLAP: gl.constexpr,
              PINGPONG: gl.constexpr):
    """Rows ``[CONSUMER * BLOCK_M, (CONSUMER + 1) * BLOCK_M)`` of each work tile: the masked
    key tiles (diagonal band, last partial tile), then the interior ones, then the
    normalized output rows (masked pointer stores). ``OVERLAP``: :func:`_overlapped_step`
    (the first tile, always masked, without ``p v``; the last tile's ``p v`` after the
    loops); else :func:`_plain_step`."""
    TILE_M: gl.constexpr = 2 * BLOCK_M
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(HEAD_SIZE)
    q_count = 0
    kv_count = 0
    turn_count = 0
    for tile in range(gl.program_id(0), NUM_HEADS * num_q_tiles, gl.num_programs(0)):
        unit, seq, q_start, q_len, q_first, kv_start, kv_len = _locate(
            tile, cu_seqlens_q_ptr, kv_lens_ptr, num_seqs, num_q_tiles, NUM_HEADS, TILE_M, PAGED)
        if q_first < q_len:
            qi = q_count % 2
            mbarrier.wait(q_ready.index(qi), (q_count // 2) & 1)
            q_smem = q_bufs.index(qi).slice(CONSUMER * BLOCK_M, BLOCK_M)
            q_count += 1
            first_row = q_first + CONSUMER * BLOCK_M
            tile_hi, _ = _visible_end(q_first, q_first + TILE_M - 1, q_len, kv_len, min_dist, BLOCK_N)
            _, full_hi = _visible_end(first_row, first_row + BLOCK_M - 1, q_len, kv_len, min_dist, BLOCK_N)
            # (at least one masked step: on the H200, Triton 3.6, a tile whose steps all ran in the
            # unmasked loop, after a zero-trip masked one, gave wrong rows and faulted)
            masked_steps = gl.maximum(tile_hi - gl.minimum(full_hi // BLOCK_N, tile_hi), gl.minimum(tile_hi, 1))
            pos = first_row + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout)) + kv_len - q_len
            m = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
            l = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
            acc = gl.zeros([BLOCK_M, HEAD_SIZE], gl.float32, o_layout)
            if OVERLAP:
                if tile_hi > 0:
                    s = kv_count % STAGES
                    mbarrier.wait(k_ready.index(s), (kv_count // STAGES) & 1)
                    _await_turn(turns, turn_count, CONSUMER, PINGPONG)
                    scores = _issue_scores(q_smem, k_bufs.index(s), BLOCK_M, BLOCK_N)
                    _pass_turn(turns, CONSUMER, PINGPONG)
                    scores = warpgroup_mma_wait(0, deps=(scores,))
                    mbarrier.arrive(k_empty.index(s), count=1)
                    m, l, p, alpha = _softmax(scores, m, l, (tile_hi - 1) * BLOCK_N, pos, kv_len, min_dist,
                                              qk_scale, True, BLOCK_N)  # (acc is 0: no rescale)
                    p = _as_operand(p, v_bufs.dtype, HEAD_SIZE)
                    kv_count += 1
                    turn_count += 1
                    for step in range(1, masked_steps):
                        m, l, acc, p, kv_count, turn_count = _overlapped_step(
                            q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns, m, l, acc, p,
                            kv_count, turn_count, (tile_hi - 1 - step) * BLOCK_N, pos, kv_len, min_dist, qk_scale,
                            CONSUMER, PINGPONG, True, BLOCK_M, BLOCK_N, HEAD_SIZE, STAGES)
                    for step in range(gl.maximum(masked_steps, 1), tile_hi):
                        m, l, acc, p, kv_count, turn_count = _overlapped_step(
                            q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns, m, l, acc, p,
                            kv_count, turn_count, (tile_hi - 1 - step) * BLOCK_N, pos, kv_len, min_dist, qk_scale,
                            CONSUMER, PINGPONG, False, BLOCK_M, BLOCK_N, HEAD_SIZE, STAGES)
                    prev = (kv_count - 1) % STAGES
                    mbarrier.wait(v_ready.index(prev), ((kv_count - 1) // STAGES) & 1)
                    _await_turn(turns, turn_count, CONSUMER, PINGPONG)
                    acc = warpgroup_mma(p, v_bufs.index(prev), acc, is_async=True)
                    _pass_turn(turns, CONSUMER, PINGPONG)
                    acc = warpgroup_mma_wait(0, deps=(acc,))
                    mbarrier.arrive(v_empty.index(prev), count=1)
                    turn_count += 1
            else:
                for step in range(masked_steps):
                    m, l, acc, kv_count, turn_count = _plain_step(
                        q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns, m, l, acc, kv_count,
                        turn_count, (tile_hi - 1 - step) * BLOCK_N, pos, kv_len, min_dist, qk_scale, CONSUMER,
                        PINGPONG, True, BLOCK_M, BLOCK_N, HEAD_SIZE, STAGES)
                for step in range(masked_steps, tile_hi):
                    m, l, acc, kv_count, turn_count = _plain_step(
                        q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns, m, l, acc, kv_count,
                        turn_count, (tile_hi - 1 - step) * BLOCK_N, pos, kv_len, min_dist, qk_scale, CONSUMER,
                        PINGPONG, False, BLOCK_M, BLOCK_N, HEAD_SIZE, STAGES)
            mbarrier.arrive(q_empty.index(qi), count=1)
            l = gl.convert_layout(l, gl.SliceLayout(1, o_layout))
            o = gl.where(l[:, None] > 0, acc / gl.where(l > 0, l, 1.0)[:, None], 0.0)
            rows = first_row + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
            cols = unit * HEAD_SIZE + gl.arange(0, HEAD_SIZE, layout=gl.SliceLayout(0, o_layout))
            ptrs = out_ptr + (q_start + rows).to(gl.int64)[:, None] * stride_ot + cols[None, :]
            gl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=(rows < q_len)[:, None])


@gluon.jit(do_not_specialize=["num_seqs", "num_q_tiles", "min_dist", "cache_rows"])
def gluon_prefill_kernel(
    out_ptr, q_desc, k_desc, v_desc, v_ptr, cu_seqlens_q_ptr, kv_lens_ptr, block_table_ptr,
    num_seqs, num_q_tiles, qk_scale, min_dist, cache_rows, stride_ot, stride_vb, stride_vt, stride_bt,
    NUM_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr, HEAD_SIZE: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PAGED: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    OVERLAP: gl.constexpr, PINGPONG: gl.constexpr,
):
    """Plain attention of ``2 * BLOCK_M`` query tokens x one query head a work tile, over
    ``min(tiles, multiprocessors)`` persistent programs of 4 warps (the producer) + 2 x 4
    warps (the consumers).

    Args:
        out_ptr: ``[Tq, Hq, D]`` (token stride ``stride_ot``, heads and dims dense).
        q_desc: TMA descriptor over q ``[Tq, Hq * D]``, box ``[2 BLOCK_M, D]``.
        k_desc, v_desc: TMA descriptors over K and V ``[rows, Hkv * D]``, box ``[BLOCK_N, D]``
            or (PAGED) ``[min(BLOCK_SIZE, BLOCK_N), D]``; rows: tokens (contiguous) or
            ``num_blocks * BLOCK_SIZE`` cache slots (PAGED; ``cache_rows`` of them).
        v_ptr: V itself (its token or slot stride ``stride_vt``, block stride ``stride_vb``),
            for the values of a sequence's last key tile (:func:`_gather_values`).
        cu_seqlens_q_ptr: ``[B + 1]`` int32. kv_lens_ptr: ``cu_seqlens_k [B + 1]`` (contiguous)
            or ``seq_lens [B]`` (PAGED), int32.
        block_table_ptr: PAGED ``[B, max_blocks]`` int32 (row stride ``stride_bt``).
        num_q_tiles: ``Tq // (2 BLOCK_M) + B`` (the varlen bound of query tiles).
        qk_scale: ``scale * log2(e)``, positive. min_dist: see the module's masks.
        OVERLAP, PINGPONG: FlashAttention-3's intra- and inter-warpgroup schedules
            (:func:`_overlapped_step`, :func:`_await_turn`).
    """
    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [2, 2 * BLOCK_M, HEAD_SIZE], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_SIZE], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_SIZE], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
        mbarrier.init(turns.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    gl.warp_specialize(
        [(_producer, (q_desc, k_desc, v_desc, v_ptr, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready,
                      k_empty, v_empty, cu_seqlens_q_ptr, kv_lens_ptr, block_table_ptr, num_seqs, num_q_tiles,
                      min_dist, cache_rows, stride_vb, stride_vt, stride_bt, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE,
                      BLOCK_M, BLOCK_N, STAGES, PAGED, BLOCK_SIZE)),
         (_consumer, (out_ptr, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turns,
                      cu_seqlens_q_ptr, kv_lens_ptr, num_seqs, num_q_tiles, qk_scale, min_dist, stride_ot,
                      0, NUM_HEADS, HEAD_SIZE, BLOCK_M, BLOCK_N, STAGES, PAGED, OVERLAP, PINGPONG)),
         (_consumer, (out_ptr, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turns,
                      cu_seqlens_q_ptr, kv_lens_ptr, num_seqs, num_q_tiles, qk_scale, min_dist, stride_ot,
                      1, NUM_HEADS, HEAD_SIZE, BLOCK_M, BLOCK_N, STAGES, PAGED, OVERLAP, PINGPONG))],
        [4, 4], [CONSUMER_REGISTERS, CONSUMER_REGISTERS])
