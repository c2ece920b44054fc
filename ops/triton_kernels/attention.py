"""Host-side launchers of the attention kernel: paged and varlen, plain and differential.

Arguments and results follow :func:`compiled_attn.ops.paged_attention` and
:func:`compiled_attn.ops.varlen_attention` (flash-attn conventions); these functions do no
value checks (the public wrappers do). They accept CUDA tensors, or CPU tensors when
``TRITON_INTERPRET=1`` (tests). Every launch decision reads shapes only, never values.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .attention_kernel import attention_kernel
from .config import TileConfig, choose_num_splits, choose_tiles
from .launch_utils import device_guard, multiprocessor_count, next_power_of_2
from .merge_kernel import merge_splits_kernel

UNBOUNDED = 1 << 30  # a distance no sequence reaches


def visibility_bounds(causal: bool, window_left: int, window_right: int) -> tuple[int, int]:
    """``(min_dist, max_dist)`` such that key ``j`` is visible from key position ``p``
    exactly when ``min_dist <= p - j <= max_dist`` (causal and sliding window folded)."""
    if causal:
        min_dist = 0
    else:
        min_dist = -window_right if window_right >= 0 else -UNBOUNDED
    max_dist = window_left if window_left >= 0 else UNBOUNDED
    return min_dist, max_dist


def paged_attention(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, cu_seqlens_q: Tensor,
    seq_lens: Tensor, block_table: Tensor, lambda_full: Tensor | None = None, *,
    scale: float | None = None, causal: bool = True, window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0, alibi_slopes: Tensor | None = None, out: Tensor | None = None,
    num_splits: int | None = None,
) -> Tensor:
    """Paged attention, plain or differential (``lambda_full`` given).

    Args:
        query: ``[T, Hq, D]``; key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]``.
        cu_seqlens_q: ``[B + 1]`` int32; seq_lens: ``[B]`` int32; block_table:
            ``[B, max_blocks]`` int32.
        lambda_full, scale, causal, window_size, softcap, alibi_slopes: as
            :func:`compiled_attn.ops.paged_attention`.
        out: optional output buffer (``[T, Hq, D]`` or ``[T, Hq/2, 2D]``, query's dtype, last
            dim contiguous); a new tensor otherwise.
        num_splits: force this many flash-decoding splits (tests); default from shapes.

    Returns:
        ``out``.
    """
    max_kv_len = block_table.shape[1] * key_cache.shape[1]
    return _attention(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table,
                      max_kv_len, lambda_full, scale, causal, window_size, softcap, alibi_slopes,
                      out, num_splits)


def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    lambda_full: Tensor | None = None, *, scale: float | None = None, causal: bool = True,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    alibi_slopes: Tensor | None = None, out: Tensor | None = None, num_splits: int | None = None,
) -> Tensor:
    """Attention over packed contiguous ``k``/``v`` ``[total_k, Hkv, D]``, as
    ``flash_attn_varlen_func``; plain or differential. Other arguments as
    :func:`paged_attention`."""
    return _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, None, k.shape[0], lambda_full,
                      scale, causal, window_size, softcap, alibi_slopes, out, num_splits)


class LaunchPlan(NamedTuple):
    """What the shape heuristic picks for one launch (see :mod:`.config`)."""

    tiles: TileConfig
    num_splits: int
    group_pad: int  # query heads (pairs) per KV head (pair), padded to a power of two
    head_size_pad: int
    num_kv_units: int  # KV heads (plain) or KV head pairs (differential): grid axis 1


def launch_plan(query: Tensor, num_kv_heads: int, num_seqs: int, max_kv_len: int,
                differential: bool) -> LaunchPlan:
    """Tiles and flash-decoding splits for these shapes (``max_kv_len`` bounds any
    sequence's keys); reads no tensor values."""
    num_tokens, num_heads, head_size = query.shape
    group_pad = next_power_of_2(num_heads // num_kv_heads)
    head_size_pad = max(16, next_power_of_2(head_size))
    num_kv_units = num_kv_heads // 2 if differential else num_kv_heads
    tiles = choose_tiles(num_tokens, num_seqs, group_pad, head_size_pad, differential, query.dtype)
    num_splits = choose_num_splits(num_seqs, num_tokens, tiles.block_q(group_pad), num_kv_units,
                                   max_kv_len, tiles.programs_per_sm,
                                   multiprocessor_count(query.device))
    return LaunchPlan(tiles, num_splits, group_pad, head_size_pad, num_kv_units)


def output_shape(query: Tensor, differential: bool) -> tuple[int, int, int]:
    """``[T, Hq, D]`` (plain) or ``[T, Hq/2, 2D]`` (differential) for ``query`` ``[T, Hq, D]``."""
    num_tokens, num_heads, head_size = query.shape
    if differential:
        return (num_tokens, num_heads // 2, 2 * head_size)
    return (num_tokens, num_heads, head_size)


def _attention(query, key, value, cu_seqlens_q, kv_lens, block_table, max_kv_len, lambda_full,
               scale, causal, window_size, softcap, alibi_slopes, out, num_splits):
    """Launch the unified kernel (and the split merge). ``block_table is None`` means
    contiguous k/v with ``kv_lens = cu_seqlens_k``; else paged with ``kv_lens = seq_lens``."""
    differential = lambda_full is not None
    paged = block_table is not None
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key.shape[-2]
    num_seqs = cu_seqlens_q.shape[0] - 1
    out_shape = output_shape(query, differential)
    if out is None:
        out = query.new_empty(out_shape)
    elif tuple(out.shape) != out_shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {out_shape} {query.dtype} with a contiguous last dim, "
                         f"got {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if num_tokens == 0:
        return out
    scale = head_size ** -0.5 if scale is None else scale
    # The kernels index metadata as dense vectors and block_table by its row stride: views
    # with other strides are copied (no-ops for the engine's own contiguous buffers).
    cu_seqlens_q, kv_lens = cu_seqlens_q.contiguous(), kv_lens.contiguous()
    lambda_full = None if lambda_full is None else lambda_full.contiguous()
    alibi_slopes = None if alibi_slopes is None else alibi_slopes.contiguous()
    if block_table is not None and block_table.stride(1) != 1:
        block_table = block_table.contiguous()

    plan = launch_plan(query, num_kv_heads, num_seqs, max_kv_len, differential)
    tiles, group_pad = plan.tiles, plan.group_pad
    num_splits = plan.num_splits if num_splits is None else num_splits
    block_q = tiles.block_q(group_pad)
    grid = (num_tokens // block_q + num_seqs, plan.num_kv_units, num_splits)
    min_dist, max_dist = visibility_bounds(causal, *window_size)

    if paged:
        k_strides, v_strides = key.stride(), value.stride()
        table, table_stride, block_size = block_table, block_table.stride(0), key.shape[1]
    else:  # token-major [total_k, Hkv, D]: the "block" stride is the token stride
        k_strides = (key.stride(0), 0, key.stride(1), key.stride(2))
        v_strides = (value.stride(0), 0, value.stride(1), value.stride(2))
        table, table_stride, block_size = kv_lens, 0, 1  # no block table
    value_size = 2 * head_size if differential else head_size
    if num_splits > 1:
        target = torch.empty((num_splits, num_tokens, num_heads, value_size),
                             dtype=torch.float32, device=query.device)
        lse = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32,
                          device=query.device)
        target_strides, lse_strides = target.stride(), lse.stride()
    else:
        target, lse = out, out  # lse unused
        target_strides, lse_strides = (0, *out.stride()), (0, 0, 0)
    placeholder = query  # pointer argument of a disabled feature
    lambda_arg = lambda_full if differential else placeholder
    lambda_per_pair = differential and lambda_full.numel() > 1

    with device_guard(query):
        attention_kernel[grid](
            target, lse, query, key, value,
            cu_seqlens_q, kv_lens, table, lambda_arg,
            placeholder if alibi_slopes is None else alibi_slopes,
            num_seqs, scale, softcap, min_dist, max_dist,
            *query.stride(), *k_strides, *v_strides, table_stride, *target_strides, *lse_strides,
            BLOCK_SIZE=block_size, PAGED=paged, DIFFERENTIAL=differential, STACKED=tiles.stacked,
            SPLIT=num_splits > 1, SOFTCAP=softcap > 0, ALIBI=alibi_slopes is not None,
            LAMBDA_PER_PAIR=lambda_per_pair, HEAD_SIZE=head_size,
            HEAD_SIZE_PAD=plan.head_size_pad, GROUP=num_heads // num_kv_heads, GROUP_PAD=group_pad,
            BLOCK_M=tiles.block_m, TILE_N=tiles.tile_n,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
        if num_splits > 1:
            merge_splits_kernel[(num_tokens, out.shape[1])](
                out, target, lse, lambda_arg, num_splits,
                target.stride(0), target.stride(1), target.stride(2), lse.stride(0), lse.stride(1),
                out.stride(0), out.stride(1),
                VALUE_SIZE=value_size, VALUE_SIZE_PAD=next_power_of_2(value_size),
                SPLITS_PAD=next_power_of_2(num_splits), DIFFERENTIAL=differential,
                LAMBDA_PER_PAIR=lambda_per_pair,
            )
    return out
