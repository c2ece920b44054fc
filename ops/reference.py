"""Reference implementations of the ``compiled_attn`` ops in plain PyTorch.

These are the CPU kernels of every op (and the fallback on any device without a
faster kernel), arithmetic in float32 (float64 inputs stay float64). The attention
kernels work on the whole batch at once, with no Python loop over sequences or heads
(a loop costs more than the math at decode sizes): each sequence's keys are gathered
up to the longest one's, queries are padded to the most any sequence has, one mask
hides what a query may not see, and two batched matmuls do the rest (see
:func:`_attend`). The masking, softcap and ALiBi conventions follow
``flash_attn.flash_attn_varlen_func`` and ``flash_attn.flash_attn_with_kvcache``
(flash-attn 2.x):

* keys and queries are aligned bottom-right: query ``i`` of a sequence with ``q_len``
  queries and ``k_len`` keys sits at key position ``i + k_len - q_len``;
* ``causal`` keeps keys ``j <= i + k_len - q_len``;
* ``window_size=(left, right)`` keeps keys in
  ``[i + k_len - q_len - left, i + k_len - q_len + right]``; ``-1`` is unbounded;
* ``softcap > 0`` maps scaled scores ``s`` to ``softcap * tanh(s / softcap)``;
* ALiBi adds ``-slope[h] * |i + k_len - q_len - j|`` after the softcap;
* a query row that sees no key returns zeros (never NaN).

Differential attention follows Ye et al., "Differential Transformer" (arXiv 2410.05258,
section 2.1): ``(softmax(Q1 K1^T) - lambda * softmax(Q2 K2^T)) V`` with ``V = [V1, V2]``
concatenated on the feature axis, heads stored as interleaved pairs (component 1 of
pair ``j`` is head ``2j``, component 2 is head ``2j + 1``).
"""

from __future__ import annotations

import torch

from .arith import cdiv


_HIDDEN = torch.finfo(torch.float32).min
"""Added to the score of a hidden key: finite, so that a row that sees no key gets finite
probabilities (zeroed afterwards) and finite gradients, yet its ``exp`` is exactly 0 next to
any visible score, in float32 and float64."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _out_shape(query: torch.Tensor, differential: bool) -> tuple[int, int, int]:
    num_tokens, num_heads, head_size = query.shape
    return (num_tokens, num_heads // 2, 2 * head_size) if differential else (num_tokens, num_heads, head_size)


def _past_end(seq_lens: torch.Tensor, k_lens: list[int], max_k: int) -> torch.Tensor | None:
    """``[max_k, B]`` bool: key ``j`` lies past the end of sequence ``b`` (``None``: no
    such key, every sequence has ``max_k``)."""
    if min(k_lens) == max_k:
        return None
    return torch.arange(max_k, dtype=seq_lens.dtype, device=seq_lens.device).unsqueeze(1) >= seq_lens


def _key_index(index: torch.Tensor, past_end: torch.Tensor | None, k_lens: list[int]) -> torch.Tensor:
    """Flattens a key-major ``[max_k, B]`` index of keys, first pointing the keys past a
    sequence's end at the longest sequence's keys: real, finite values (garbage such as
    NaN would survive its zero probability), in range, and masked anyway."""
    if past_end is not None:
        longest = k_lens.index(max(k_lens))
        index = torch.where(past_end, index[:, longest : longest + 1], index)
    return index.flatten()


def _attend(query, key, value, cu_seqlens_q, seq_lens, k_lens, past_end, lambda_full,
            scale, causal, window_left, window_right, softcap, alibi_slopes):
    """Plain or differential attention of a whole batch in two ``bmm`` calls.

    Queries are padded to ``[B, max_q]`` rows. The query heads that read one KV head (its
    GQA group and, differential, one component of each pair of the group) are the rows of
    one matrix, so the scores are ``[B * Hkv, rows, max_k]``, one ``bmm`` over the
    ``(sequence, KV head)`` pairs. Differential probabilities are combined before they meet
    the values, ``a1 - lambda * a2 = (p1 - lambda * p2) @ [v1, v2]``, so the second ``bmm``
    reads each KV pair's values once for both components.

    Args:
        query: ``[T, Hq, D]`` packed queries, ``T >= 1``.
        key, value: ``[max_k, B * Hkv, D]`` in the inputs' dtype, key-major (key ``j`` of
            every sequence and KV head side by side), so that each ``(sequence, KV head)``
            matrix is a strided view that ``bmm`` reads without a copy. Keys past a
            sequence's end must be finite (see :func:`_key_index`); they are masked.
        cu_seqlens_q, seq_lens: ``[B + 1]`` and ``[B]`` int tensors.
        k_lens: ``seq_lens`` as a list, ``max(k_lens) == max_k >= 1``.
        past_end: :func:`_past_end` of ``seq_lens``.
        lambda_full, scale, causal, window_left, window_right, softcap, alibi_slopes: see
            the module docstring.

    Returns:
        ``[T, Hq, D]`` or, differential, ``[T, Hq // 2, 2 * D]``: a new contiguous tensor
        in the query's dtype; rows past ``cu_seqlens_q[-1]`` are zeros.
    """
    bounds = cu_seqlens_q.tolist()  # one read of the query bounds, on the host
    used = bounds[-1]
    if used < query.shape[0]:  # rows past the last sequence (a buffer padded to a static shape,
        # values unchecked): zeros, where the CUDA kernels leave them unspecified
        out = query.new_zeros(_out_shape(query, lambda_full is not None))
        if used > 0:
            out[:used] = _attend(query[:used], key, value, cu_seqlens_q, seq_lens, k_lens, past_end, lambda_full,
                                 scale, causal, window_left, window_right, softcap, alibi_slopes)
        return out
    dtype = _compute_dtype(query.dtype)
    differential = lambda_full is not None
    num_tokens, num_heads, head_size = query.shape
    num_seqs = len(k_lens)
    max_k, num_kv_heads = key.shape[0], key.shape[1] // num_seqs
    group = num_heads // num_kv_heads

    # Queries as [B, max_q] rows: the query itself when every sequence has max_q of them.
    max_q = cdiv(num_tokens, num_seqs)
    if bounds == list(range(0, num_tokens + 1, max_q)):
        valid, q_lens, q = None, max_q, query
    else:
        q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        max_q = int(q_lens.max())
        valid = torch.arange(max_q, device=query.device) < q_lens.unsqueeze(1)  # [B, max_q]
        q = query.new_zeros(num_seqs, max_q, num_heads, head_size).index_put((valid,), query)

    # The rows of KV head h are (query head of its group, query). Differential heads are
    # interleaved pairs: pair j = m * group + r reads KV pair m, its component c reads
    # component c, so KV head 2m + c serves component c of pairs m * group + r.
    if differential:
        q = q.view(num_seqs, max_q, num_kv_heads // 2, group, 2, head_size).permute(0, 2, 4, 3, 1, 5)
        rows = (num_seqs, num_kv_heads // 2, 2, group, max_q, max_k)
    else:
        q = q.view(num_seqs, max_q, num_kv_heads, group, head_size).permute(0, 2, 3, 1, 4)
        rows = (num_seqs, num_kv_heads, group, max_q, max_k)
    q = q.reshape(num_seqs * num_kv_heads, group * max_q, head_size)
    if q.dtype != dtype:
        q, key, value = q.to(dtype), key.to(dtype), value.to(dtype)
    scores = torch.bmm(q, key.permute(1, 2, 0)).view(rows)
    if softcap > 0:
        scores = softcap * torch.tanh(scores * (scale / softcap))
    else:
        scores.mul_(scale)

    # Key position of query i of sequence b (bottom-right aligned) minus key index.
    distance = None
    if alibi_slopes is not None or window_left >= 0 or (window_right >= 0 and not causal) or (causal and max_q > 1):
        steps = dict(dtype=seq_lens.dtype, device=seq_lens.device)
        position = (seq_lens - q_lens).unsqueeze(1) + torch.arange(max_q, **steps)
        distance = position.unsqueeze(2) - torch.arange(max_k, **steps)  # [B, max_q, max_k]
    per_query = (num_seqs,) + (1,) * (len(rows) - 3)  # + (max_q, max_k): broadcast over heads
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(dtype)
        if differential:  # head 2j + c with j = m * group + r, as the rows: (m, c, r)
            slopes = slopes.view(num_kv_heads // 2, group, 2).transpose(1, 2)
        scores.sub_(slopes.reshape(*rows[1:-2], 1, 1) * distance.abs().view(*per_query, max_q, max_k))
    masks = []  # of the keys hidden from the real query rows (padded rows are thrown away)
    if causal and distance is not None:
        masks.append(distance < 0)  # hides the keys past the end too
    elif past_end is not None:  # (for causal single queries, this is the causal mask)
        masks.append(past_end.t().unsqueeze(1))
    if window_left >= 0:
        masks.append(distance > window_left)
    if window_right >= 0 and not causal:
        masks.append(distance < -window_right)
    hidden = None
    for mask in masks:
        hidden = mask if hidden is None else hidden | mask
    if hidden is not None:
        hidden = hidden.view(*per_query, hidden.shape[1], max_k)
        scores.add_(torch.where(hidden, _HIDDEN, 0.0))  # (faster than masked_fill_)
    probs = torch.softmax(scores, dim=-1)
    # A row sees no key only when its sequence has more queries than keys.
    if hidden is not None and (min(k_lens) < max_q if valid is None else bool((q_lens > seq_lens).any())):
        probs = probs.masked_fill(hidden, 0.0)

    if differential:
        p1, p2 = probs.unbind(2)
        lam = lambda_full if lambda_full.dtype == dtype else lambda_full.to(dtype)
        if lam.numel() > 1:
            lam = lam.view(num_kv_heads // 2, group, 1, 1)
        probs = torch.addcmul(p1, p2, lam, value=-1)  # p1 - lambda * p2, [B, pairs, group, max_q, max_k]
        value = value.view(max_k, -1, 2 * head_size)  # [v1, v2] of each KV pair
    out = torch.bmm(probs.reshape(value.shape[1], -1, max_k), value.transpose(0, 1))
    # [B, heads, group, max_q, Dv] -> [B * max_q, heads * group, Dv]: a view when max_q == 1
    out = out.view(*probs.shape[:-1], -1).permute(0, 3, 1, 2, 4)
    out = out.reshape(num_seqs * max_q, -1, out.shape[-1]).contiguous().to(query.dtype)
    return out if valid is None else out[valid.flatten()]


def paged_attention(
    query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, lambda_full,
    scale, causal, window_left, window_right, softcap, alibi_slopes, k_scale=None, v_scale=None,
):
    """Plain or differential (``lambda_full`` given) attention over a paged KV cache.

    Shapes as in :func:`compiled_attn.ops.paged_attention`. Gathers every sequence's keys,
    up to the longest one's, from the blocks of its table (entries past a sequence's last
    block are never read, so they may hold anything), then attends the whole batch at
    once (:func:`_attend`). A float8_e4m3fn cache is dequantized as it is gathered,
    ``k = cache.to(float32) * k_scale`` (and ``v`` with ``v_scale``; ``None`` = 1; float64
    with a float64 query), as vLLM's fp8 KV cache. Returns a new tensor in the query's dtype.
    """
    k_lens = seq_lens.tolist()
    max_k = max(k_lens, default=0)
    if query.shape[0] == 0 or max_k == 0:
        return query.new_zeros(_out_shape(query, lambda_full is not None))
    _, block_size, num_kv_heads, head_size = key_cache.shape
    num_seqs = len(k_lens)
    used = cdiv(max_k, block_size)
    past_end = _past_end(seq_lens, k_lens, max_k)
    if num_seqs == 1:  # its blocks, in order, hold its keys key-major
        index = block_table[0, :used]
    else:  # the slot of key j of sequence b, [max_k, B]
        offsets = torch.arange(block_size, dtype=block_table.dtype, device=block_table.device)
        slots = torch.add(offsets, block_table[:, :used].unsqueeze(2), alpha=block_size)
        index = _key_index(slots.view(num_seqs, -1)[:, :max_k].t(), past_end, k_lens)
        # [slots, Hkv, D]: a view (a copy only for a cache view whose blocks are not evenly strided)
        key_cache, value_cache = key_cache.flatten(0, 1), value_cache.flatten(0, 1)
    rows = (-1, num_seqs * num_kv_heads, head_size)
    fp8 = key_cache.dtype == torch.float8_e4m3fn
    if fp8:  # gathered as bytes (index_select has no float8 kernel on every device)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    key = key_cache.index_select(0, index).view(rows)[:max_k]
    value = value_cache.index_select(0, index).view(rows)[:max_k]
    if fp8:
        key = dequantize(key.view(torch.float8_e4m3fn), k_scale, _compute_dtype(query.dtype))
        value = dequantize(value.view(torch.float8_e4m3fn), v_scale, _compute_dtype(query.dtype))
    return _attend(query, key, value, cu_seqlens_q, seq_lens, k_lens, past_end, lambda_full,
                   scale, causal, window_left, window_right, softcap, alibi_slopes)


def varlen_attention(
    q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full,
    scale, causal, window_left, window_right, softcap, alibi_slopes,
):
    """Plain or differential (``lambda_full`` given) attention over packed contiguous
    k/v, as ``flash_attn_varlen_func``: gathers each sequence's keys key-major and attends
    the whole batch at once (:func:`_attend`). Returns a new tensor in ``q``'s dtype."""
    seq_lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    k_lens = seq_lens.tolist()
    max_k = max(k_lens, default=0)
    if q.shape[0] == 0 or max_k == 0:
        return q.new_zeros(_out_shape(q, lambda_full is not None))
    past_end = _past_end(seq_lens, k_lens, max_k)
    index = torch.arange(max_k, dtype=cu_seqlens_k.dtype, device=k.device).unsqueeze(1) + cu_seqlens_k[:-1]
    index = _key_index(index, past_end, k_lens)
    rows = (max_k, -1, k.shape[-1])
    key = k.index_select(0, index).view(rows)
    value = v.index_select(0, index).view(rows)
    return _attend(q, key, value, cu_seqlens_q, seq_lens, k_lens, past_end, lambda_full,
                   scale, causal, window_left, window_right, softcap, alibi_slopes)


FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""


def quantize(x, scale):
    """``(x / scale).to(float8_e4m3fn)`` computed in float32 (``scale=None``: 1), rounded to
    nearest even and saturating to +-448 (clamped first, so the result does not depend on
    how a conversion treats overflow; NaN stays NaN): what vLLM's ``reshape_and_cache_flash``
    stores with ``kv_cache_dtype="fp8"`` (``__NV_SATFINITE``)."""
    x = x.to(torch.float32)
    if scale is not None:
        x = x / scale
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize(cache, scale, dtype=torch.float32):
    """``cache.to(dtype) * scale`` (``scale=None``: 1) of a float8_e4m3fn cache."""
    x = cache.to(dtype)
    return x if scale is None else x * scale.to(dtype)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None):
    """Write ``key/value[t]`` to slot ``slot_mapping[t]`` of the paged caches; skip -1.

    One ``index_copy_`` per cache over its slots (block and offset dims merged), after
    dropping padding rows if there are any; caches whose block and offset dims do not merge
    into one (some strided views) are written by block and offset instead. A float8_e4m3fn
    cache stores :func:`quantize` of the rows with ``k_scale``/``v_scale``, written as bytes
    (``index_copy_`` has no float8 kernel)."""
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if key_cache.dtype == torch.float8_e4m3fn:
        key, value = quantize(key, k_scale).view(torch.uint8), quantize(value, v_scale).view(torch.uint8)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    for cache, rows in ((key_cache, key), (value_cache, value)):
        num_blocks, block_size = cache.shape[:2]
        if cache.stride(0) == block_size * cache.stride(1):
            cache.view(num_blocks * block_size, *cache.shape[2:]).index_copy_(0, slot_mapping, rows)
        else:
            cache[slot_mapping // block_size, slot_mapping % block_size] = rows


def copy_blocks(key_caches, value_caches, block_mapping):
    """``cache[dst] = cache[src]`` for every ``(src, dst)`` row, in every layer's cache."""
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for cache in (*key_caches, *value_caches):
        index = src.to(cache.device)
        cache[dst.to(cache.device)] = cache[index]


def swap_blocks(src, dst, block_mapping):
    """``dst[d] = src[s]`` for every ``(s, d)`` row; ``src`` and ``dst`` may be on
    different devices (GPU cache <-> CPU cache)."""
    dst[block_mapping[:, 1].to(dst.device)] = src[block_mapping[:, 0].to(src.device)].to(dst.device)


def rms_norm(x, weight, eps):
    """Hugging Face ``LlamaRMSNorm`` over the last dim: statistics in float32 (float64
    stays), cast back, times ``weight``."""
    x32 = x.to(_compute_dtype(x.dtype))
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def fused_linear(x, weight, bias, norm_weight, norm_eps, residual, silu_and_mul):
    """``residual + act(F.linear(rms_norm(x), weight, bias))``, each part optional, in the
    rounding order of the unfused Hugging Face Llama code (see :func:`compiled_attn.ops.fused_linear`)."""
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, norm_eps)
    y = torch.nn.functional.linear(x, weight, bias)
    if silu_and_mul:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    return y if residual is None else (residual + y).contiguous()
