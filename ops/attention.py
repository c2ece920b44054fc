"""Attention ops: paged and varlen, plain and differential.

Each op is a ``torch.library`` custom op in the ``compiled_attn`` namespace with a fake
implementation (shapes only, for FakeTensor tracing, ``torch.compile`` and
``torch.export``) and the plain-PyTorch reference of :mod:`compiled_attn.ops.reference`
as its kernel on every device. Faster device kernels register themselves on top with
``register_kernel`` (see :mod:`compiled_attn.ops.backends`).

The public functions below fill in defaults (``scale = head_size ** -0.5``) and, when
called eagerly, validate their arguments before any kernel runs. Under
``torch.compile`` they trace straight to the op; the fake implementations still check
shapes and dtypes at trace time.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import reference
from .validation import (
    check_call_options,
    check_paged_args,
    check_paged_values,
    check_varlen_args,
    check_varlen_values,
    should_check_values,
)

Window = tuple[int, int]


def _differential_shape(query: Tensor) -> tuple[int, int, int]:
    num_tokens, num_heads, head_size = query.shape
    return (num_tokens, num_heads // 2, 2 * head_size)


# --- paged attention ------------------------------------------------------------------


@torch.library.custom_op("compiled_attn::paged_attention", mutates_args=())
def paged_attention_op(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, cu_seqlens_q: Tensor,
    seq_lens: Tensor, block_table: Tensor, scale: float, causal: bool,
    window_left: int, window_right: int, softcap: float, alibi_slopes: Tensor | None,
) -> Tensor:
    return reference.paged_attention(
        query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, None,
        scale, causal, window_left, window_right, softcap, alibi_slopes,
    )


@paged_attention_op.register_fake
def _(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, scale, causal,
      window_left, window_right, softcap, alibi_slopes):
    check_paged_args(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table,
                     None, window_left, window_right, softcap, alibi_slopes)
    return query.new_empty(query.shape)  # the kernels return contiguous tensors


@torch.library.custom_op("compiled_attn::differential_paged_attention", mutates_args=())
def differential_paged_attention_op(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, cu_seqlens_q: Tensor,
    seq_lens: Tensor, block_table: Tensor, lambda_full: Tensor, scale: float, causal: bool,
    window_left: int, window_right: int, softcap: float, alibi_slopes: Tensor | None,
) -> Tensor:
    return reference.paged_attention(
        query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, lambda_full,
        scale, causal, window_left, window_right, softcap, alibi_slopes,
    )


@differential_paged_attention_op.register_fake
def _(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, lambda_full, scale,
      causal, window_left, window_right, softcap, alibi_slopes):
    check_paged_args(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table,
                     lambda_full, window_left, window_right, softcap, alibi_slopes)
    return query.new_empty(_differential_shape(query))


# --- varlen attention over contiguous k/v ------------------------------------------------


@torch.library.custom_op("compiled_attn::varlen_attention", mutates_args=())
def varlen_attention_op(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
    alibi_slopes: Tensor | None,
) -> Tensor:
    return reference.varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, None,
        scale, causal, window_left, window_right, softcap, alibi_slopes,
    )


@varlen_attention_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, window_left, window_right, softcap,
      alibi_slopes):
    check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, None, window_left, window_right,
                      softcap, alibi_slopes)
    return q.new_empty(q.shape)


@torch.library.custom_op("compiled_attn::differential_varlen_attention", mutates_args=())
def differential_varlen_attention_op(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    lambda_full: Tensor, scale: float, causal: bool, window_left: int, window_right: int,
    softcap: float, alibi_slopes: Tensor | None,
) -> Tensor:
    return reference.varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full,
        scale, causal, window_left, window_right, softcap, alibi_slopes,
    )


@differential_varlen_attention_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, scale, causal, window_left,
      window_right, softcap, alibi_slopes):
    check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, window_left,
                      window_right, softcap, alibi_slopes)
    return q.new_empty(_differential_shape(q))


# --- public API ----------------------------------------------------------------------------


def paged_attention(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, cu_seqlens_q: Tensor,
    seq_lens: Tensor, block_table: Tensor, lambda_full: Tensor | None = None, *,
    scale: float | None = None, causal: bool = True, window_size: Window = (-1, -1),
    softcap: float = 0.0, alibi_slopes: Tensor | None = None,
) -> Tensor:
    """Attention of packed queries against a paged KV cache; plain or differential.

    One call serves prefill, chunked prefill, prefix-cache hits, decode and multi-token
    decode, mixed in one batch: sequence ``b`` owns queries
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and keys ``0 .. seq_lens[b]-1`` (new tokens
    included, already written by :func:`reshape_and_cache`), stored in blocks
    ``block_table[b, :ceil(seq_lens[b] / block_size)]``. Semantics follow
    ``flash_attn_with_kvcache`` (bottom-right causal alignment, GQA/MQA, sliding window,
    softcap, ALiBi); the reference docstring of :mod:`compiled_attn.ops.reference` gives
    the exact math. Rows that see no key (padding, ``seq_lens[b] == 0``) are zeros.

    Args:
        query: ``[num_tokens, num_heads, head_size]`` float16, bfloat16 or float32.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``,
            query's dtype; ``num_heads % num_kv_heads == 0``; ``head_size`` a multiple of
            8 up to 256.
        cu_seqlens_q: ``[num_seqs + 1]`` int32, cumulative query counts starting at 0.
        seq_lens: ``[num_seqs]`` int32, keys per sequence (context + new tokens).
        block_table: ``[num_seqs, max_blocks_per_seq]`` int32 block ids.
        lambda_full: ``None`` for plain attention. For differential attention (Ye et al.
            2024, arXiv 2410.05258, eq. 1), a float tensor of shape ``[]`` or
            ``[num_heads // 2]``; heads and KV heads are interleaved pairs (``2j``,
            ``2j + 1``) and the result is ``attn(q1, k1, [v1, v2]) - lambda *
            attn(q2, k2, [v1, v2])`` combined in float32, before the head norm.
        scale: softmax scale, default ``head_size ** -0.5``.
        causal: bottom-right aligned causal mask (False for cross-attention).
        window_size: ``(left, right)`` sliding window in tokens, ``-1`` unbounded.
        softcap: ``> 0`` applies ``softcap * tanh(score / softcap)``.
        alibi_slopes: ``[num_heads]`` float32 or ``None``.

    Returns:
        ``[num_tokens, num_heads, head_size]`` (plain) or
        ``[num_tokens, num_heads // 2, 2 * head_size]`` (differential), query's dtype.

    Raises:
        TypeError: wrong dtype (e.g. ``block_table`` not int32), ``scale`` or
            ``window_size`` of the wrong type.
        ValueError: inconsistent shapes, unsupported head size or head counts, and when
            eager: block ids outside the cache, ``seq_lens`` beyond the block table,
            malformed ``cu_seqlens_q``; ``scale`` not finite and > 0.
    """
    check_call_options(scale, window_size)
    window_left, window_right = window_size
    if not torch.compiler.is_compiling():
        check_paged_args(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table,
                         lambda_full, window_left, window_right, softcap, alibi_slopes)
        if should_check_values(query):
            check_paged_values(query, key_cache, cu_seqlens_q, seq_lens, block_table)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    options = (scale, causal, window_left, window_right, softcap, alibi_slopes)
    metadata = (cu_seqlens_q, seq_lens, block_table)
    if lambda_full is None:
        return paged_attention_op(query, key_cache, value_cache, *metadata, *options)
    return differential_paged_attention_op(query, key_cache, value_cache, *metadata, lambda_full, *options)


def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    lambda_full: Tensor | None = None, *, scale: float | None = None, causal: bool = True,
    window_size: Window = (-1, -1), softcap: float = 0.0, alibi_slopes: Tensor | None = None,
) -> Tensor:
    """Attention over packed contiguous q/k/v, as ``flash_attn_varlen_func``.

    For prefills with no cached context, encoders (``causal=False``) and training-style
    batches. Sequence ``b`` owns queries ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and keys
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``.

    Args:
        q: ``[total_q, num_heads, head_size]``; k, v: ``[total_k, num_kv_heads, head_size]``,
            one dtype among float16, bfloat16, float32.
        cu_seqlens_q, cu_seqlens_k: ``[num_seqs + 1]`` int32.
        lambda_full, scale, causal, window_size, softcap, alibi_slopes: as
            :func:`paged_attention`.

    Returns:
        ``[total_q, num_heads, head_size]`` or, differential,
        ``[total_q, num_heads // 2, 2 * head_size]``, in q's dtype.

    Raises:
        TypeError, ValueError: as :func:`paged_attention`.
    """
    check_call_options(scale, window_size)
    window_left, window_right = window_size
    if not torch.compiler.is_compiling():
        check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, window_left,
                          window_right, softcap, alibi_slopes)
        if should_check_values(q):
            check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    options = (scale, causal, window_left, window_right, softcap, alibi_slopes)
    if lambda_full is None:
        return varlen_attention_op(q, k, v, cu_seqlens_q, cu_seqlens_k, *options)
    return differential_varlen_attention_op(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, *options)
