"""Reference implementations of the ``compiled_attn`` ops in plain PyTorch.

These are the CPU kernels of every op (and the fallback on any device without a
faster kernel). They favour clarity over speed: one sequence at a time, an explicit
boolean mask, arithmetic in float32 (float64 inputs stay float64). The masking,
softcap and ALiBi conventions follow ``flash_attn.flash_attn_varlen_func`` and
``flash_attn.flash_attn_with_kvcache`` (flash-attn 2.x):

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
from einops import rearrange, repeat


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of one sequence; returns float32 (float64 for float64 inputs).

    Args:
        q: ``[q_len, Hq, D]`` queries.
        k: ``[k_len, Hkv, D]`` keys, ``Hq % Hkv == 0`` (query head ``h`` reads KV head
            ``h // (Hq // Hkv)``, as flash-attn's GQA).
        v: ``[k_len, Hkv, Dv]`` values.
        scale, causal, window_left, window_right, softcap: see the module docstring.
        alibi_slopes: ``[Hq]`` float32 or ``None``.

    Returns:
        ``[q_len, Hq, Dv]``.
    """
    dtype = _compute_dtype(q.dtype)
    q_len, num_heads, _ = q.shape
    k_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = repeat(k.to(dtype), "k h d -> k (h g) d", g=group)
    v = repeat(v.to(dtype), "k h d -> k (h g) d", g=group)
    scores = torch.einsum("qhd,khd->hqk", q.to(dtype), k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    # Key position of each query (bottom-right alignment) minus key index.
    query_pos = torch.arange(q_len, device=q.device)[:, None] + (k_len - q_len)
    distance = query_pos - torch.arange(k_len, device=q.device)[None, :]
    if alibi_slopes is not None:
        scores = scores - alibi_slopes.to(dtype)[:, None, None] * distance.abs()
    visible = torch.ones_like(distance, dtype=torch.bool)
    if causal:
        visible &= distance >= 0
    if window_left >= 0:
        visible &= distance <= window_left
    if window_right >= 0:
        visible &= distance >= -window_right
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    probs = torch.where(visible.any(dim=-1, keepdim=True), probs, 0.0)  # no key -> 0
    return torch.einsum("hqk,khd->qhd", probs, v)


def differential_attend(q, k, v, lambda_full, scale, causal, window_left, window_right, softcap, alibi_slopes):
    """Differential attention of one sequence over interleaved head pairs.

    Args:
        q: ``[q_len, Hq, D]``, ``Hq`` even; ``k, v``: ``[k_len, Hkv, D]``, ``Hkv`` even.
        lambda_full: float32 tensor of shape ``[]`` or ``[Hq // 2]``.

    Returns:
        ``[q_len, Hq // 2, 2 * D]`` in float32 (float64 for float64 inputs):
        ``attn(q1, k1, [v1, v2]) - lambda * attn(q2, k2, [v1, v2])``.
    """
    v_pair = rearrange(v, "k (h two) d -> k h (two d)", two=2)
    slopes = (None, None) if alibi_slopes is None else (alibi_slopes[0::2], alibi_slopes[1::2])
    options = (scale, causal, window_left, window_right, softcap)
    a1 = attend(q[:, 0::2], k[:, 0::2], v_pair, *options, slopes[0])
    a2 = attend(q[:, 1::2], k[:, 1::2], v_pair, *options, slopes[1])
    lam = lambda_full.to(a1.dtype).reshape(-1)[:, None]  # [1 or H/2, 1], broadcast over pairs
    return a1 - lam * a2


def _gather_paged(cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Keys or values of one sequence, ``[seq_len, Hkv, D]``, from a paged cache."""
    return cache[block_ids].flatten(0, 1)[:seq_len]


def paged_attention(
    query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, lambda_full,
    scale, causal, window_left, window_right, softcap, alibi_slopes,
):
    """Plain or differential (``lambda_full`` given) attention over a paged KV cache.

    Shapes as in :func:`compiled_attn.ops.paged_attention`. Returns a new tensor in the
    query's dtype.
    """
    differential = lambda_full is not None
    num_tokens, num_heads, head_size = query.shape
    out_shape = (num_tokens, num_heads // 2, 2 * head_size) if differential else query.shape
    out = query.new_zeros(out_shape)
    starts = cu_seqlens_q.tolist()
    block_size = key_cache.shape[1]
    options = (scale, causal, window_left, window_right, softcap, alibi_slopes)
    for b, seq_len in enumerate(seq_lens.tolist()):
        q = query[starts[b]:starts[b + 1]]
        if q.shape[0] == 0:
            continue
        block_ids = block_table[b, : -(-seq_len // block_size)].long()
        k = _gather_paged(key_cache, block_ids, seq_len)
        v = _gather_paged(value_cache, block_ids, seq_len)
        if differential:
            out[starts[b]:starts[b + 1]] = differential_attend(q, k, v, lambda_full, *options).to(out.dtype)
        else:
            out[starts[b]:starts[b + 1]] = attend(q, k, v, *options).to(out.dtype)
    return out


def varlen_attention(
    q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full,
    scale, causal, window_left, window_right, softcap, alibi_slopes,
):
    """Plain or differential (``lambda_full`` given) attention over packed contiguous
    k/v, as ``flash_attn_varlen_func``. Returns a new tensor in ``q``'s dtype."""
    differential = lambda_full is not None
    num_tokens, num_heads, head_size = q.shape
    out_shape = (num_tokens, num_heads // 2, 2 * head_size) if differential else q.shape
    out = q.new_zeros(out_shape)
    qs, ks = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    options = (scale, causal, window_left, window_right, softcap, alibi_slopes)
    for b in range(len(qs) - 1):
        if qs[b + 1] == qs[b]:
            continue
        args = (q[qs[b]:qs[b + 1]], k[ks[b]:ks[b + 1]], v[ks[b]:ks[b + 1]])
        if differential:
            out[qs[b]:qs[b + 1]] = differential_attend(*args, lambda_full, *options).to(out.dtype)
        else:
            out[qs[b]:qs[b + 1]] = attend(*args, *options).to(out.dtype)
    return out


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """Write ``key/value[t]`` to slot ``slot_mapping[t]`` of the paged caches; skip -1."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size  # works on strided cache views
    key_cache[blocks, offsets] = key[keep]
    value_cache[blocks, offsets] = value[keep]


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
