"""The unified attention kernel: paged or contiguous K/V, plain or differential.

One launch serves a whole batch that mixes prefill, chunked prefill, prefix-cache hits,
decode and multi-token decode. The launch grid is ``(num_q_tiles, num_kv_units,
num_splits)`` and depends on tensor shapes only (CUDA-graph safe):

* ``num_q_tiles = num_tokens // BLOCK_Q + num_seqs`` bounds the query tiles of all
  sequences (sequence ``b`` owns tiles ``cu_seqlens_q[b] // BLOCK_Q + b`` onwards, at least
  ``ceil(q_len / BLOCK_Q)`` of them); a program finds its sequence by binary search over
  ``cu_seqlens_q`` and exits when its tile is past the sequence's queries.
* ``num_kv_units`` is the number of KV heads (plain) or KV head pairs (differential). One
  program handles ``BLOCK_Q`` query tokens times every query head (pair) that reads its KV
  head (pair), so a GQA group of ``GROUP`` heads shares each K/V load. Row ``r`` of the
  ``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows is query token ``r // GROUP_PAD`` and head
  ``r % GROUP_PAD`` of the group.
* ``num_splits`` > 1 is flash-decoding: split ``s`` of a tile covers the ``s``-th share of
  its key tiles and writes a normalized partial output and its log-sum-exp (base 2) to
  scratch; :mod:`.merge_kernel` combines them.

Math: the online softmax of FlashAttention-2 (Dao 2023, arXiv 2307.08691, algorithm 1) in
base 2, with the masks of ``flash_attn_with_kvcache``: query ``i`` of a sequence sits at key
position ``p = i + kv_len - q_len`` and sees key ``j`` when
``min_dist <= p - j <= max_dist`` (the launcher folds ``causal`` and ``window_size`` into
these two bounds). Scores are ``scale * q.k``, then ``softcap * tanh(s / softcap)``, then
``- slope * |p - j|`` (ALiBi). Rows that see no key produce zeros. Only key tiles at the
edges of a query tile's visible range are masked; tiles that every row sees whole are not.

Head sizes: any ``HEAD_SIZE`` from 1 to 256, as flash-attn. Tiles are ``HEAD_SIZE_PAD``
(a power of two, at least 16: the smallest ``tl.dot`` K) wide per head; every load and
store masks the dims at or past ``HEAD_SIZE`` (zeros in, nothing out), so callers pass
unpadded tensors and the ``[v1 | v2]`` columns land at ``c`` and ``HEAD_SIZE + c``.

Differential (Ye et al. 2024, arXiv 2410.05258, eq. 1): a program owns KV heads ``2u`` and
``2u + 1`` and query head pairs ``(2j, 2j + 1)``; it keeps two online-softmax states (``q1.k1``
and ``q2.k2``) over the same K/V tiles, loaded once (``k1``, ``k2`` and the value pair as one
``[TILE_N, 2D]`` tile ``[v1 | v2]``), each accumulating ``softmax . [v1 | v2]``, and writes
``o1 - lambda_j * o2`` (float32 arithmetic) as ``[T, H/2, 2D]``.

Stacked differential (``STACKED``, decode tiles, whose query rows fill at most half of the
smallest ``tl.dot`` tile): the first half of the rows are the ``q1`` rows and the second
half the ``q2`` rows of the same tokens and pairs. Queries are ``[BLOCK_M, 2D]`` with
``q1`` rows zero in the ``k2`` half and ``q2`` rows zero in the ``k1`` half, keys the
``[TILE_N, 2D]`` tile ``[k1 | k2]``: one score dot, one online softmax per row and one
``P . [v1 | v2]`` accumulator give both components; the halves are combined at the end.
This halves the accumulators and the dots of a decode program (the padded rows were
otherwise wasted), at the price of multiplying zeros in the score dot.

fp8 KV cache (vLLM's ``kv_cache_dtype="fp8"``): K/V tiles of a float8_e4m3fn cache are
converted to the query's dtype as they are loaded (exact), the dots run in that dtype as
for any cache, and the scales are applied outside the loop: ``q . (k * k_scale) =
(q . k) * k_scale`` folds ``k_scale`` into the softmax scale (``K_SCALED``), and the output,
linear in ``V``, is multiplied by ``v_scale`` (``V_SCALED``) before it is stored (partials
too: the split merge is a convex combination). With a bfloat16 query (``F16_TILES``) the
tiles are converted to float16 instead: on sm89+ float8_e4m3fn -> float16 is one
conversion instruction per two values (``cvt.rn.f16x2.e4m3x2``), -> bfloat16 three (two
more ``cvt.bf16.f16``, Triton 3.6's PTX for sm90), and conversions run at a quarter of the
float32 rate, so a bfloat16 read of an fp8 cache was bound by them (on the H200, B=64
ctx 8k: 0.71 ms against 0.56 ms for a bfloat16 cache, 2026-11-30). The query goes to
float16 once per program, scaled by ``2**-8`` (exact; float16 then holds ``|q|`` up to
``2**24`` at no less precision than bfloat16 down to ``2**-6``), the ``2**8`` folded into
the softmax scale; the probabilities enter the ``P . V`` dot as float16 (finer than
bfloat16 on ``[0, 1]``). Per byte of cache an fp8 step still costs about twice the
instructions of a bfloat16 one (Triton 3.6, sm90 SASS of a 64-key decode step: 52 a key
against 43 for twice the bytes; every byte of V reaches the ``P . V`` dot by a one-byte
shared-memory load, the dot needing pairs of keys where the tile holds pairs of dims, and
sm90 has no transposing ``ldmatrix`` for bytes), so fp8 decode tiles keep more keys in
flight (:func:`.config.fp8_decode_tiles`).
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _tile_rows(rows, q_first, q_start, q_len, kv_unit, COMPONENT_ROWS: tl.constexpr,
               GROUP: tl.constexpr, GROUP_PAD: tl.constexpr):
    """What tile rows ``rows`` hold: query index in the sequence, its head (pair) and that
    head's place in the GQA group, whether the row is real, and its token (int64)."""
    q_idx = q_first + (rows % COMPONENT_ROWS) // GROUP_PAD
    member = rows % GROUP_PAD
    head_ok = member < GROUP
    row_ok = (q_idx < q_len) & head_ok
    head = kv_unit * GROUP + member  # query head (plain) or query head pair (differential)
    token = (q_start + q_idx).to(tl.int64)
    return q_idx, head, head_ok, row_ok, token


@triton.jit
def _tanh(x):
    """``tanh`` from ``exp`` of a non-positive argument (no overflow; portable across Triton
    versions and the interpreter)."""
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _scores(q, k, dist, scale, softcap, slope, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
            RUNTIME_SCALARS: tl.constexpr):
    """Unmasked scores in base 2, ``[BLOCK_M, TILE_N]`` float32. ``q`` ``[BLOCK_M,
    HEAD_SIZE_PAD]``, ``k`` ``[TILE_N, HEAD_SIZE_PAD]``, ``dist = p - j`` (ALiBi only).
    With ``RUNTIME_SCALARS`` a softcap of 0 turns capping off at run time."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    if SOFTCAP:
        if RUNTIME_SCALARS:
            capped = softcap * _tanh(s / tl.where(softcap > 0, softcap, 1.0))
            s = tl.where(softcap > 0, capped, s)
        else:
            s = softcap * _tanh(s / softcap)
    if ALIBI:
        s -= slope[:, None] * tl.abs(dist).to(tl.float32)
    return s * LOG2E


@triton.jit
def _query_tile(q_ptrs, q_mask, F16_TILES: tl.constexpr):
    """The query tile as loaded, or, ``F16_TILES``, times ``2**-8`` as float16."""
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    if F16_TILES:
        q = (q.to(tl.float32) * 0.00390625).to(tl.float16)
    return q


@triton.jit
def _online_softmax(m, l, s):
    """One step of the online softmax: new running max/sum, the tile's probabilities and
    the rescale factor of the old accumulator. Rows still at ``-inf`` stay at zero."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    return m_new, l * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def _normalize(acc, l):
    """``acc / l`` per row, zeros for rows that saw no key (``l == 0``)."""
    return tl.where(l[:, None] > 0, acc / tl.where(l > 0, l, 1.0)[:, None], 0.0)


@triton.jit
def _log_sum_exp(m, l):
    """Base-2 log-sum-exp of a row; ``-inf`` for rows that saw no key."""
    return tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))


# Arguments whose values change with the batch are not specialized, so the compiled variants
# depend on the launch plan alone (what ``Engine.warmup`` compiles ahead of requests); the split
# strides change with it too but are always 16-divisible (``attention.split_strides``).
@triton.jit(do_not_specialize=["num_seqs", "min_dist", "max_dist"])
def attention_kernel(
    out_ptr, lse_ptr, q_ptr, k_ptr, v_ptr,
    cu_seqlens_q_ptr, kv_lens_ptr, block_table_ptr, lambda_ptr, alibi_ptr, scalars_ptr,
    k_scale_ptr, v_scale_ptr,
    num_seqs, scale, softcap, min_dist, max_dist,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    stride_os, stride_ot, stride_oh, stride_od,
    stride_ls, stride_lt, stride_lh,
    BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr, DIFFERENTIAL: tl.constexpr,
    STACKED: tl.constexpr, SPLIT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    LAMBDA_PER_PAIR: tl.constexpr, RUNTIME_SCALARS: tl.constexpr, K_SCALED: tl.constexpr,
    V_SCALED: tl.constexpr, F16_TILES: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PAD: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
):
    """Attention of one query tile x one KV head (pair) x one KV split.

    Args:
        out_ptr: ``SPLIT``: float32 partial outputs ``[num_splits, T, Hq, Dv]`` (``Dv`` =
            ``D``, or ``2D`` differential, each query head its own row); else the output
            ``[T, Hq, D]`` or, differential, ``[T, Hq/2, 2D]``, in the query's dtype.
        lse_ptr: ``SPLIT``: float32 ``[num_splits, T, Hq]`` base-2 log-sum-exp; else unused.
        q_ptr: ``[T, Hq, D]`` float16/bfloat16/float32.
        k_ptr, v_ptr: ``PAGED``: caches ``[num_blocks, BLOCK_SIZE, Hkv, D]``, the query's
            dtype or float8_e4m3fn; else contiguous ``[total_k, Hkv, D]`` (``stride_ks`` unused).
        cu_seqlens_q_ptr: ``[B + 1]`` int32. kv_lens_ptr: ``PAGED``: ``seq_lens`` ``[B]``;
            else ``cu_seqlens_k`` ``[B + 1]``. block_table_ptr: ``[B, max_blocks]`` int32
            (``PAGED`` only).
        lambda_ptr: differential lambda, ``[]`` or ``[Hq/2]`` (``LAMBDA_PER_PAIR``).
        alibi_ptr: ``[Hq]`` float32 slopes (``ALIBI`` only).
        scalars_ptr: ``RUNTIME_SCALARS``: float32 ``[2]`` holding ``(scale, softcap)``,
            which replace the ``scale`` and ``softcap`` arguments.
        k_scale_ptr, v_scale_ptr: float32 scalars of an fp8 cache (``K_SCALED``, ``V_SCALED``):
            keys are ``k * k_scale``, values ``v * v_scale``.
        F16_TILES: an fp8 cache read with a bfloat16 query: dots in float16 (module docstring).
        min_dist, max_dist: key ``j`` is visible from key position ``p`` when
            ``min_dist <= p - j <= max_dist``.
    """
    # Rows of one component: all rows, or half of them when q1 and q2 rows are stacked.
    COMPONENT_ROWS: tl.constexpr = BLOCK_M // 2 if STACKED else BLOCK_M
    BLOCK_Q: tl.constexpr = COMPONENT_ROWS // GROUP_PAD
    VALUE_HEADS: tl.constexpr = 2 if DIFFERENTIAL else 1  # V tile: [v] or [v1 | v2]
    if RUNTIME_SCALARS:
        scale = tl.load(scalars_ptr)
        softcap = tl.load(scalars_ptr + 1)
    else:  # Inductor passes a float that float32 cannot hold exactly as float64
        scale = tl.cast(scale, tl.float32)
        softcap = tl.cast(softcap, tl.float32)
    if K_SCALED:  # scores (q . k) * k_scale * scale; the softcap sees the scaled score
        scale = scale * tl.load(k_scale_ptr)
    if V_SCALED:
        v_scale = tl.load(v_scale_ptr)
    else:
        v_scale = 1.0
    if F16_TILES:  # q . k = (q * 2^-8) . k * 2^8
        compute_ty = tl.float16
        scale = scale * 256.0
    else:
        compute_ty = q_ptr.dtype.element_ty  # K/V tiles of an fp8 cache are converted to it
    q_tile = tl.program_id(0)
    kv_unit = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    # The sequence ``seq`` with ``start(seq) <= q_tile < start(seq + 1)``, where
    # ``start(b) = cu_seqlens_q[b] // BLOCK_Q + b`` (strictly increasing in ``b``): a binary
    # search written inline, not as a called function: Inductor's mutation analysis of a
    # traced kernel counts every pointer passed to a call whose result reaches a store
    # address as written (it would copy cu_seqlens_q around each launch). At most B - 1: tokens
    # past cu_seqlens_q[B] (the op's contract rules them out) land in sequence B - 1's empty
    # tiles, never past the metadata.
    seq: tl.int32 = 0
    right = num_seqs - 1
    while seq < right:
        mid = (seq + right + 1) // 2
        if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= q_tile:
            seq = mid
        else:
            right = mid - 1
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_first = (q_tile - q_start // BLOCK_Q - seq) * BLOCK_Q
    if q_first >= q_len:
        return
    if PAGED:
        kv_len = tl.load(kv_lens_ptr + seq)
    else:
        kv_start = tl.load(kv_lens_ptr + seq)
        kv_len = tl.load(kv_lens_ptr + seq + 1) - kv_start

    rows = tl.arange(0, BLOCK_M)
    component = rows // COMPONENT_ROWS  # 0, or 1 for the q2 rows of a stacked tile
    q_idx, head, head_ok, row_ok, token = _tile_rows(rows, q_first, q_start, q_len, kv_unit,
                                                     COMPONENT_ROWS, GROUP, GROUP_PAD)
    pos = q_idx + kv_len - q_len
    dims = tl.arange(0, HEAD_SIZE_PAD)
    dim_ok = dims < HEAD_SIZE
    # Value columns: column c is dim c % HEAD_SIZE_PAD of value head c // HEAD_SIZE_PAD.
    cols = tl.arange(0, VALUE_HEADS * HEAD_SIZE_PAD)
    col_ok = cols % HEAD_SIZE_PAD < HEAD_SIZE
    col_offset = (cols // HEAD_SIZE_PAD) * HEAD_SIZE + cols % HEAD_SIZE_PAD  # in [v1 | v2]

    if DIFFERENTIAL:
        q_head = 2 * head + component
        kv_head = 2 * kv_unit
    else:
        q_head = head
        kv_head = kv_unit
    TWO_STATES: tl.constexpr = DIFFERENTIAL and not STACKED

    # Keys this tile can see, in whole key tiles; this split's share of them. Keys in
    # [full_lo, full_hi) are visible from every row: tiles inside need no mask.
    pos_first = q_first + kv_len - q_len
    pos_last = tl.minimum(q_first + BLOCK_Q, q_len) - 1 + kv_len - q_len
    kv_hi = tl.maximum(tl.minimum(pos_last - min_dist + 1, kv_len), 0)
    full_lo = pos_last - max_dist
    full_hi = tl.minimum(pos_first - min_dist + 1, kv_len)
    tile_lo = tl.maximum(pos_first - max_dist, 0) // TILE_N
    num_tiles = tl.maximum(tl.cdiv(kv_hi, TILE_N) - tile_lo, 0)
    per_split = tl.cdiv(num_tiles, num_splits)
    tile_begin = tile_lo + split * per_split
    tile_end = tl.minimum(tile_begin + per_split, tile_lo + num_tiles)

    if SPLIT and tile_end <= tile_begin:
        # A split that sees no key tile (a sequence far shorter than the launch's key
        # bound) stores lse = -inf and no partial: the merge reads no partial of it.
        lse = lse_ptr + split * stride_ls + token * stride_lt + q_head * stride_lh
        tl.store(lse, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
        if TWO_STATES:
            tl.store(lse + stride_lh, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
        return
    if STACKED:  # [BLOCK_M, 2D]: q1 rows in the k1 columns, q2 rows in the k2 columns
        q_ptrs = (q_ptr + token[:, None] * stride_qt + q_head[:, None] * stride_qh
                  + (cols % HEAD_SIZE_PAD)[None, :] * stride_qd)
        q_mask = row_ok[:, None] & col_ok[None, :] & ((cols // HEAD_SIZE_PAD)[None, :] == component[:, None])
    else:
        q_ptrs = q_ptr + token[:, None] * stride_qt + q_head[:, None] * stride_qh + dims[None, :] * stride_qd
        q_mask = row_ok[:, None] & dim_ok[None, :]
    q1 = _query_tile(q_ptrs, q_mask, F16_TILES)
    if ALIBI:
        slope1 = tl.load(alibi_ptr + q_head, mask=head_ok, other=0.0)
    else:
        slope1 = tl.zeros([BLOCK_M], tl.float32)
    m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l1 = tl.zeros([BLOCK_M], tl.float32)
    acc1 = tl.zeros([BLOCK_M, VALUE_HEADS * HEAD_SIZE_PAD], tl.float32)  # softmax1 . [v1 | v2]
    if TWO_STATES:
        q2 = _query_tile(q_ptrs + stride_qh, q_mask, F16_TILES)
        if ALIBI:
            slope2 = tl.load(alibi_ptr + q_head + 1, mask=head_ok, other=0.0)
        else:
            slope2 = tl.zeros([BLOCK_M], tl.float32)
        m2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l2 = tl.zeros([BLOCK_M], tl.float32)
        acc2 = tl.zeros([BLOCK_M, VALUE_HEADS * HEAD_SIZE_PAD], tl.float32)  # softmax2 . [v1 | v2]

    offs_n = tl.arange(0, TILE_N)
    for kv_tile in range(tile_begin, tile_end):
        kpos = kv_tile * TILE_N + offs_n
        kv_ok = kpos < kv_hi
        if PAGED:
            block = tl.load(block_table_ptr + seq * stride_bt + kpos // BLOCK_SIZE, mask=kv_ok, other=0)
            k_rows = block.to(tl.int64) * stride_kb + (kpos % BLOCK_SIZE) * stride_ks
            v_rows = block.to(tl.int64) * stride_vb + (kpos % BLOCK_SIZE) * stride_vs
        else:
            k_rows = (kv_start + kpos).to(tl.int64) * stride_kb
            v_rows = (kv_start + kpos).to(tl.int64) * stride_vb
        v_ptrs = (v_ptr + v_rows[:, None] + (kv_head + cols // HEAD_SIZE_PAD)[None, :] * stride_vh
                  + (cols % HEAD_SIZE_PAD)[None, :] * stride_vd)
        v = tl.load(v_ptrs, mask=kv_ok[:, None] & col_ok[None, :], other=0.0).to(compute_ty)
        if STACKED:  # [k1 | k2], addressed as [v1 | v2]
            k_ptrs = (k_ptr + k_rows[:, None] + (kv_head + cols // HEAD_SIZE_PAD)[None, :] * stride_kh
                      + (cols % HEAD_SIZE_PAD)[None, :] * stride_kd)
            k_mask = kv_ok[:, None] & col_ok[None, :]
        else:
            k_ptrs = k_ptr + k_rows[:, None] + kv_head * stride_kh + dims[None, :] * stride_kd
            k_mask = kv_ok[:, None] & dim_ok[None, :]
        k1 = tl.load(k_ptrs, mask=k_mask, other=0.0).to(compute_ty)
        dist = pos[:, None] - kpos[None, :]
        s1 = _scores(q1, k1, dist, scale, softcap, slope1, SOFTCAP, ALIBI, RUNTIME_SCALARS)
        if TWO_STATES:
            k2 = tl.load(k_ptrs + stride_kh, mask=k_mask, other=0.0).to(compute_ty)
            s2 = _scores(q2, k2, dist, scale, softcap, slope2, SOFTCAP, ALIBI, RUNTIME_SCALARS)
        if (kv_tile * TILE_N < full_lo) | ((kv_tile + 1) * TILE_N > full_hi):  # edge tile
            visible = (dist >= min_dist) & (dist <= max_dist) & kv_ok[None, :]
            s1 = tl.where(visible, s1, float("-inf"))
            if TWO_STATES:
                s2 = tl.where(visible, s2, float("-inf"))

        m1, l1, p1, alpha1 = _online_softmax(m1, l1, s1)
        acc1 = acc1 * alpha1[:, None] + tl.dot(p1.to(v.dtype), v, input_precision="ieee")
        if TWO_STATES:
            m2, l2, p2, alpha2 = _online_softmax(m2, l2, s2)
            acc2 = acc2 * alpha2[:, None] + tl.dot(p2.to(v.dtype), v, input_precision="ieee")

    out_mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT:
        # Normalized partials and log-sum-exp of every query head (component) on its own row.
        part = (out_ptr + split * stride_os + token[:, None] * stride_ot
                + q_head[:, None] * stride_oh + col_offset[None, :] * stride_od)
        lse = lse_ptr + split * stride_ls + token * stride_lt + q_head * stride_lh
        tl.store(part, _normalize(acc1, l1) * v_scale, mask=out_mask)
        tl.store(lse, _log_sum_exp(m1, l1), mask=row_ok)
        if TWO_STATES:
            tl.store(part + stride_oh, _normalize(acc2, l2) * v_scale, mask=out_mask)
            tl.store(lse + stride_lh, _log_sum_exp(m2, l2), mask=row_ok)
    elif DIFFERENTIAL:
        if STACKED:  # rows [q1 rows; q2 rows] -> o1, o2 of the first COMPONENT_ROWS rows
            both = tl.reshape(_normalize(acc1, l1), [2, COMPONENT_ROWS, 2 * HEAD_SIZE_PAD])
            o1, o2 = tl.split(tl.permute(both, (1, 2, 0)))
            _, head, head_ok, row_ok, token = _tile_rows(tl.arange(0, COMPONENT_ROWS), q_first, q_start, q_len,
                                                         kv_unit, COMPONENT_ROWS, GROUP, GROUP_PAD)
            out_mask = row_ok[:, None] & col_ok[None, :]
        else:
            o1 = _normalize(acc1, l1)
            o2 = _normalize(acc2, l2)
        if LAMBDA_PER_PAIR:
            lam = tl.load(lambda_ptr + head, mask=head_ok, other=0.0).to(tl.float32)
        else:
            lam = tl.zeros([COMPONENT_ROWS], tl.float32) + tl.load(lambda_ptr).to(tl.float32)
        out = (out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
               + col_offset[None, :] * stride_od)
        tl.store(out, ((o1 - lam[:, None] * o2) * v_scale).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        out = (out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
               + col_offset[None, :] * stride_od)
        tl.store(out, (_normalize(acc1, l1) * v_scale).to(out_ptr.dtype.element_ty), mask=out_mask)
