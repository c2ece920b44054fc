"""Backward of ``varlen_attention`` in Triton: the CUDA kernel of ``compiled_attn::varlen_attention_backward``.

Math: the FlashAttention-2 backward (Dao 2023, arXiv 2307.08691, algorithm 2; the structure
of Triton's fused-attention tutorial, ``python/tutorials/06-fused-attention.py``), with the
semantics of :func:`compiled_attn.ops.gradients.varlen_attention_backward` (the oracle):
``flash_attn_varlen_func`` masks (bottom-right aligned causal mask, sliding window), softcap,
ALiBi, GQA and differential attention over interleaved head pairs. The op's schema passes no
saved output or log-sum-exp, so the kernels recompute them. Shapes (``T`` tokens, ``Hq``
query heads, ``Hkv`` KV heads, ``D`` head size, ``Dv`` = ``D``, or ``2D`` differential)::

    q [Tq, Hq, D]   k, v [Tk, Hkv, D]   grad_out [Tq, Hq, D] or, differential, [Tq, Hq/2, 2D]
    lse, delta: float32 scratch [Tq, Hq] (one row per query head, differential: 2j + c)

Per query head (differential: per component ``c`` of pair ``j``, with upstream weight
``w_c = (1, -lambda_j)`` and values ``[v1 | v2]`` of its KV pair), ``S = scale * q kᵀ``
(then ``softcap * tanh(S / softcap)``, then ``- slope * |p - j|``), ``P = softmax(S)``
(zero on hidden keys; a row that sees no key has ``P = 0``) and ``dP = w_c dO Vᵀ``:

* ``D̃ = rowsum(P ∘ (dO Vᵀ))`` (``rowsum(dO ∘ O_c)`` without ``O_c``), so FA2's
  ``rowsum(dO ∘ O) = w_c D̃`` and ``dS = w_c P ∘ (dO Vᵀ - D̃)``, times ``1 - tanh²`` under
  a softcap;
* ``dQ = scale * dS K``, ``dK = scale * dSᵀ Q`` (summed over the GQA group),
  ``dV = Σ_c w_c Pᵀ dO`` (``(P1 - λ P2)ᵀ dO`` for a pair);
* ``dλ_j = -Σ_i D̃_{2,i}`` over the tokens (summed over the pairs for a 0-d ``λ``).

Two launches, no atomics (deterministic), grids from shapes only (CUDA-graph safe):

* :func:`attention_backward_dq_kernel`, one program per query tile x KV head (pair), rows as
  the forward's (``BLOCK_Q`` tokens x the ``GROUP_PAD`` query heads (pairs) of the KV head
  (pair), :func:`.attention_kernel._tile_rows`): a first pass over its key tiles is the
  online softmax of the forward, accumulating ``l`` and ``Σ exp(S - m) (dO Vᵀ)`` instead of
  an output, and stores ``lse`` (base 2) and ``D̃``; a second pass accumulates ``dQ``.
* :func:`attention_backward_dkdv_kernel`, one program per key tile x KV head (pair): loops
  over the query tiles that see its keys (every query head of the group in one tile's rows)
  and accumulates ``dK`` (both components) and ``dV``, reading ``lse`` and ``D̃``.

A tile finds its sequence as the forward's does: sequence ``b`` owns tiles from
``cu_seqlens[b] // BLOCK + b`` on, so ``T // BLOCK + B`` tiles bound any batch. One more
tile is launched, and tokens past ``cu_seqlens[B]`` (buffers longer than the batch) form a
last "sequence" that sees nothing, so their gradients are written as zeros and the outputs
never need a memset. Head sizes 1-256 as the forward (tiles ``HEAD_SIZE_PAD`` wide, masked).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..attention import default_scale, resolve_scalars
from ..gradients import varlen_attention_backward as reference_backward
from .attention import visibility_bounds
from .attention_kernel import LOG2E, _online_softmax, _tanh, _tile_rows
from .launch_utils import CachedLauncher, alignments, device_guard, next_power_of_2

MIN_BLOCK = 16  # smallest M, N and K of tl.dot
ACCUMULATOR_BUDGET = 16384  # float32 accumulator elements per program


@dataclass(frozen=True)
class BackwardTiles:
    """Tiles of the two kernels: ``dq_rows`` query rows (``dq_rows // GROUP_PAD`` tokens x
    ``GROUP_PAD`` heads) against ``dq_keys`` keys per step; ``dkdv_keys`` keys per program
    against ``dkdv_rows`` query rows per step; warps and pipeline stages of each kernel."""

    dq_rows: int
    dq_keys: int
    dkdv_keys: int
    dkdv_rows: int
    dq_warps: int = 4
    dkdv_warps: int = 4
    num_stages: int = 2


def choose_backward_tiles(num_tokens: int, num_seqs: int, group_pad: int, head_size_pad: int,
                          differential: bool, dtype: torch.dtype) -> BackwardTiles:
    """Tiles from shapes only. float32 accumulators per program stay within
    ``ACCUMULATOR_BUDGET`` (a quarter of it for float32 operands, whose dots run on FMA
    units): ``dQ`` (one ``D`` per component) per dQ row, ``dK`` per component and ``dV``
    (``Dv``) per key. A starting point, not tuned on a GPU (FA2 and the Triton tutorial use
    32-128 x 32-128 tiles); ptxas for sm90 reports at most a few hundred bytes of spills
    for bfloat16 head sizes 64-256 with these. float32 runs unpipelined (``num_stages=1``):
    pipelined, its dK/dV tiles spilled kilobytes."""
    components = 2 if differential else 1
    fp32 = dtype == torch.float32
    budget = ACCUMULATOR_BUDGET // (4 if fp32 else 1)
    rows_per_seq = triton.cdiv(num_tokens, max(num_seqs, 1)) * group_pad
    dq_max = max(MIN_BLOCK, min(128, budget // (head_size_pad * components)))
    dq_rows = max(MIN_BLOCK, group_pad, min(next_power_of_2(rows_per_seq), dq_max))
    dq_keys = 16 if fp32 else 64 if head_size_pad * components <= 64 else 32
    per_key = head_size_pad * 2 * components  # dK per component + dV ([v1 | v2] differential)
    dkdv_keys = max(MIN_BLOCK, min(128, budget // per_key))
    dkdv_rows = max(32, group_pad)
    dq_warps = 8 if dq_rows * head_size_pad * components >= 8192 else 4
    dkdv_warps = 8 if dkdv_keys * per_key >= 8192 else 4
    return BackwardTiles(dq_rows, dq_keys, dkdv_keys, dkdv_rows, dq_warps, dkdv_warps, num_stages=1 if fp32 else 2)


# --- kernels ---------------------------------------------------------------------------------


@triton.jit
def _runtime_scalars(scale, softcap, scalars_ptr, RUNTIME_SCALARS: tl.constexpr):
    """``(scale, softcap)`` as float32: the arguments, or the ``scale_softcap`` tensor's values."""
    if RUNTIME_SCALARS:
        scale = tl.load(scalars_ptr)
        softcap = tl.load(scalars_ptr + 1)
    else:  # Inductor may pass a float that float32 cannot hold exactly as float64
        scale = tl.cast(scale, tl.float32)
        softcap = tl.cast(softcap, tl.float32)
    return scale, softcap


@triton.jit
def _scores(q, k, dist, scale, softcap, slope, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
            RUNTIME_SCALARS: tl.constexpr):
    """Unmasked base-2 scores ``[M, N]`` float32 of ``q`` ``[M, HEAD_SIZE_PAD]`` and ``k``
    ``[N, HEAD_SIZE_PAD]`` (``dist = p - j``, ALiBi only), and the softcap's chain factor
    ``dS/ds = 1 - tanh²(s / softcap)`` (1 without a softcap)."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    chain = 1.0
    if SOFTCAP:
        if RUNTIME_SCALARS:  # a softcap of 0 turns capping off at run time
            t = _tanh(s / tl.where(softcap > 0, softcap, 1.0))
            s = tl.where(softcap > 0, softcap * t, s)
            chain = tl.where(softcap > 0, 1.0 - t * t, 1.0)
        else:
            t = _tanh(s / softcap)
            s = softcap * t
            chain = 1.0 - t * t
    if ALIBI:
        s -= slope[:, None] * tl.abs(dist).to(tl.float32)
    return s * LOG2E, chain


@triton.jit
def _key_tiles(q_first, q_len, kv_len, min_dist, max_dist, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr):
    """Key tiles ``[tile_lo, tile_hi)`` that query rows ``q_first .. q_first + BLOCK_Q - 1``
    can see, and ``[full_lo, full_hi)``: keys every real row of them sees (no mask needed)."""
    pos_first = q_first + kv_len - q_len
    pos_last = tl.minimum(q_first + BLOCK_Q, q_len) - 1 + kv_len - q_len
    kv_hi = tl.maximum(tl.minimum(pos_last - min_dist + 1, kv_len), 0)
    tile_lo = tl.maximum(pos_first - max_dist, 0) // TILE_N
    tile_hi = tl.maximum(tl.cdiv(kv_hi, TILE_N), tile_lo)
    return tile_lo, tile_hi, pos_last - max_dist, tl.minimum(pos_first - min_dist + 1, kv_len)


@triton.jit
def _query_tiles(k_first, q_len, kv_len, min_dist, max_dist, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query tiles ``[tile_lo, tile_hi)`` that see a key of ``k_first .. k_first + BLOCK_N - 1``
    and ``[full_lo, full_hi)``: queries that see every one of those keys (empty when the key
    tile is partial). Query ``i`` sees key ``j`` when ``min_dist <= i + kv_len - q_len - j <= max_dist``."""
    shift = kv_len - q_len
    k_last = tl.minimum(k_first + BLOCK_N, kv_len) - 1
    q_lo = tl.maximum(k_first + min_dist - shift, 0)
    q_hi = tl.minimum(k_last + max_dist - shift + 1, q_len)
    tile_lo = q_lo // BLOCK_Q
    tile_hi = tl.maximum(tl.cdiv(q_hi, BLOCK_Q), tile_lo)
    full_hi = tl.minimum(k_first + max_dist - shift + 1, q_len)
    full_hi = tl.where(k_first + BLOCK_N <= kv_len, full_hi, -1)
    return tile_lo, tile_hi, k_last + min_dist - shift, full_hi


# Arguments whose values change with the batch are not specialized (one variant per plan).
@triton.jit(do_not_specialize=["num_seqs", "total_q", "min_dist", "max_dist"])
def attention_backward_dq_kernel(
    dq_ptr, lse_ptr, delta_ptr, grad_ptr, q_ptr, k_ptr, v_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr,
    lambda_ptr, alibi_ptr, scalars_ptr,
    num_seqs, total_q, scale, softcap, min_dist, max_dist,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_gt, stride_gh, stride_gd, stride_dqt, stride_dqh, stride_dqd, stride_lt,
    DIFFERENTIAL: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, LAMBDA_PER_PAIR: tl.constexpr,
    RUNTIME_SCALARS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_SIZE_PAD: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
):
    """Statistics and ``dQ`` of one query tile x one KV head (pair); grid
    ``(Tq // BLOCK_Q + B + 1, Hkv or Hkv / 2)``.

    Args:
        dq_ptr: ``[Tq, Hq, D]`` out, q's dtype.
        lse_ptr, delta_ptr: float32 ``[Tq, Hq]`` out (row stride ``stride_lt``, head stride 1):
            base-2 log-sum-exp (0 for a row that sees no key) and ``D̃``.
        grad_ptr: ``[Tq, Hq, D]`` or ``[Tq, Hq/2, 2D]``. q_ptr: ``[Tq, Hq, D]``;
            k_ptr, v_ptr: ``[Tk, Hkv, D]``; float16/bfloat16/float32.
        cu_seqlens_q_ptr, cu_seqlens_k_ptr: ``[B + 1]`` int32.
        lambda_ptr: ``[]`` or ``[Hq/2]`` (``LAMBDA_PER_PAIR``), differential only.
        alibi_ptr: ``[Hq]`` float32 (``ALIBI``). scalars_ptr: float32 ``(scale, softcap)``
            (``RUNTIME_SCALARS``).
        total_q: ``Tq`` (the tokens past ``cu_seqlens_q[B]`` get zeros).
        min_dist, max_dist: key ``j`` is visible from key position ``p`` when
            ``min_dist <= p - j <= max_dist``.
    """
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    VALUE_HEADS: tl.constexpr = 2 if DIFFERENTIAL else 1
    scale, softcap = _runtime_scalars(scale, softcap, scalars_ptr, RUNTIME_SCALARS)
    compute_ty = q_ptr.dtype.element_ty
    q_tile = tl.program_id(0)
    kv_unit = tl.program_id(1)

    # The sequence with start(seq) <= q_tile < start(seq + 1), start(b) = cu_seqlens_q[b] // BLOCK_Q + b,
    # seq == num_seqs for the tokens past the last sequence. Inline, as in the forward kernel
    # (Inductor's mutation analysis would count a pointer passed to a helper as written).
    seq: tl.int32 = 0
    right = num_seqs
    while seq < right:
        mid = (seq + right + 1) // 2
        if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= q_tile:
            seq = mid
        else:
            right = mid - 1
    real_seq = seq < num_seqs
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.where(real_seq, tl.load(cu_seqlens_q_ptr + tl.minimum(seq + 1, num_seqs)), total_q) - q_start
    q_first = (q_tile - q_start // BLOCK_Q - seq) * BLOCK_Q
    if q_first >= q_len:
        return
    kv_start = tl.load(cu_seqlens_k_ptr + seq)
    kv_len = tl.where(real_seq, tl.load(cu_seqlens_k_ptr + tl.minimum(seq + 1, num_seqs)), kv_start) - kv_start

    rows = tl.arange(0, BLOCK_M)
    q_idx, head, head_ok, row_ok, token = _tile_rows(rows, q_first, q_start, q_len, kv_unit, BLOCK_M, GROUP,
                                                     GROUP_PAD)
    pos = q_idx + kv_len - q_len
    dims = tl.arange(0, HEAD_SIZE_PAD)
    dim_ok = dims < HEAD_SIZE
    cols = tl.arange(0, VALUE_HEADS * HEAD_SIZE_PAD)  # column c: dim c % HEAD_SIZE_PAD of value head c // ...
    col_ok = cols % HEAD_SIZE_PAD < HEAD_SIZE
    col_offset = (cols // HEAD_SIZE_PAD) * HEAD_SIZE + cols % HEAD_SIZE_PAD  # in [v1 | v2]
    if DIFFERENTIAL:
        q_head = 2 * head
        kv_head = 2 * kv_unit
    else:
        q_head = head
        kv_head = kv_unit

    q_ptrs = q_ptr + token[:, None] * stride_qt + q_head[:, None] * stride_qh + dims[None, :] * stride_qd
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q1 = tl.load(q_ptrs, mask=q_mask, other=0.0)
    g_ptrs = grad_ptr + token[:, None] * stride_gt + head[:, None] * stride_gh + col_offset[None, :] * stride_gd
    g = tl.load(g_ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(compute_ty)
    if ALIBI:
        slope1 = tl.load(alibi_ptr + q_head, mask=head_ok, other=0.0)
    else:
        slope1 = tl.zeros([BLOCK_M], tl.float32)
    if DIFFERENTIAL:
        q2 = tl.load(q_ptrs + stride_qh, mask=q_mask, other=0.0)
        if ALIBI:
            slope2 = tl.load(alibi_ptr + q_head + 1, mask=head_ok, other=0.0)
        else:
            slope2 = tl.zeros([BLOCK_M], tl.float32)
        if LAMBDA_PER_PAIR:
            lam = tl.load(lambda_ptr + head, mask=head_ok, other=0.0).to(tl.float32)
        else:
            lam = tl.zeros([BLOCK_M], tl.float32) + tl.load(lambda_ptr).to(tl.float32)

    tile_lo, tile_hi, full_lo, full_hi = _key_tiles(q_first, q_len, kv_len, min_dist, max_dist, BLOCK_Q, TILE_N)
    offs_n = tl.arange(0, TILE_N)
    k_cols = kv_head * stride_kh + dims[None, :] * stride_kd
    v_cols = (kv_head + cols // HEAD_SIZE_PAD)[None, :] * stride_vh + (cols % HEAD_SIZE_PAD)[None, :] * stride_vd

    # Pass 1: online softmax of each component and D̃ = rowsum(P ∘ (dO Vᵀ)).
    m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l1 = tl.zeros([BLOCK_M], tl.float32)
    a1 = tl.zeros([BLOCK_M], tl.float32)
    if DIFFERENTIAL:
        m2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l2 = tl.zeros([BLOCK_M], tl.float32)
        a2 = tl.zeros([BLOCK_M], tl.float32)
    for kv_tile in range(tile_lo, tile_hi):
        kpos = kv_tile * TILE_N + offs_n
        kv_ok = kpos < kv_len
        key_rows = (kv_start + kpos).to(tl.int64)
        k_ptrs = k_ptr + key_rows[:, None] * stride_kt + k_cols
        k_mask = kv_ok[:, None] & dim_ok[None, :]
        k1 = tl.load(k_ptrs, mask=k_mask, other=0.0)
        v = tl.load(v_ptr + key_rows[:, None] * stride_vt + v_cols, mask=kv_ok[:, None] & col_ok[None, :],
                    other=0.0)
        dist = pos[:, None] - kpos[None, :]
        s1, _ = _scores(q1, k1, dist, scale, softcap, slope1, SOFTCAP, ALIBI, RUNTIME_SCALARS)
        dov = tl.dot(g, tl.trans(v), input_precision="ieee")
        if DIFFERENTIAL:
            k2 = tl.load(k_ptrs + stride_kh, mask=k_mask, other=0.0)
            s2, _ = _scores(q2, k2, dist, scale, softcap, slope2, SOFTCAP, ALIBI, RUNTIME_SCALARS)
        if (kv_tile * TILE_N < full_lo) | ((kv_tile + 1) * TILE_N > full_hi):  # edge tile
            visible = (dist >= min_dist) & (dist <= max_dist) & kv_ok[None, :]
            s1 = tl.where(visible, s1, float("-inf"))
            if DIFFERENTIAL:
                s2 = tl.where(visible, s2, float("-inf"))
        m1, l1, p1, alpha1 = _online_softmax(m1, l1, s1)
        a1 = a1 * alpha1 + tl.sum(p1 * dov, 1)
        if DIFFERENTIAL:
            m2, l2, p2, alpha2 = _online_softmax(m2, l2, s2)
            a2 = a2 * alpha2 + tl.sum(p2 * dov, 1)

    # Rows that see no key: lse 0 (their P is masked to 0 anyway) and D̃ 0.
    lse1 = tl.where(l1 > 0, m1 + tl.log2(tl.where(l1 > 0, l1, 1.0)), 0.0)
    d1 = tl.where(l1 > 0, a1 / tl.where(l1 > 0, l1, 1.0), 0.0)
    stats = token * stride_lt + q_head
    tl.store(lse_ptr + stats, lse1, mask=row_ok)
    tl.store(delta_ptr + stats, d1, mask=row_ok)
    if DIFFERENTIAL:
        lse2 = tl.where(l2 > 0, m2 + tl.log2(tl.where(l2 > 0, l2, 1.0)), 0.0)
        d2 = tl.where(l2 > 0, a2 / tl.where(l2 > 0, l2, 1.0), 0.0)
        tl.store(lse_ptr + stats + 1, lse2, mask=row_ok)
        tl.store(delta_ptr + stats + 1, d2, mask=row_ok)

    # Pass 2: dS = w P ∘ (dO Vᵀ - D̃) (∘ the softcap's chain factor), dQ = scale * dS K.
    dq1 = tl.zeros([BLOCK_M, HEAD_SIZE_PAD], tl.float32)
    if DIFFERENTIAL:
        dq2 = tl.zeros([BLOCK_M, HEAD_SIZE_PAD], tl.float32)
    for kv_tile in range(tile_lo, tile_hi):
        kpos = kv_tile * TILE_N + offs_n
        kv_ok = kpos < kv_len
        key_rows = (kv_start + kpos).to(tl.int64)
        k_ptrs = k_ptr + key_rows[:, None] * stride_kt + k_cols
        k_mask = kv_ok[:, None] & dim_ok[None, :]
        k1 = tl.load(k_ptrs, mask=k_mask, other=0.0)
        v = tl.load(v_ptr + key_rows[:, None] * stride_vt + v_cols, mask=kv_ok[:, None] & col_ok[None, :],
                    other=0.0)
        dist = pos[:, None] - kpos[None, :]
        s1, chain1 = _scores(q1, k1, dist, scale, softcap, slope1, SOFTCAP, ALIBI, RUNTIME_SCALARS)
        dov = tl.dot(g, tl.trans(v), input_precision="ieee")
        if DIFFERENTIAL:
            k2 = tl.load(k_ptrs + stride_kh, mask=k_mask, other=0.0)
            s2, chain2 = _scores(q2, k2, dist, scale, softcap, slope2, SOFTCAP, ALIBI, RUNTIME_SCALARS)
        if (kv_tile * TILE_N < full_lo) | ((kv_tile + 1) * TILE_N > full_hi):  # edge tile
            visible = (dist >= min_dist) & (dist <= max_dist) & kv_ok[None, :]
            s1 = tl.where(visible, s1, float("-inf"))
            if DIFFERENTIAL:
                s2 = tl.where(visible, s2, float("-inf"))
        ds1 = tl.exp2(s1 - lse1[:, None]) * (dov - d1[:, None]) * chain1
        dq1 += tl.dot(ds1.to(compute_ty), k1, input_precision="ieee")
        if DIFFERENTIAL:
            ds2 = tl.exp2(s2 - lse2[:, None]) * (dov - d2[:, None]) * chain2 * -lam[:, None]
            dq2 += tl.dot(ds2.to(compute_ty), k2, input_precision="ieee")

    dq_ptrs = dq_ptr + token[:, None] * stride_dqt + q_head[:, None] * stride_dqh + dims[None, :] * stride_dqd
    tl.store(dq_ptrs, (dq1 * scale).to(dq_ptr.dtype.element_ty), mask=q_mask)
    if DIFFERENTIAL:
        tl.store(dq_ptrs + stride_dqh, (dq2 * scale).to(dq_ptr.dtype.element_ty), mask=q_mask)


@triton.jit(do_not_specialize=["num_seqs", "total_k", "min_dist", "max_dist"])
def attention_backward_dkdv_kernel(
    dk_ptr, dv_ptr, lse_ptr, delta_ptr, grad_ptr, q_ptr, k_ptr, v_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr,
    lambda_ptr, alibi_ptr, scalars_ptr,
    num_seqs, total_k, scale, softcap, min_dist, max_dist,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_gt, stride_gh, stride_gd, stride_dkt, stride_dkh, stride_dkd, stride_dvt, stride_dvh, stride_dvd,
    stride_lt,
    DIFFERENTIAL: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, LAMBDA_PER_PAIR: tl.constexpr,
    RUNTIME_SCALARS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_SIZE_PAD: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """``dK`` and ``dV`` of one key tile x one KV head (pair); grid
    ``(Tk // BLOCK_N + B + 1, Hkv or Hkv / 2)``. Runs after
    :func:`attention_backward_dq_kernel` (reads its ``lse`` and ``D̃``).

    Args:
        dk_ptr, dv_ptr: ``[Tk, Hkv, D]`` out, k's and v's dtype.
        total_k: ``Tk`` (the keys past ``cu_seqlens_k[B]`` get zeros).
        Others: as :func:`attention_backward_dq_kernel`; ``BLOCK_M`` query rows
        (``BLOCK_M // GROUP_PAD`` tokens x ``GROUP_PAD`` heads) per step.
    """
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    VALUE_HEADS: tl.constexpr = 2 if DIFFERENTIAL else 1
    scale, softcap = _runtime_scalars(scale, softcap, scalars_ptr, RUNTIME_SCALARS)
    compute_ty = q_ptr.dtype.element_ty
    k_tile = tl.program_id(0)
    kv_unit = tl.program_id(1)

    # The sequence of this key tile (see the dq kernel), over cu_seqlens_k.
    seq: tl.int32 = 0
    right = num_seqs
    while seq < right:
        mid = (seq + right + 1) // 2
        if tl.load(cu_seqlens_k_ptr + mid) // BLOCK_N + mid <= k_tile:
            seq = mid
        else:
            right = mid - 1
    real_seq = seq < num_seqs
    kv_start = tl.load(cu_seqlens_k_ptr + seq)
    kv_len = tl.where(real_seq, tl.load(cu_seqlens_k_ptr + tl.minimum(seq + 1, num_seqs)), total_k) - kv_start
    k_first = (k_tile - kv_start // BLOCK_N - seq) * BLOCK_N
    if k_first >= kv_len:
        return
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.where(real_seq, tl.load(cu_seqlens_q_ptr + tl.minimum(seq + 1, num_seqs)), q_start) - q_start

    dims = tl.arange(0, HEAD_SIZE_PAD)
    dim_ok = dims < HEAD_SIZE
    cols = tl.arange(0, VALUE_HEADS * HEAD_SIZE_PAD)
    col_ok = cols % HEAD_SIZE_PAD < HEAD_SIZE
    col_offset = (cols // HEAD_SIZE_PAD) * HEAD_SIZE + cols % HEAD_SIZE_PAD
    if DIFFERENTIAL:
        kv_head = 2 * kv_unit
    else:
        kv_head = kv_unit
    kpos = k_first + tl.arange(0, BLOCK_N)
    kv_ok = kpos < kv_len
    key_rows = (kv_start + kpos).to(tl.int64)
    k_mask = kv_ok[:, None] & dim_ok[None, :]
    v_mask = kv_ok[:, None] & col_ok[None, :]
    k_offsets = key_rows[:, None] * stride_kt + kv_head * stride_kh + dims[None, :] * stride_kd
    v_offsets = (key_rows[:, None] * stride_vt + (kv_head + cols // HEAD_SIZE_PAD)[None, :] * stride_vh
                 + (cols % HEAD_SIZE_PAD)[None, :] * stride_vd)
    k1 = tl.load(k_ptr + k_offsets, mask=k_mask, other=0.0)
    v = tl.load(v_ptr + v_offsets, mask=v_mask, other=0.0)
    dk1 = tl.zeros([BLOCK_N, HEAD_SIZE_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, VALUE_HEADS * HEAD_SIZE_PAD], tl.float32)
    if DIFFERENTIAL:
        k2 = tl.load(k_ptr + k_offsets + stride_kh, mask=k_mask, other=0.0)
        dk2 = tl.zeros([BLOCK_N, HEAD_SIZE_PAD], tl.float32)

    tile_lo, tile_hi, full_lo, full_hi = _query_tiles(k_first, q_len, kv_len, min_dist, max_dist, BLOCK_Q, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    for q_tile in range(tile_lo, tile_hi):
        q_first = q_tile * BLOCK_Q
        q_idx, head, head_ok, row_ok, token = _tile_rows(rows, q_first, q_start, q_len, kv_unit, BLOCK_M, GROUP,
                                                         GROUP_PAD)
        if DIFFERENTIAL:
            q_head = 2 * head
        else:
            q_head = head
        q_ptrs = q_ptr + token[:, None] * stride_qt + q_head[:, None] * stride_qh + dims[None, :] * stride_qd
        q_mask = row_ok[:, None] & dim_ok[None, :]
        q1 = tl.load(q_ptrs, mask=q_mask, other=0.0)
        g_ptrs = grad_ptr + token[:, None] * stride_gt + head[:, None] * stride_gh + col_offset[None, :] * stride_gd
        g = tl.load(g_ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(compute_ty)
        stats = token * stride_lt + q_head
        lse1 = tl.load(lse_ptr + stats, mask=row_ok, other=0.0)
        d1 = tl.load(delta_ptr + stats, mask=row_ok, other=0.0)
        if ALIBI:
            slope1 = tl.load(alibi_ptr + q_head, mask=head_ok, other=0.0)
        else:
            slope1 = tl.zeros([BLOCK_M], tl.float32)
        dist = (q_idx + kv_len - q_len)[:, None] - kpos[None, :]
        s1, chain1 = _scores(q1, k1, dist, scale, softcap, slope1, SOFTCAP, ALIBI, RUNTIME_SCALARS)
        dov = tl.dot(g, tl.trans(v), input_precision="ieee")  # dO [v1 | v2]ᵀ, shared by the components
        if DIFFERENTIAL:
            q2 = tl.load(q_ptrs + stride_qh, mask=q_mask, other=0.0)
            lse2 = tl.load(lse_ptr + stats + 1, mask=row_ok, other=0.0)
            d2 = tl.load(delta_ptr + stats + 1, mask=row_ok, other=0.0)
            if ALIBI:
                slope2 = tl.load(alibi_ptr + q_head + 1, mask=head_ok, other=0.0)
            else:
                slope2 = tl.zeros([BLOCK_M], tl.float32)
            if LAMBDA_PER_PAIR:
                lam = tl.load(lambda_ptr + head, mask=head_ok, other=0.0).to(tl.float32)
            else:
                lam = tl.zeros([BLOCK_M], tl.float32) + tl.load(lambda_ptr).to(tl.float32)
            s2, chain2 = _scores(q2, k2, dist, scale, softcap, slope2, SOFTCAP, ALIBI, RUNTIME_SCALARS)
        # Rows of member padding in a whole tile have q = dO = 0, lse = D̃ = 0: they add exact zeros.
        if (q_first < full_lo) | (q_first + BLOCK_Q > full_hi):  # edge tile
            visible = (dist >= min_dist) & (dist <= max_dist) & kv_ok[None, :] & row_ok[:, None]
            s1 = tl.where(visible, s1, float("-inf"))
            if DIFFERENTIAL:
                s2 = tl.where(visible, s2, float("-inf"))
        p1 = tl.exp2(s1 - lse1[:, None])
        ds1 = p1 * (dov - d1[:, None]) * chain1
        dk1 += tl.dot(tl.trans(ds1.to(compute_ty)), q1, input_precision="ieee")
        if DIFFERENTIAL:
            p2 = tl.exp2(s2 - lse2[:, None])
            ds2 = p2 * (dov - d2[:, None]) * chain2 * -lam[:, None]
            dk2 += tl.dot(tl.trans(ds2.to(compute_ty)), q2, input_precision="ieee")
            p1 = p1 - lam[:, None] * p2  # dV = (P1 - λ P2)ᵀ dO
        dv += tl.dot(tl.trans(p1.to(compute_ty)), g, input_precision="ieee")

    tl.store(dk_ptr + key_rows[:, None] * stride_dkt + kv_head * stride_dkh + dims[None, :] * stride_dkd,
             (dk1 * scale).to(dk_ptr.dtype.element_ty), mask=k_mask)
    if DIFFERENTIAL:
        tl.store(dk_ptr + key_rows[:, None] * stride_dkt + (kv_head + 1) * stride_dkh + dims[None, :] * stride_dkd,
                 (dk2 * scale).to(dk_ptr.dtype.element_ty), mask=k_mask)
    tl.store(dv_ptr + key_rows[:, None] * stride_dvt + (kv_head + cols // HEAD_SIZE_PAD)[None, :] * stride_dvh
             + (cols % HEAD_SIZE_PAD)[None, :] * stride_dvd, dv.to(dv_ptr.dtype.element_ty), mask=v_mask)


# --- launcher --------------------------------------------------------------------------------

_DQ = CachedLauncher(attention_backward_dq_kernel)
_DKDV = CachedLauncher(attention_backward_dkdv_kernel)


def covers(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, scale, causal, window_left, window_right,
           softcap, alibi_slopes, scale_softcap) -> bool:
    """Whether the kernels run these schema arguments (shapes and dtypes only): float16,
    bfloat16 or float32 q/k/v, head size 1-256. Everything the forward accepts (softcap,
    ALiBi, ``scale_softcap``, windows, GQA, differential) is covered; the rest (e.g. float64,
    reachable only by calling the backward op directly) runs the reference."""
    return q.dtype in (torch.float16, torch.bfloat16, torch.float32) and 1 <= q.shape[-1] <= 256


@functools.lru_cache(maxsize=4096)
def _plan(num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int,
          differential: bool, dtype: torch.dtype) -> tuple[BackwardTiles, int, int]:
    group_pad = next_power_of_2(num_heads // num_kv_heads)
    head_size_pad = max(16, next_power_of_2(head_size))
    tiles = choose_backward_tiles(num_tokens, num_seqs, group_pad, head_size_pad, differential, dtype)
    return tiles, group_pad, head_size_pad


def varlen_attention_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    lambda_full: Tensor | None = None, scale: float | None = None, causal: bool = True, window_left: int = -1,
    window_right: int = -1, softcap: float = 0.0, alibi_slopes: Tensor | None = None,
    scale_softcap: Tensor | None = None, *, out: tuple[Tensor, Tensor, Tensor] | None = None,
    tiles: BackwardTiles | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The ``compiled_attn::varlen_attention_backward`` op on CUDA (arguments as its schema;
    CPU tensors too under ``TRITON_INTERPRET=1``).

    Args:
        grad_out: ``[Tq, Hq, D]`` or, differential, ``[Tq, Hq/2, 2D]``.
        q: ``[Tq, Hq, D]``; k, v: ``[Tk, Hkv, D]``; cu_seqlens_q/k: ``[B + 1]`` int32.
        lambda_full ... scale_softcap: as the forward op (``scale=None``: ``D ** -0.5``).
        out: optional ``(dq, dk, dv)`` buffers shaped and typed as ``q``, ``k``, ``v``; new
            tensors otherwise. Every element is written.
        tiles: force these tiles (tests); default from shapes (:func:`choose_backward_tiles`).

    Returns:
        ``(dq, dk, dv, dlambda)``; ``dlambda`` has ``lambda_full``'s shape and dtype, or is
        empty ``[0]`` for plain attention.
    """
    if not covers(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, scale, causal, window_left,
                  window_right, softcap, alibi_slopes, scale_softcap):
        s, cap = resolve_scalars(scale, softcap, scale_softcap)
        grads = reference_backward(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, s, causal,
                                   window_left, window_right, cap, alibi_slopes)
        if out is not None:
            for buffer, grad in zip(out, grads):
                buffer.copy_(grad)
            return (*out, grads[3])
        return grads
    differential = lambda_full is not None
    num_tokens, num_heads, head_size = q.shape
    num_keys, num_kv_heads = k.shape[0], k.shape[1]
    if out is None:
        dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    else:
        dq, dk, dv = out
    if num_tokens == 0 or num_keys == 0:  # nothing to attend: zero gradients
        for t in (dq, dk, dv):
            t.zero_()
        return dq, dk, dv, (q.new_empty(0) if lambda_full is None else torch.zeros_like(lambda_full))
    scale = default_scale(scale, head_size)
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    lambda_full = None if lambda_full is None else lambda_full.contiguous()
    alibi_slopes = None if alibi_slopes is None else alibi_slopes.contiguous()
    num_seqs = cu_seqlens_q.shape[0] - 1
    plan_tiles, group_pad, head_size_pad = _plan(num_tokens, num_seqs, num_heads, num_kv_heads, head_size,
                                                 differential, q.dtype)
    tiles = plan_tiles if tiles is None else tiles
    lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=q.device)
    delta = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=q.device)
    # Pointer arguments of disabled features point at q (never read).
    options = tuple(q if t is None else t for t in (lambda_full, alibi_slopes, scale_softcap))
    tensors = (grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, *options)
    flags = (lambda_full is not None and lambda_full.numel() > 1, softcap > 0 or scale_softcap is not None,
             alibi_slopes is not None, scale_softcap is not None)
    key = (grad_out.shape, grad_out.stride(), q.shape, q.stride(), k.shape, k.stride(), v.stride(), dq.stride(),
           dk.stride(), dv.stride(), q.dtype, k.dtype, v.dtype, grad_out.dtype, dq.dtype, dk.dtype, dv.dtype,
           None if lambda_full is None else lambda_full.dtype, num_seqs, differential, flags, tiles,
           q.get_device(), alignments((*tensors, dq, dk, dv, lse, delta)))

    def specialize(tile_names: tuple[str, str], tile_sizes: tuple[int, int], num_warps: int):
        constexprs = dict(DIFFERENTIAL=differential, LAMBDA_PER_PAIR=flags[0], SOFTCAP=flags[1], ALIBI=flags[2],
                          RUNTIME_SCALARS=flags[3], HEAD_SIZE=head_size, HEAD_SIZE_PAD=head_size_pad,
                          GROUP=num_heads // num_kv_heads, GROUP_PAD=group_pad,
                          **dict(zip(tile_names, tile_sizes)))
        return constexprs, dict(num_warps=num_warps, num_stages=tiles.num_stages)

    min_dist, max_dist = visibility_bounds(causal, window_left, window_right)
    num_kv_units = num_kv_heads // 2 if differential else num_kv_heads
    scalars = (num_seqs, scale, softcap, min_dist, max_dist)
    strides = (*q.stride(), *k.stride(), *v.stride(), *grad_out.stride())
    device_index = q.get_device()
    with device_guard(q):
        _DQ(key, (num_tokens // (tiles.dq_rows // group_pad) + num_seqs + 1, num_kv_units, 1),
            (dq, lse, delta, *tensors, scalars[0], num_tokens, *scalars[1:], *strides, *dq.stride(),
             lse.stride(0)),
            device_index,
            lambda: specialize(("BLOCK_M", "TILE_N"), (tiles.dq_rows, tiles.dq_keys), tiles.dq_warps))
        _DKDV(key, (num_keys // tiles.dkdv_keys + num_seqs + 1, num_kv_units, 1),
              (dk, dv, lse, delta, *tensors, scalars[0], num_keys, *scalars[1:], *strides, *dk.stride(),
               *dv.stride(), lse.stride(0)),
              device_index,
              lambda: specialize(("BLOCK_M", "BLOCK_N"), (tiles.dkdv_rows, tiles.dkdv_keys), tiles.dkdv_warps))
    if lambda_full is None:
        return dq, dk, dv, q.new_empty(0)
    dlambda = -delta.view(num_tokens, num_heads // 2, 2)[:, :, 1].sum(0)  # dλ_j = -Σ_t D̃ of component 2
    if lambda_full.numel() == 1:
        dlambda = dlambda.sum()
    return dq, dk, dv, dlambda.reshape(lambda_full.shape).to(lambda_full.dtype)
