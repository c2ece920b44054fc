"""A warp-specialized prefill kernel for Hopper (sm90), written in Gluon.

FlashAttention-3's forward (Shah et al. 2024, arXiv 2407.08608, §3.1: producer/consumer warp
specialization) on Triton's Gluon dialect (``triton.experimental.gluon``, Triton 3.6), where
the Triton-language kernel of :mod:`.prefill_kernel` cannot go: Triton 3.6 schedules every
warp of a program through the same instruction stream, so its tensor cores idle while the
softmax runs. Here each program holds three partitions:

* a **producer** (the default partition, one warpgroup: TMA copies are issued by one
  thread) that streams a query tile and its key/value tiles into shared memory through
  TMA, ``STAGES`` key/value buffers deep, each buffer's arrival signalled on an mbarrier;
* two **consumers** (one warpgroup each, 224 registers a thread; the producer keeps 56).
  Plain: consumer ``c`` owns query rows ``[c * BLOCK_M, (c + 1) * BLOCK_M)`` of the
  ``2 * BLOCK_M``-row tile.
  Per key tile: ``s = q kᵀ`` (wgmma from shared memory), the online softmax in registers,
  ``o += p v`` (wgmma, ``p`` from registers), then the key and value buffers are released.
  ``PINGPONG``: the consumers issue their wgmma in turns, so one's softmax runs under the
  other's matrix work (FlashAttention-3's inter-warpgroup schedule, §3.1); ``OVERLAP``: a
  consumer issues the next tile's scores before this tile's ``p v`` and runs the softmax
  under it (the intra-warpgroup schedule, §3.2; so the PTX orders it, but Triton 3.6's ptxas
  moves the wait for ``p v`` above the softmax: the packing of the next ``p`` and the
  rescale it puts among the exponentials write registers the in-flight wgmma reads; kept in
  place, FlashAttention-3's way, it ran 1-4% slower on the H200:
  ``profiling/results/kernels.md``, 2026-12-02); ``VALUES_FIRST`` (with
  ``OVERLAP``): ``p v`` issued before the next scores, both retired before the softmax, one
  wgmma batch a step (what ptxas made of ``OVERLAP`` anyway); ``EARLY_WAITS`` (with
  ``OVERLAP``): a step waits for the next step's keys and values while its wgmma run. The
  softmax between keeps ptxas's issue slots full: tree row maxima, the accumulator rescaled
  among the exponentials, the probabilities packed to 16 bits there (:func:`_softmax`);
  ``LAZY_RESCALE``: the accumulator rescaled only when a row's maximum moves by more than
  ``2^8`` (flash-attn 4's lazy rescaling), each warp branching over its own 16 rows.
  ``DIFFERENTIAL``: both consumers take the same ``BLOCK_M`` rows of one head pair,
  consumer ``c`` the component ``c`` (``softmax(q_c k_cᵀ) [v1 | v2]``) over each key tile
  loaded once (``k1``, ``k2`` and the ``[BLOCK_N, 2D]`` value tile ``[v1 | v2]``: 6
  head-size GEMM units a tile, as the differential transformer's two softmaxes need);
  consumer 1 hands its normalized result to consumer 0 through shared memory, which writes
  ``o_1 - lambda * o_2``.

The program is **persistent**: ``min(work tiles, multiprocessors)`` programs walk the work
tiles, a tile being one query head and ``2 * BLOCK_M`` query tokens of one sequence
(differential: one head pair and ``BLOCK_M`` tokens; a sequence's last plain tile with at most
``BLOCK_M`` rows: ``BLOCK_M`` tokens of two query heads of a KV head, :func:`_pair_tail`),
units (heads or pairs) fastest and query tiles reversed, so the heaviest (causal: last) tiles
start first. ``DYNAMIC`` off: a program takes tiles ``pid, pid + programs, ...``; on: its
first is ``pid``, and each next one is claimed from a counter (``programs + atomic_add``) when
the current one starts (FlashAttention-3's dynamic persistent scheduler), so no program is
left with a tail of heavy tiles. Either way a program's tiles rise, its query tiles only walk
down: the producer keeps its current sequence's metadata and reads ``cu_seqlens_q`` only when
a tile leaves it (:func:`_locate`, :func:`_seek`: the varlen bound of :mod:`.prefill_kernel`;
on the H200 a binary search on every tile, 3 to 7 dependent loads, had cost ~8% of the
consumers' time), and posts each tile's fields beside its query buffer (:func:`_post_tile`;
the fields past the six are padding): the consumers take them with the queries
(:func:`_take_tile`) and never search. The producer loads the next tile's queries while the
consumers finish the current one (two query buffers); a consumer's whole output rows leave
through its slice of the tile's query buffer by one TMA store (:func:`_store_output`).

Shapes (token-major, as ``flash_attn_varlen_func``)::

    q        [Tq, Hq, D]   through q_desc, a TMA descriptor over [Tq, Hq * D], box [2 BLOCK_M, D]
                           (differential: [BLOCK_M, D], heads 2j and 2j + 1 = pair j)
    k, v     contiguous:   [Tk, Hkv, D] through descriptors over [Tk, Hkv * D], box [BLOCK_N, D]
             PAGED:        caches [num_blocks, BLOCK_SIZE, Hkv, D] through descriptors over
                           [num_blocks * BLOCK_SIZE, Hkv * D], box [min(BLOCK_SIZE, BLOCK_N), D]
             (differential: v's box 2D wide, [v1 | v2] of a KV pair)
    cu_seqlens_q [B + 1] int32; kv_lens: cu_seqlens_k [B + 1] (contiguous) or seq_lens [B] (PAGED)
    block_table  [B, max_blocks] int32 (PAGED); lambda_full [] or [Hq / 2] (differential)
    out      [Tq, Hq, D] (differential [Tq, Hq / 2, 2D]), q's dtype, heads and dims dense

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
causal 0, else ``-window_right`` or unbounded); rows that see no key are zeros.
Differential: Ye et al. 2024 (Differential Transformer, arXiv 2410.05258, §2.1, eq. 1), the
output before the per-head RMSNorm as the unified kernel writes it (``o_2`` rounded to the
output dtype once on its way to consumer 0). No softcap, no left window, no ALiBi:
:mod:`.gluon_prefill` routes the rest to :mod:`.prefill_kernel`.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

# Triton 3.6 (the H200's) names the TMA copies async_copy_global_to_shared / async_copy_shared_to_global;
# 3.9 async_load / async_store
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# a barrier of the calling partition's warps: 3.6 thread_barrier, 3.9 barrier
_partition_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
# a consumer thread's registers; the producer warpgroup keeps the rest (56; Triton sets them with
# setmaxnreg). At 232 / 40 the producer's key loop spilled once it kept its sequence's metadata and
# sent keys before values; at 224 / 56 no key step reloads a spilled value (what ptxas still counts
# in the paged cases, Triton 3.6 up to 24 / 24 bytes, is reloaded once a work tile or a program)
CONSUMER_REGISTERS = gl.constexpr(224)
# LAZY_RESCALE (:func:`_softmax`): how far, in exponent units (log2), a tile's row maximum may pass the
# running one before it moves (flash-attn 4's sm100 forward: 8.0; the probabilities then reach 2^8)
RESCALE_THRESHOLD = gl.constexpr(8.0)
# LAZY_RESCALE (:func:`_rescale`): accumulator elements a thread rescales behind one branch, and
# that PTX (operands: the products $0.., the accumulator $PACK.., alphas $2PACK.., warp flags $3PACK..)
_PACK = 32
RESCALE_PACK = gl.constexpr(_PACK)
_RESCALE_ASM = gl.constexpr(
    "{ .reg .pred moved; " + "".join(f"mov.b32 ${i}, ${_PACK + i}; " for i in range(_PACK))
    + f"setp.ne.s32 moved, ${3 * _PACK}, 0; @!moved bra.uni KEPT; "
    + "".join(f"mul.f32 ${i}, ${i}, ${2 * _PACK + i}; " for i in range(_PACK)) + "KEPT: }")
_RESCALE_CONSTRAINTS = gl.constexpr(",".join(["=f"] * _PACK + ["f"] * (2 * _PACK) + ["r"] * _PACK))


@gluon.constexpr_function
def _mma_layout(cols):
    """The wgmma accumulator layout of one warpgroup over ``[64 * k, cols]`` (bf16/fp16
    operands: instruction k 16)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cols, 16])


@gluon.constexpr_function
def _log2(n):
    """``log2(n)`` of a power of two ``n >= 1``."""
    return n.bit_length() - 1


@gluon.constexpr_function
def _twice(dtype):
    """``(dtype, dtype)``: the results of an inline asm that yields two values."""
    return (dtype, dtype)


@gluon.constexpr_function
def _gather_layout(cols):
    """Rows of ``cols`` 16-bit values over one warpgroup, 16 bytes a thread and at least 8
    rows a pass (a 128-byte swizzle's period: :func:`_gather_values` stores whole periods;
    ``cols`` 64 to 256)."""
    per_row = cols // 8  # threads a row
    rows = 4 * 32 // per_row
    return gl.BlockedLayout([max(1, 8 // rows), 8], [32 // per_row, per_row], [4, 1], [1, 0])


@gluon.jit
def _seek(q_tile, seq, cu_seqlens_q_ptr, kv_lens_ptr, TILE_M: gl.constexpr, PAGED: gl.constexpr):
    """``(seq, first_tile, q_start, q_len, kv_start, kv_len)`` of the sequence that owns
    query tile ``q_tile`` of the varlen bound (sequence ``b`` owns the tiles from
    ``first_tile(b) = cu_seqlens_q[b] // TILE_M + b`` on), below ``seq``: sequence ``seq -
    1`` (the usual case: one load decides), else a binary search below it (from ``seq =
    B``: at most ``B - 1``; tokens past ``cu_seqlens_q[B]``, which the op's contract rules
    out, fall in sequence ``B - 1``'s empty tiles, never past the metadata)."""
    right = seq - 1
    q_start = gl.load(cu_seqlens_q_ptr + right)
    if q_start // TILE_M + right <= q_tile:
        seq = right
    else:
        right -= 1
        seq = 0
        while seq < right:
            mid = (seq + right + 1) // 2
            if gl.load(cu_seqlens_q_ptr + mid) // TILE_M + mid <= q_tile:
                seq = mid
            else:
                right = mid - 1
        q_start = gl.load(cu_seqlens_q_ptr + seq)
    q_len = gl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if PAGED:
        kv_start = 0
        kv_len = gl.load(kv_lens_ptr + seq)
    else:
        kv_start = gl.load(kv_lens_ptr + seq)
        kv_len = gl.load(kv_lens_ptr + seq + 1) - kv_start
    return seq, q_start // TILE_M + seq, q_start, q_len, kv_start, kv_len


@gluon.jit
def _locate(tile, seq, first_tile, q_start, q_len, kv_start, kv_len, cu_seqlens_q_ptr, kv_lens_ptr, num_q_tiles,
            UNITS: gl.constexpr, TILE_M: gl.constexpr, PAGED: gl.constexpr):
    """``(unit, q_first, seq, first_tile, q_start, q_len, kv_start, kv_len)`` of work tile
    ``tile``: unit (query head or pair) ``tile % UNITS``, query tile ``num_q_tiles - 1 - tile
    // UNITS`` of the varlen bound, whose first query row in its sequence is ``q_first``
    (``>= q_len``: an empty tile). A program's tiles walk the query tiles down (static or
    dynamic schedule), so the sequence of its last tile (``seq .. kv_len``; ``seq = B``,
    ``first_tile = num_q_tiles`` before the first) serves until a tile falls below its
    ``first_tile``: then :func:`_seek` reads the metadata (once a sequence a program
    passes through, not a binary search a tile)."""
    unit = tile % UNITS
    q_tile = num_q_tiles - 1 - tile // UNITS
    if q_tile < first_tile:
        seq, first_tile, q_start, q_len, kv_start, kv_len = _seek(q_tile, seq, cu_seqlens_q_ptr, kv_lens_ptr, TILE_M,
                                                                  PAGED)
    return unit, (q_tile - first_tile) * TILE_M, seq, first_tile, q_start, q_len, kv_start, kv_len


@gluon.jit
def _visible_end(first_row, last_row, q_len, kv_len, min_dist, BLOCK_N: gl.constexpr):
    """``(tile_hi, full_hi)``: the key tiles ``[0, tile_hi)`` that rows ``first_row ..
    last_row`` (clipped to the queries) see some key of, and the keys ``[0, full_hi)`` that
    every one of them sees."""
    shift = kv_len - q_len
    kv_hi = gl.minimum(gl.maximum(gl.minimum(last_row, q_len - 1) + shift - min_dist + 1, 0), kv_len)
    full_hi = gl.maximum(gl.minimum(first_row + shift - min_dist + 1, kv_len), 0)
    return gl.cdiv(kv_hi, BLOCK_N), full_hi


@gluon.jit
def _tile_rows(q_first, pair, BLOCK_M: gl.constexpr, CONSUMER: gl.constexpr, DIFFERENTIAL: gl.constexpr):
    """The first query row of a consumer's ``BLOCK_M`` rows in a work tile from ``q_first``:
    its half (plain) or the whole tile (differential, and a pair tail, ``pair`` 1: both
    consumers take the same rows, :func:`_pair_tail`)."""
    if DIFFERENTIAL:
        return q_first
    else:
        return q_first + CONSUMER * BLOCK_M * (1 - pair)


# A posted work tile (:func:`_post_tile`): its fields, in one row of int32 (unit -1: no more tiles)
POST_UNIT, POST_Q_FIRST, POST_Q_START, POST_Q_LEN, POST_KV_LEN, POST_PAIR = gl.constexpr(0), gl.constexpr(1), \
    gl.constexpr(2), gl.constexpr(3), gl.constexpr(4), gl.constexpr(5)
POST_FIELDS = gl.constexpr(8)


@gluon.constexpr_function
def _post_layout():
    """A posted tile's ``POST_FIELDS`` int32 over a warpgroup, every thread holding them all."""
    return gl.BlockedLayout([POST_FIELDS], [32], [4], [0])


@gluon.jit
def _post_tile(slot, unit, q_first, q_start, q_len, kv_len, pair):
    """The producer: a work tile's fields into ``slot`` (``[POST_FIELDS]`` int32 beside a
    query buffer), before the buffer's ``q_ready`` arrival publishes them (the barrier:
    every producer thread's store lands before the arriving thread's release)."""
    field = gl.arange(0, POST_FIELDS, layout=_post_layout())
    row = gl.where(field == POST_UNIT, unit, gl.where(field == POST_Q_FIRST, q_first, gl.where(
        field == POST_Q_START, q_start, gl.where(field == POST_Q_LEN, q_len, gl.where(
            field == POST_KV_LEN, kv_len, pair)))))
    slot.store(row)
    _partition_barrier()


@gluon.jit
def _field(row, index: gl.constexpr):
    """Field ``index`` of a posted tile's ``row`` (every thread holds the row: the max over
    one value)."""
    field = gl.arange(0, POST_FIELDS, layout=_post_layout())
    return gl.max(gl.where(field == index, row, -2147483648), axis=0)


@gluon.jit
def _stage(count, STAGES: gl.constexpr):
    """``(buffer, phase)`` of a ring of ``STAGES`` buffers at its ``count``-th use: the
    buffer ``count % STAGES`` and the parity of its mbarrier's phase for that use (a
    producer's wait for the buffer's release flips it)."""
    return count % STAGES, (count // STAGES) & 1


@gluon.jit
def _take_tile(posts, q_ready, q_count):
    """A consumer: ``(unit, q_first, q_start, q_len, kv_len, pair)`` of the work tile the
    producer posted with query buffer ``q_count % 2`` (waits for its ``q_ready``; unit -1: no
    more tiles; ``pair``: :func:`_pair_tail`)."""
    qi, phase = _stage(q_count, 2)
    mbarrier.wait(q_ready.index(qi), phase)
    row = posts.index(qi).load(_post_layout())
    return (_field(row, POST_UNIT), _field(row, POST_Q_FIRST), _field(row, POST_Q_START), _field(row, POST_Q_LEN),
            _field(row, POST_KV_LEN), _field(row, POST_PAIR))


# ----------------------------------------------------------------------------- producer
@gluon.jit
def _copy_kv_tile(desc, smem, bar, table_row, kv_start, kv_len, start, col, cache_rows, PAGED: gl.constexpr,
                  BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr):
    """TMA copies of keys ``start .. start + BLOCK_N`` (columns ``col ..``) into ``smem``,
    signalled on ``bar`` (whose expected bytes the caller set): one box, or (PAGED) one box a
    block, its id read once; boxes past the sequence's keys copy rows past the cache
    (``cache_rows``: zeros)."""
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
                   PAGED: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, COLS: gl.constexpr):
    """The ``COLS`` value columns from ``col`` of keys ``start .. start + BLOCK_N`` by masked
    pointer loads, zeros past the sequence's ``kv_len`` keys, stored into ``smem``; then
    ``bar`` is arrived on (the tile that holds the sequence's last key: no foreign row
    reaches ``p v``)."""
    layout: gl.constexpr = _gather_layout(COLS)
    CHUNK: gl.constexpr = max(8, 4 * 32 // (COLS // 8))  # rows a load of the warpgroup covers
    cols = col + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
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
def _load_values(v_desc, v_ptr, v_bufs, v_ready, v_empty, count, table_row, kv_start, kv_len, start, col, cache_rows,
                 stride_vb, stride_vt, PAGED: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                 VALUE_COLS: gl.constexpr, STAGES: gl.constexpr, ELEMENT_BYTES: gl.constexpr):
    """The values of keys ``start .. start + BLOCK_N`` into buffer ``count % STAGES`` once the
    consumers have released it: TMA copies (``ELEMENT_BYTES`` a value), or
    :func:`_gather_values` for the tile that holds the sequence's last key."""
    s, phase = _stage(count, STAGES)
    mbarrier.wait(v_empty.index(s), phase ^ 1)
    if start + BLOCK_N > kv_len:
        _gather_values(v_ptr, v_bufs.index(s), v_ready.index(s), table_row, kv_start, kv_len, start, col, stride_vb,
                       stride_vt, PAGED, BLOCK_SIZE, BLOCK_N, VALUE_COLS)
    else:
        mbarrier.expect(v_ready.index(s), BLOCK_N * VALUE_COLS * ELEMENT_BYTES)
        _copy_kv_tile(v_desc, v_bufs.index(s), v_ready.index(s), table_row, kv_start, kv_len, start, col, cache_rows,
                      PAGED, BLOCK_SIZE, BLOCK_N)


@gluon.jit
def _pair_tail(q_first, q_len, PAIRS: gl.constexpr, BLOCK_M: gl.constexpr):
    """1 when ``PAIRS`` (plain prefill, an even count of query heads a KV head) and the work
    tile from row ``q_first`` is its sequence's last with all its rows in consumer 0's half
    (``q_len - q_first <= BLOCK_M``), else 0 (int32). Such a tile runs as a *pair tail*: the
    ``BLOCK_M`` rows from ``q_first`` of two query heads of one KV head, one a consumer, over
    key/value tiles loaded once: unit ``u < UNITS / 2`` takes heads ``2u`` and ``2u + 1``, the
    units past are empty (so the programs that deal units of either parity share the pairs:
    with 132 programs and 32 heads, round-robin deals a program units of one parity only).
    Unpaired, consumer 1 would hold no row of the sequence and run every key step anyway: on
    64 sequences of 128-4096 tokens, ~2.4% of the key steps (flash-attn 4 packs the query
    heads of a KV head into every tile by default, ``pack_gqa``, which on our kernel ran
    2-13% slower: ``profiling/results/kernels.md``, 2026-12-02)."""
    return (q_len - q_first <= BLOCK_M).to(gl.int32) * PAIRS


@gluon.jit
def _load_queries(q_desc, q_half_desc, q_bufs, bar, qi, row, unit, pair, PAIRS: gl.constexpr, PARTS: gl.constexpr,
                  HEAD_SIZE: gl.constexpr, BLOCK_M: gl.constexpr):
    """A work tile's queries from token ``row`` into query buffer ``qi``, signalled on ``bar``:
    one box of head ``unit`` (plain), the two heads of pair ``unit`` (differential), or a pair
    tail's (:func:`_pair_tail`) two ``BLOCK_M``-row boxes of heads ``unit`` and ``unit + 1``."""
    if PAIRS:
        if pair > 0:
            for c in gl.static_range(2):
                _tma_load(q_half_desc, [row, (unit + c) * HEAD_SIZE], bar, q_bufs.index(qi).slice(c * BLOCK_M, BLOCK_M))
        else:
            _tma_load(q_desc, [row, unit * HEAD_SIZE], bar, q_bufs.index(qi))
    else:
        for part in gl.static_range(PARTS):
            _tma_load(q_desc, [row, (unit * PARTS + part) * HEAD_SIZE], bar, q_bufs.index(qi * PARTS + part))


@gluon.jit
def _producer(q_desc, q_half_desc, k_desc, v_desc, v_ptr, q_bufs, k_bufs, v_bufs, posts, q_ready, q_empty, k_ready,
              v_ready, k_empty, v_empty, tile_counter_ptr, cu_seqlens_q_ptr, kv_lens_ptr, block_table_ptr, num_seqs,
              num_q_tiles, min_dist, cache_rows, stride_vb, stride_vt, stride_bt,
              NUM_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr, HEAD_SIZE: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PAGED: gl.constexpr, BLOCK_SIZE: gl.constexpr,
              DIFFERENTIAL: gl.constexpr, DYNAMIC: gl.constexpr):
    """Streams each work tile's queries and key/value tiles (diagonal first) into the
    buffers, waiting for both consumers to release a buffer (keys and values apart: with
    ``OVERLAP`` a consumer is done with a tile's keys one step before its values) before
    refilling it; a step's keys go out before the previous step's values (FlashAttention-3's
    producer order: the keys, which a consumer needs first, need not wait for a value buffer).
    Differential: both components' queries and keys (two boxes each: ``q_bufs`` and
    ``k_bufs`` hold ``[component 1, component 2]`` pairs), values ``[v1 | v2]`` in one.
    Each tile that holds queries is posted with them (:func:`_post_tile`); the last post,
    unit -1, ends the consumers' loops."""
    PARTS: gl.constexpr = 2 if DIFFERENTIAL else 1
    UNITS: gl.constexpr = NUM_HEADS // PARTS
    TILE_M: gl.constexpr = BLOCK_M if DIFFERENTIAL else 2 * BLOCK_M
    GROUP: gl.constexpr = NUM_HEADS // NUM_KV_HEADS  # query heads (pairs) a KV head (pair)
    PAIRS: gl.constexpr = 1 if (not DIFFERENTIAL) and GROUP % 2 == 0 else 0  # pair tails (:func:`_pair_tail`)
    VALUE_COLS: gl.constexpr = PARTS * HEAD_SIZE
    ELEMENT_BYTES: gl.constexpr = k_desc.dtype.primitive_bitwidth // 8
    q_count = 0
    kv_count = 0
    seq, first_tile, q_start, q_len, kv_start, kv_len = num_seqs, num_q_tiles, 0, 0, 0, 0
    tile = gl.program_id(0)
    while tile < UNITS * num_q_tiles:
        unit, q_first, seq, first_tile, q_start, q_len, kv_start, kv_len = _locate(
            tile, seq, first_tile, q_start, q_len, kv_start, kv_len, cu_seqlens_q_ptr, kv_lens_ptr, num_q_tiles, UNITS,
            TILE_M, PAGED)
        pair = _pair_tail(q_first, q_len, PAIRS, BLOCK_M)
        # a pair tail's units: heads 2 unit and 2 unit + 1 for unit < UNITS / 2, none past
        busy = (q_first < q_len) & ((pair == 0) | (unit < UNITS // 2))
        unit = unit << pair
        if busy:
            qi, phase = _stage(q_count, 2)
            mbarrier.wait(q_empty.index(qi), phase ^ 1)
            _post_tile(posts.index(qi), unit, q_first, q_start, q_len, kv_len, pair)
            mbarrier.expect(q_ready.index(qi), PARTS * q_desc.block_type.nbytes)
            _load_queries(q_desc, q_half_desc, q_bufs, q_ready.index(qi), qi, q_start + q_first, unit, pair, PAIRS,
                          PARTS, HEAD_SIZE, BLOCK_M)
            q_count += 1
        if DYNAMIC:  # the next tile, claimed now: the atomic's round trip runs under the wait for a key buffer
            next_tile = gl.num_programs(0) + gl.atomic_add(tile_counter_ptr, 1, sem="relaxed")
        else:
            next_tile = tile + gl.num_programs(0)
        if busy:
            tile_hi, _ = _visible_end(q_first, q_first + TILE_M - 1, q_len, kv_len, min_dist, BLOCK_N)
            col = unit // GROUP * VALUE_COLS  # the KV head (pair)'s first column
            table_row = block_table_ptr + seq * stride_bt
            for step in range(tile_hi):
                start = (tile_hi - 1 - step) * BLOCK_N
                s, phase = _stage(kv_count, STAGES)
                mbarrier.wait(k_empty.index(s), phase ^ 1)
                mbarrier.expect(k_ready.index(s), PARTS * BLOCK_N * HEAD_SIZE * ELEMENT_BYTES)
                for part in gl.static_range(PARTS):
                    _copy_kv_tile(k_desc, k_bufs.index(s * PARTS + part), k_ready.index(s), table_row, kv_start,
                                  kv_len, start, col + part * HEAD_SIZE, cache_rows, PAGED, BLOCK_SIZE, BLOCK_N)
                if step > 0:
                    _load_values(v_desc, v_ptr, v_bufs, v_ready, v_empty, kv_count - 1, table_row, kv_start, kv_len,
                                 start + BLOCK_N, col, cache_rows, stride_vb, stride_vt, PAGED, BLOCK_SIZE, BLOCK_N,
                                 VALUE_COLS, STAGES, ELEMENT_BYTES)
                kv_count += 1
            if tile_hi > 0:
                _load_values(v_desc, v_ptr, v_bufs, v_ready, v_empty, kv_count - 1, table_row, kv_start, kv_len, 0,
                             col, cache_rows, stride_vb, stride_vt, PAGED, BLOCK_SIZE, BLOCK_N, VALUE_COLS, STAGES,
                             ELEMENT_BYTES)
        tile = next_tile
    qi, phase = _stage(q_count, 2)  # the end: unit -1, no queries (a plain arrive)
    mbarrier.wait(q_empty.index(qi), phase ^ 1)
    _post_tile(posts.index(qi), -1, 0, 0, 0, 0, 0)
    mbarrier.arrive(q_ready.index(qi), count=1)


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
def _column_halves(x):
    """``x [M, N]`` (a wgmma accumulator's layout, ``N >= 16``) as its two halves ``[M, N / 2]``
    by the columns' top bit, which each thread holds in registers: no data moves."""
    return gl.split(gl.permute(gl.reshape(x, [x.shape[0], 2, x.shape[1] // 2]), [0, 2, 1]))


@gluon.jit
def _fold_columns(x, MAX: gl.constexpr):
    """``x [M, N]`` (a wgmma accumulator's layout) folded to ``[M, 4]``: a thread's maximum
    (``MAX``) or sum of the ``N / 4`` columns it holds of each row, as a tree (a row's values
    in one chain would take ``N / 4`` dependent instructions; flash-attn 4's ``fmax_reduce``
    keeps four). The four columns left are the row's four threads (a quad)."""
    for _ in gl.static_range(_log2(x.shape[1] // 8)):
        a, b = _column_halves(x)
        x = gl.maximum(a, b) if MAX else a + b
    a, b = gl.split(gl.reshape(x, [x.shape[0], 4, 2]))
    return gl.maximum(a, b) if MAX else a + b


@gluon.jit
def _softmax(s, m, l, start, pos, kv_len, min_dist, qk_scale, MASKED: gl.constexpr, BLOCK_N: gl.constexpr,
             dtype: gl.constexpr, LAZY: gl.constexpr, PER_KEY_MASK: gl.constexpr):
    """One online-softmax step over the scores ``s`` of the key tile from key ``start``,
    masked when ``MASKED`` (keys past ``kv_len`` or unseen from positions ``pos``):
    ``(m_new, l_new, p, alpha, moved)``; the accumulator's update is ``acc * alpha + p v``
    (:func:`_rescale`). The row maximum is a tree (:func:`_fold_columns`), ``alpha`` comes
    first (below). ``l`` is ``[M, 4]``, each quad thread's share of its row's sum
    (:func:`_fold_columns`; summed once, by :func:`_normalize`, as FlashAttention-3 does);
    ``p`` is rounded to ``dtype`` in pairs (:func:`_pack_pairs`). ``LAZY``: flash-attn 4's
    lazy rescaling (its sm100 forward): a row's running maximum moves only when the tile's
    exceeds it by more than ``RESCALE_THRESHOLD`` exponent units, else the row keeps it
    (``p <= 2^RESCALE_THRESHOLD``, exact in fp32 and as precise in bf16) and its ``alpha``
    is 1; ``moved`` (int32 ``[M]``, 1 on the rows of a warp where some row moved, else 0:
    :func:`_warp_any`) lets each warp skip its rows' rescale. Not ``LAZY``: ``moved`` is 1.

    The mask: key ``start + j`` is visible from a row when ``j`` is at most the row's last
    visible key less ``start``, one compare and one select an element (ptxas folds each
    thread's column into the row's bound: 130 instructions a warp a step over the unmasked
    step's 476, Triton 3.6, plain D 128). ``PER_KEY_MASK`` (the differential schedule:
    ``K_PARTS > 1`` at the callers): each key's distance and end tested apart (520 there).
    On the H200 (2026-12-03) plain prefill ran 1.2-9% faster with the one compare, the
    differential schedule 2-3% slower (ptxas schedules its steps differently):
    ``profiling/results/kernels.md``."""
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    if MASKED and PER_KEY_MASK:
        keys = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = ((pos[:, None] - keys[None, :]) >= min_dist) & (keys < kv_len)[None, :]
        s = gl.where(visible, s, float("-inf"))
    elif MASKED:
        last = gl.minimum(pos - min_dist, kv_len - 1) - start
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(cols[None, :] <= last[:, None], s, float("-inf"))
    m_tile = gl.convert_layout(gl.max(_fold_columns(s, True), axis=1), m.type.layout)
    if LAZY:  # (a row with max -inf and a tile of -inf: NaN > threshold, false: it stays -inf)
        moves = (m_tile - m) * qk_scale > RESCALE_THRESHOLD
        m_new = gl.where(moves, m_tile, m)
        moved = _warp_any(moves.to(gl.int32))
    else:
        m_new = gl.maximum(m, m_tile)
        moved = gl.full([], 1, gl.int32)
    if MASKED:  # a row that has seen no key yet keeps max -inf: exponents against 0
        m_new_scaled = gl.where(m_new == float("-inf"), 0.0, m_new) * qk_scale
    else:
        m_new_scaled = m_new * qk_scale
    alpha = gl.exp2(m * qk_scale - m_new_scaled)
    # (alpha * 0 + m: ptxas then computes alpha first and rescales the accumulator among the
    # exponentials, where issue slots are idle; without it, after them)
    m_new_scaled = gl.fma(alpha, 0.0, m_new_scaled)
    p = gl.exp2(s * qk_scale - m_new_scaled[:, None])
    l = l * gl.convert_layout(alpha, gl.SliceLayout(1, l.type.layout))[:, None] + _fold_columns(p, False)
    return m_new, l, _pack_pairs(p, dtype), alpha, moved


@gluon.jit
def _warp_any(flags):
    """``flags [M]`` (int32, a wgmma accumulator's rows: a thread holds two, a warp 16) as
    1 on every row of a warp where some row's flag is set, else 0 (``vote.sync.any``: no
    data leaves the warp, where a reduction over the warpgroup crosses shared memory and a
    barrier)."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred any; .reg .b32 both; or.b32 both, $2, $3; setp.ne.s32 any, both, 0; "
        "vote.sync.any.pred any, any, 0xffffffff; selp.s32 $0, 1, 0, any; mov.b32 $1, $0; }",
        "=r,=r,r,r", [flags], dtype=gl.int32, is_pure=True, pack=2)


@gluon.jit
def _rescale(acc, alpha, moved, LAZY: gl.constexpr):
    """``acc * alpha`` per row (``alpha`` in the score rows' layout). ``LAZY``: ``moved``
    (:func:`_warp_any`, uniform over a warp) is 0 where no row of the warp moved (every
    ``alpha`` 1 there), and the warp branches over its multiplies (a branch of each warp in
    the PTX: the 128 FMULs a thread of the differential schedule's ``64 x 256`` accumulator
    skipped as often as one warp's 16 rows hold still, not the warpgroup's 64)."""
    if LAZY:
        gl.static_assert(acc.shape[0] == 64, "lazy rescaling: 64 rows a consumer, two a thread")
        alphas = gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
        moves = gl.convert_layout(moved, gl.SliceLayout(1, acc.type.layout))[:, None]
        acc = gl.inline_asm_elementwise(_RESCALE_ASM, _RESCALE_CONSTRAINTS, [acc, alphas, moves], dtype=gl.float32,
                                        is_pure=True, pack=RESCALE_PACK)
    else:
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    return acc


@gluon.jit
def _pack_pairs(x, dtype: gl.constexpr):
    """``x [M, N]`` fp32 (a wgmma accumulator's layout) rounded to 16-bit ``dtype``, each
    thread's column pair in one int32 (``[M, N / 2]``; ``cvt.rn.bf16x2.f32``/``f16x2``). A
    step's probabilities cross the loop in this form: carried as 16-bit values they were
    repacked with 64 byte permutes a step, carried in fp32 their 32 conversions sat between the
    softmax and the next wgmma (SASS, Triton 3.6); converted here they run among the
    exponentials."""
    gl.static_assert((dtype == gl.bfloat16) or (dtype == gl.float16), "16-bit probabilities: bf16 or fp16")
    lo, hi = gl.split(gl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
    pair: gl.constexpr = "bf16x2" if dtype == gl.bfloat16 else "f16x2"
    return gl.inline_asm_elementwise(f"cvt.rn.{pair}.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _as_operand(pairs, dtype: gl.constexpr, VALUE_COLS: gl.constexpr):
    """The probabilities (:func:`_pack_pairs`) as the register A operand of ``p v`` (no data
    moves: the wgmma accumulator's fragment is the next wgmma's A fragment)."""
    lo, hi = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [pairs], dtype=_twice(dtype),
                                       is_pure=True, pack=1)
    p = gl.reshape(gl.join(lo, hi), [pairs.shape[0], 2 * pairs.shape[1]])
    return gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=_mma_layout(VALUE_COLS), k_width=2))


@gluon.jit
def _plain_step(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns, m, l, acc, kv_count, turn_count,
                start, pos, kv_len, min_dist, qk_scale, CONSUMER: gl.constexpr, PINGPONG: gl.constexpr,
                MASKED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, VALUE_COLS: gl.constexpr,
                STAGES: gl.constexpr, K_PARTS: gl.constexpr, K_PART: gl.constexpr, LAZY: gl.constexpr):
    """A key tile without overlap: scores, softmax, ``p v``, each waited for in turn (keys
    ``k_bufs[stage * K_PARTS + K_PART]``)."""
    s, phase = _stage(kv_count, STAGES)
    mbarrier.wait(k_ready.index(s), phase)
    _await_turn(turns, turn_count, CONSUMER, PINGPONG)
    scores = _issue_scores(q_smem, k_bufs.index(s * K_PARTS + K_PART), BLOCK_M, BLOCK_N)
    _pass_turn(turns, CONSUMER, PINGPONG)
    scores = warpgroup_mma_wait(0, deps=(scores,))
    mbarrier.arrive(k_empty.index(s), count=1)
    m, l, p, alpha, moved = _softmax(scores, m, l, start, pos, kv_len, min_dist, qk_scale, MASKED, BLOCK_N,
                                     v_bufs.dtype, LAZY, K_PARTS > 1)
    acc = _rescale(acc, alpha, moved, LAZY)
    mbarrier.wait(v_ready.index(s), phase)
    _await_turn(turns, turn_count + 1, CONSUMER, PINGPONG)
    acc = warpgroup_mma(_as_operand(p, v_bufs.dtype, VALUE_COLS), v_bufs.index(s), acc, is_async=True)
    _pass_turn(turns, CONSUMER, PINGPONG)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(v_empty.index(s), count=1)
    return m, l, acc, kv_count + 1, turn_count + 2


@gluon.jit
def _await_next(k_ready, v_ready, kv_count, has_next, STAGES: gl.constexpr):
    """EARLY_WAITS: wait, under this step's wgmma, for what the next step reads: this tile's
    values (buffer ``kv_count % STAGES``) and, when ``has_next``, the next tile's keys. The
    step's releases of its own buffers come after these waits, so a load that is late also
    holds back the release that lets the producer start the load after it; on the H200 the
    loads had landed long before the waits (the consumers' clocks, 2026-12-02)."""
    s, phase = _stage(kv_count, STAGES)
    mbarrier.wait(v_ready.index(s), phase)
    s, phase = _stage(kv_count + 1, STAGES)
    mbarrier.wait(k_ready.index(s), phase, pred=has_next)


@gluon.jit
def _overlapped_step(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns, m, l, acc, p, kv_count,
                     turn_count, start, pos, kv_len, min_dist, qk_scale, CONSUMER: gl.constexpr,
                     PINGPONG: gl.constexpr, MASKED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     VALUE_COLS: gl.constexpr, STAGES: gl.constexpr, K_PARTS: gl.constexpr, K_PART: gl.constexpr,
                     VALUES_FIRST: gl.constexpr, EARLY_WAITS: gl.constexpr, LAZY: gl.constexpr, has_next):
    """FlashAttention-3's intra-warpgroup overlap (§3.2): with the previous key tile's
    probabilities ``p`` (buffer ``kv_count - 1``), issue this tile's ``q kᵀ`` and then the
    previous tile's ``p v``; the scores retire first (wgmma groups retire in order), so this
    tile's softmax runs while ``p v`` is still on the tensor cores (in the PTX: ptxas moves
    the wait for ``p v`` above the softmax, see the module). ``VALUES_FIRST``: ``p v``
    issued first, both retired before the softmax (one wgmma batch a step). ``p`` crosses
    steps in 16-bit pairs (:func:`_pack_pairs`). ``EARLY_WAITS``:
    this step's keys and values were waited for by the step before (:func:`_await_next`; on
    the H200, 2026-12-02, a step's start to its turn wait took ~130 of its ~2850 cycles, on
    the consumers' critical path), and it waits for the next step's (``has_next``: there is a
    next key tile) while its wgmma run (plain prefill 2-4% faster with it, the differential
    schedule 1-7% slower: ``profiling/results/kernels.md``, 2026-12-02). Returns ``(m, l, acc, p, kv_count,
    turn_count)`` of the next step."""
    s, phase = _stage(kv_count, STAGES)
    prev, prev_phase = _stage(kv_count - 1, STAGES)
    if VALUES_FIRST:
        p_operand = _as_operand(p, v_bufs.dtype, VALUE_COLS)
        if not EARLY_WAITS:
            mbarrier.wait(v_ready.index(prev), prev_phase)
            mbarrier.wait(k_ready.index(s), phase)
        _await_turn(turns, turn_count, CONSUMER, PINGPONG)
        acc = warpgroup_mma(p_operand, v_bufs.index(prev), acc, is_async=True)
        scores = _issue_scores(q_smem, k_bufs.index(s * K_PARTS + K_PART), BLOCK_M, BLOCK_N)
        _pass_turn(turns, CONSUMER, PINGPONG)
        if EARLY_WAITS:
            _await_next(k_ready, v_ready, kv_count, has_next, STAGES)
        acc = warpgroup_mma_wait(1, deps=(acc,))
        mbarrier.arrive(v_empty.index(prev), count=1)
        scores = warpgroup_mma_wait(0, deps=(scores,))
        mbarrier.arrive(k_empty.index(s), count=1)
        m, l, p, alpha, moved = _softmax(scores, m, l, start, pos, kv_len, min_dist, qk_scale, MASKED, BLOCK_N,
                                         v_bufs.dtype, LAZY, K_PARTS > 1)
    else:
        if not EARLY_WAITS:
            mbarrier.wait(k_ready.index(s), phase)
        _await_turn(turns, turn_count, CONSUMER, PINGPONG)
        scores = _issue_scores(q_smem, k_bufs.index(s * K_PARTS + K_PART), BLOCK_M, BLOCK_N)
        if not EARLY_WAITS:
            mbarrier.wait(v_ready.index(prev), prev_phase)
        acc = warpgroup_mma(_as_operand(p, v_bufs.dtype, VALUE_COLS), v_bufs.index(prev), acc, is_async=True)
        _pass_turn(turns, CONSUMER, PINGPONG)
        if EARLY_WAITS:
            _await_next(k_ready, v_ready, kv_count, has_next, STAGES)
        scores = warpgroup_mma_wait(1, deps=(scores,))
        mbarrier.arrive(k_empty.index(s), count=1)
        m, l, p, alpha, moved = _softmax(scores, m, l, start, pos, kv_len, min_dist, qk_scale, MASKED, BLOCK_N,
                                         v_bufs.dtype, LAZY, K_PARTS > 1)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(prev), count=1)
    return m, l, _rescale(acc, alpha, moved, LAZY), p, kv_count + 1, turn_count + 1


@gluon.jit
def _attend(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns, kv_count, turn_count, tile_hi,
            masked_steps, pos, kv_len, min_dist, qk_scale, CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr,
            BLOCK_N: gl.constexpr, VALUE_COLS: gl.constexpr, STAGES: gl.constexpr, K_PARTS: gl.constexpr,
            K_PART: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, VALUES_FIRST: gl.constexpr,
            EARLY_WAITS: gl.constexpr, LAZY: gl.constexpr):
    """``(m, l, acc, kv_count, turn_count)`` of a consumer's rows over key tiles ``tile_hi -
    1`` down to 0, the first ``masked_steps`` (>= 1 when ``tile_hi > 0``) masked. ``OVERLAP``:
    :func:`_overlapped_step` (the first tile without ``p v``, the last tile's ``p v`` after
    the loops; ``EARLY_WAITS``: the first tile's step waits for the second's keys and its own
    values, and the last ``p v`` finds its values waited for); else :func:`_plain_step`."""
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    m = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l = _fold_columns(gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), False)
    acc = gl.zeros([BLOCK_M, VALUE_COLS], gl.float32, _mma_layout(VALUE_COLS))
    if OVERLAP:
        if tile_hi > 0:
            s, phase = _stage(kv_count, STAGES)
            mbarrier.wait(k_ready.index(s), phase)
            _await_turn(turns, turn_count, CONSUMER, PINGPONG)
            scores = _issue_scores(q_smem, k_bufs.index(s * K_PARTS + K_PART), BLOCK_M, BLOCK_N)
            _pass_turn(turns, CONSUMER, PINGPONG)
            if EARLY_WAITS:
                _await_next(k_ready, v_ready, kv_count, tile_hi > 1, STAGES)
            scores = warpgroup_mma_wait(0, deps=(scores,))
            mbarrier.arrive(k_empty.index(s), count=1)
            m, l, p, alpha, moved = _softmax(scores, m, l, (tile_hi - 1) * BLOCK_N, pos, kv_len, min_dist, qk_scale,
                                             True, BLOCK_N, v_bufs.dtype, LAZY, K_PARTS > 1)  # (acc is 0: no rescale)
            kv_count += 1
            turn_count += 1
            for step in range(1, masked_steps):
                m, l, acc, p, kv_count, turn_count = _overlapped_step(
                    q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns, m, l, acc, p, kv_count,
                    turn_count, (tile_hi - 1 - step) * BLOCK_N, pos, kv_len, min_dist, qk_scale, CONSUMER, PINGPONG,
                    True, BLOCK_M, BLOCK_N, VALUE_COLS, STAGES, K_PARTS, K_PART, VALUES_FIRST, EARLY_WAITS,
                    LAZY, step + 1 < tile_hi)
            for step in range(gl.maximum(masked_steps, 1), tile_hi):
                m, l, acc, p, kv_count, turn_count = _overlapped_step(
                    q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns, m, l, acc, p, kv_count,
                    turn_count, (tile_hi - 1 - step) * BLOCK_N, pos, kv_len, min_dist, qk_scale, CONSUMER, PINGPONG,
                    False, BLOCK_M, BLOCK_N, VALUE_COLS, STAGES, K_PARTS, K_PART, VALUES_FIRST, EARLY_WAITS,
                    LAZY, step + 1 < tile_hi)
            prev, prev_phase = _stage(kv_count - 1, STAGES)
            if not EARLY_WAITS:
                mbarrier.wait(v_ready.index(prev), prev_phase)
            _await_turn(turns, turn_count, CONSUMER, PINGPONG)
            acc = warpgroup_mma(_as_operand(p, v_bufs.dtype, VALUE_COLS), v_bufs.index(prev), acc, is_async=True)
            _pass_turn(turns, CONSUMER, PINGPONG)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(v_empty.index(prev), count=1)
            turn_count += 1
    else:
        for step in range(masked_steps):
            m, l, acc, kv_count, turn_count = _plain_step(
                q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns, m, l, acc, kv_count, turn_count,
                (tile_hi - 1 - step) * BLOCK_N, pos, kv_len, min_dist, qk_scale, CONSUMER, PINGPONG, True, BLOCK_M,
                BLOCK_N, VALUE_COLS, STAGES, K_PARTS, K_PART, LAZY)
        for step in range(masked_steps, tile_hi):
            m, l, acc, kv_count, turn_count = _plain_step(
                q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns, m, l, acc, kv_count, turn_count,
                (tile_hi - 1 - step) * BLOCK_N, pos, kv_len, min_dist, qk_scale, CONSUMER, PINGPONG, False, BLOCK_M,
                BLOCK_N, VALUE_COLS, STAGES, K_PARTS, K_PART, LAZY)
    return m, l, acc, kv_count, turn_count


@gluon.jit
def _normalize(acc, l):
    """``acc / l`` per row (``l``: the quads' shares, :func:`_softmax`), zeros for rows that
    saw no key (``l == 0``)."""
    l = gl.convert_layout(gl.sum(l, axis=1), gl.SliceLayout(1, acc.type.layout))
    return gl.where(l[:, None] > 0, acc / gl.where(l > 0, l, 1.0)[:, None], 0.0)


@gluon.jit
def _store_output(o, out_desc, out_ptr, stage, q_start, first_row, q_len, col, stride_ot, TMA: gl.constexpr):
    """A consumer's normalized rows ``o`` (``[BLOCK_M, cols]`` fp32) into ``out`` from row
    ``q_start + first_row``, column ``col``: when ``TMA`` and every row is the sequence's,
    staged in ``stage`` (the consumer's ``BLOCK_M``-row slice of the query buffer, its last
    ``q kᵀ`` retired) and copied by one TMA store, waited for until it has read ``stage``;
    else by masked pointer stores (the rows past ``q_len`` belong to the next sequence)."""
    BLOCK_M: gl.constexpr = o.shape[0]
    COLS: gl.constexpr = o.shape[1]
    if TMA and first_row + BLOCK_M <= q_len:
        stage.store(o.to(out_desc.dtype))
        fence_async_shared()
        _tma_store(out_desc, [q_start + first_row, col], stage)
        tma.store_wait(0)
    else:
        o_layout: gl.constexpr = o.type.layout
        rows = first_row + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        cols = col + gl.arange(0, COLS, layout=gl.SliceLayout(0, o_layout))
        ptrs = out_ptr + (q_start + rows).to(gl.int64)[:, None] * stride_ot + cols[None, :]
        gl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=(rows < q_len)[:, None])


@gluon.jit
def _consumer(out_ptr, out_desc, lambda_ptr, q_bufs, k_bufs, v_bufs, x_buf, posts, q_ready, q_empty, k_ready, v_ready,
              k_empty, v_empty, turns, x_ready, x_empty, qk_scale, min_dist, stride_ot,
              CONSUMER: gl.constexpr, HEAD_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, VALUES_FIRST: gl.constexpr,
              EARLY_WAITS: gl.constexpr, LAZY_RESCALE: gl.constexpr, DIFFERENTIAL: gl.constexpr,
              LAMBDA_PER_PAIR: gl.constexpr):
    """A consumer's ``BLOCK_M`` rows of each work tile (:func:`_tile_rows`; differential:
    component ``CONSUMER``; a pair tail: head ``unit + CONSUMER``'s, :func:`_pair_tail`): the
    masked key tiles (diagonal band, last partial tile), then the interior ones
    (:func:`_attend`), then the normalized output rows (:func:`_store_output`).
    Differential: consumer 1 hands ``o_2`` (the output dtype) to consumer 0 through
    ``x_buf`` (``x_ready``/``x_empty``), which stores ``o_1 - lambda * o_2``. The tiles are
    the producer's posts (:func:`_take_tile`), up to the one of unit -1."""
    PARTS: gl.constexpr = 2 if DIFFERENTIAL else 1
    TILE_M: gl.constexpr = BLOCK_M if DIFFERENTIAL else 2 * BLOCK_M
    VALUE_COLS: gl.constexpr = PARTS * HEAD_SIZE
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(VALUE_COLS)
    q_count = 0
    kv_count = 0
    turn_count = 0
    unit, q_first, q_start, q_len, kv_len, pair = _take_tile(posts, q_ready, q_count)
    while unit >= 0:
        qi = q_count % 2
        if DIFFERENTIAL:
            q_smem = q_bufs.index(qi * 2 + CONSUMER)
        else:
            q_smem = q_bufs.index(qi).slice(CONSUMER * BLOCK_M, BLOCK_M)
        first_row = _tile_rows(q_first, pair, BLOCK_M, CONSUMER, DIFFERENTIAL)
        col = (unit + CONSUMER * pair) * VALUE_COLS  # (a pair tail: consumer c's head is unit + c)
        tile_hi, _ = _visible_end(q_first, q_first + TILE_M - 1, q_len, kv_len, min_dist, BLOCK_N)
        _, full_hi = _visible_end(first_row, first_row + BLOCK_M - 1, q_len, kv_len, min_dist, BLOCK_N)
        # (at least one masked step: on the H200, Triton 3.6, a tile whose steps all ran in the
        # unmasked loop, after a zero-trip masked one, gave wrong rows and faulted)
        masked_steps = gl.maximum(tile_hi - gl.minimum(full_hi // BLOCK_N, tile_hi), gl.minimum(tile_hi, 1))
        pos = first_row + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout)) + kv_len - q_len
        m, l, acc, kv_count, turn_count = _attend(
            q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns, kv_count, turn_count, tile_hi,
            masked_steps, pos, kv_len, min_dist, qk_scale, CONSUMER, BLOCK_M, BLOCK_N, VALUE_COLS, STAGES, PARTS,
            CONSUMER if DIFFERENTIAL else 0, OVERLAP, PINGPONG, VALUES_FIRST, EARLY_WAITS, LAZY_RESCALE)
        if DIFFERENTIAL:
            mbarrier.arrive(q_empty.index(qi), count=1)
        o = _normalize(acc, l)
        if DIFFERENTIAL:
            exchange_phase = (q_count & 1) ^ CONSUMER  # consumer 1's first wait (x_empty) passes
            if CONSUMER == 1:
                mbarrier.wait(x_empty, exchange_phase)
                x_buf.store(o.to(out_ptr.dtype.element_ty))
                mbarrier.arrive(x_ready, count=1)
            else:
                if LAMBDA_PER_PAIR:
                    lam = gl.load(lambda_ptr + unit).to(gl.float32)
                else:
                    lam = gl.load(lambda_ptr).to(gl.float32)
                mbarrier.wait(x_ready, exchange_phase)
                o = o - lam * x_buf.load(o_layout).to(gl.float32)
                mbarrier.arrive(x_empty, count=1)
        if CONSUMER == 0 or not DIFFERENTIAL:
            _store_output(o, out_desc, out_ptr, q_smem, q_start, first_row, q_len, col, stride_ot, not DIFFERENTIAL)
        if not DIFFERENTIAL:  # (its query buffer held the output on its way out)
            mbarrier.arrive(q_empty.index(qi), count=1)
        q_count += 1
        unit, q_first, q_start, q_len, kv_len, pair = _take_tile(posts, q_ready, q_count)


@gluon.jit(do_not_specialize=["num_seqs", "num_q_tiles", "min_dist", "cache_rows"])
def gluon_prefill_kernel(
    out_ptr, out_desc, q_desc, q_half_desc, k_desc, v_desc, v_ptr, cu_seqlens_q_ptr, kv_lens_ptr, block_table_ptr,
    lambda_ptr, tile_counter_ptr, num_seqs, num_q_tiles, qk_scale, min_dist, cache_rows, stride_ot, stride_vb,
    stride_vt, stride_bt,
    NUM_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr, HEAD_SIZE: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PAGED: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, VALUES_FIRST: gl.constexpr, EARLY_WAITS: gl.constexpr,
    LAZY_RESCALE: gl.constexpr, DIFFERENTIAL: gl.constexpr, LAMBDA_PER_PAIR: gl.constexpr, DYNAMIC: gl.constexpr,
):
    """Attention of a work tile (plain: ``2 * BLOCK_M`` query tokens x one query head, or
    ``BLOCK_M`` x two, :func:`_pair_tail`; differential: ``BLOCK_M`` tokens x one head pair),
    over ``min(tiles, multiprocessors)`` persistent programs of 4 warps (the producer) + 2 x 4
    warps (the consumers).

    Args:
        out_ptr: ``[Tq, Hq, D]`` or, differential, ``[Tq, Hq / 2, 2D]`` (token stride
            ``stride_ot``, heads and dims dense).
        out_desc: plain: a TMA descriptor over out ``[Tq, Hq * D]``, box ``[BLOCK_M, D]``
            (a consumer's whole rows leave through it: :func:`_store_output`);
            differential: unused (any descriptor).
        q_desc: TMA descriptor over q ``[Tq, Hq * D]``, box ``[2 BLOCK_M, D]`` (differential
            ``[BLOCK_M, D]``).
        q_half_desc: the same with box ``[BLOCK_M, D]`` (a pair tail's queries:
            :func:`_pair_tail`; differential: unused, any descriptor).
        k_desc, v_desc: TMA descriptors over K and V ``[rows, Hkv * D]``, box ``[BLOCK_N, D]``
            or (PAGED) ``[min(BLOCK_SIZE, BLOCK_N), D]`` (v's box ``2D`` wide when
            differential); rows: tokens (contiguous) or ``num_blocks * BLOCK_SIZE`` cache
            slots (PAGED; ``cache_rows`` of them).
        v_ptr: V itself (its token or slot stride ``stride_vt``, block stride ``stride_vb``),
            for the values of a sequence's last key tile (:func:`_gather_values`).
        cu_seqlens_q_ptr: ``[B + 1]`` int32. kv_lens_ptr: ``cu_seqlens_k [B + 1]`` (contiguous)
            or ``seq_lens [B]`` (PAGED), int32.
        block_table_ptr: PAGED ``[B, max_blocks]`` int32 (row stride ``stride_bt``).
        lambda_ptr: differential ``lambda_full``, ``[]`` or ``[Hq / 2]`` (``LAMBDA_PER_PAIR``).
        tile_counter_ptr: ``DYNAMIC``: ``[1]`` int32, zero at launch (the tiles claimed past
            the first ``programs``); else unused (any int32 pointer).
        num_q_tiles: ``Tq // TILE_M + B`` (the varlen bound of query tiles).
        qk_scale: ``scale * log2(e)``, positive. min_dist: see the module's masks.
        OVERLAP, PINGPONG: FlashAttention-3's intra- and inter-warpgroup schedules
            (:func:`_overlapped_step`, :func:`_await_turn`); VALUES_FIRST: OVERLAP's step
            with ``p v`` issued first; EARLY_WAITS: OVERLAP's step waits for the next
            step's keys and values under its wgmma (:func:`_await_next`). LAZY_RESCALE:
            flash-attn 4's lazy rescaling (:func:`_softmax`). DYNAMIC: tiles claimed from
            ``tile_counter_ptr`` (the module's persistent schedule).
    """
    dtype: gl.constexpr = q_desc.dtype
    PARTS: gl.constexpr = 2 if DIFFERENTIAL else 1
    TILE_M: gl.constexpr = BLOCK_M if DIFFERENTIAL else 2 * BLOCK_M
    VALUE_COLS: gl.constexpr = PARTS * HEAD_SIZE
    q_bufs = gl.allocate_shared_memory(dtype, [2 * PARTS, TILE_M, HEAD_SIZE], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES * PARTS, BLOCK_N, HEAD_SIZE], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, VALUE_COLS], v_desc.layout)
    # differential: consumer 1's o_2 on its way to consumer 0 (plain: a placeholder)
    x_buf = gl.allocate_shared_memory(dtype, [BLOCK_M, VALUE_COLS] if DIFFERENTIAL else [1, 8],
                                      gl.SwizzledSharedLayout(8, 1, 1, [1, 0]))
    # the work tile of each query buffer, posted by the producer (:func:`_post_tile`)
    posts = gl.allocate_shared_memory(gl.int32, [2, POST_FIELDS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    x_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    x_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    # (only the barriers in use are initialized: the allocator may put a scratch buffer, e.g. the
    # atomic's, over an unused one, and PTX forbids reusing an initialized mbarrier's memory)
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
        if PINGPONG:
            mbarrier.init(turns.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    if DIFFERENTIAL:
        mbarrier.init(x_ready, count=1)
        mbarrier.init(x_empty, count=1)
    gl.warp_specialize(
        [(_producer, (q_desc, q_half_desc, k_desc, v_desc, v_ptr, q_bufs, k_bufs, v_bufs, posts, q_ready, q_empty,
                      k_ready, v_ready, k_empty, v_empty, tile_counter_ptr, cu_seqlens_q_ptr, kv_lens_ptr,
                      block_table_ptr, num_seqs, num_q_tiles, min_dist, cache_rows, stride_vb, stride_vt, stride_bt,
                      NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_M, BLOCK_N, STAGES, PAGED, BLOCK_SIZE, DIFFERENTIAL,
                      DYNAMIC)),
         (_consumer, (out_ptr, out_desc, lambda_ptr, q_bufs, k_bufs, v_bufs, x_buf, posts, q_ready, q_empty, k_ready,
                      v_ready, k_empty, v_empty, turns, x_ready, x_empty, qk_scale, min_dist, stride_ot, 0,
                      HEAD_SIZE, BLOCK_M, BLOCK_N, STAGES, OVERLAP, PINGPONG, VALUES_FIRST, EARLY_WAITS,
                      LAZY_RESCALE, DIFFERENTIAL, LAMBDA_PER_PAIR)),
         (_consumer, (out_ptr, out_desc, lambda_ptr, q_bufs, k_bufs, v_bufs, x_buf, posts, q_ready, q_empty, k_ready,
                      v_ready, k_empty, v_empty, turns, x_ready, x_empty, qk_scale, min_dist, stride_ot, 1,
                      HEAD_SIZE, BLOCK_M, BLOCK_N, STAGES, OVERLAP, PINGPONG, VALUES_FIRST, EARLY_WAITS,
                      LAZY_RESCALE, DIFFERENTIAL, LAMBDA_PER_PAIR))],
        [4, 4], [CONSUMER_REGISTERS, CONSUMER_REGISTERS])
