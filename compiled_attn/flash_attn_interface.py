"""flash-attn 2.x's functions, running on our ops: compile-safe, CUDA-graph safe, on any device.

Code written against ``flash_attn`` (``from flash_attn import flash_attn_varlen_func``) runs
unchanged with ``from compiled_attn.flash_attn_interface import ...``: the signatures,
defaults, layouts and semantics of flash-attn 2.8's ``flash_attn_interface`` (bottom-right
causal alignment when ``seqlen_q != seqlen_k``, sliding windows, softcap, ALiBi, GQA/MQA,
paged ``block_table``, ``cache_seqlens``, ``cache_batch_idx``, ``cache_leftpad``, new
``k``/``v`` appended into the cache in place, ``softmax_lse`` in natural log, ``+inf`` for a
row that sees no key). The calls run :func:`compiled_attn.ops.varlen_attention` (dense and
varlen inputs; differentiable) and :func:`compiled_attn.ops.paged_attention` /
:func:`~compiled_attn.ops.reshape_and_cache` (caches), so under ``torch.compile`` they
are ops with fakes (no graph break), they capture in CUDA graphs, and they run on the CPU.

Errors are raised as flash-attn raises them (its ``TORCH_CHECK``: ``RuntimeError``), as
:class:`FlashAttnArgumentError`, which is also a ``ValueError`` and a ``TypeError``. What our
ops cannot do raises ``NotImplementedError`` naming the argument: ``dropout_p > 0``, rotary
embedding inside :func:`flash_attn_with_kvcache`, per-batch ALiBi slopes ``(batch, nheads)``.
``softmax_lse`` (``return_attn_probs`` / ``return_softmax_lse``) is computed by a second,
dense pass in plain PyTorch (memory ``batch * nheads * seqlen_q * seqlen_k`` floats); the
varlen one loops over sequences on the host, so it is eager-only. ``deterministic`` and
``num_splits`` are accepted and have no effect (our forward and backward are deterministic;
splits are chosen from shapes).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import ops
from .ops.value_checks import values_readable

__all__ = [
    "FlashAttnArgumentError",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


class FlashAttnArgumentError(RuntimeError, ValueError, TypeError):
    """Bad arguments: a ``RuntimeError`` as flash-attn's checks raise, and also a
    ``ValueError``/``TypeError`` as the rest of ``compiled_attn`` raises."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise FlashAttnArgumentError(message)


def _check_common(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, alibi_slopes: Tensor | None) -> None:
    """flash-attn's checks shared by every function (before any kernel runs)."""
    if dropout_p:
        raise NotImplementedError(f"dropout_p={dropout_p}: compiled_attn has no attention dropout (use 0.0)")
    if alibi_slopes is not None and alibi_slopes.dim() != 1:
        raise NotImplementedError(f"alibi_slopes of shape {tuple(alibi_slopes.shape)}: only (nheads,) slopes "
                                  "are supported, not per-batch (batch_size, nheads)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(isinstance(t, Tensor), f"{name} must be a tensor, got {type(t).__name__}")
        _check(t.dtype in (torch.float16, torch.bfloat16, torch.float32),
               f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
        _check(t.stride(-1) == 1, f"{name} must have contiguous last dimension, got strides {t.stride()}")
    _check(q.dtype == k.dtype == v.dtype, f"query and key/value must have the same dtype, got {q.dtype}, "
                                          f"{k.dtype}, {v.dtype}")
    _check(k.shape == v.shape, f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    _check(q.shape[-1] == k.shape[-1], f"q and k must have the same head size, got {q.shape[-1]} and {k.shape[-1]}")
    _check(q.shape[-2] % k.shape[-2] == 0,
           f"Number of heads in key/value ({k.shape[-2]}) must divide number of heads in query ({q.shape[-2]})")


def _options(q: Tensor, softmax_scale, causal, window_size, softcap, alibi_slopes) -> dict:
    """Keyword arguments of our ops for flash-attn's options. Its defaults (no scale, softcap
    0) stay defaults (``None``), so that a compiled call can reach the flash-attn backend
    (``ops.varlen_attention``'s ``softcap``)."""
    left, right = window_size
    return dict(scale=softmax_scale, causal=bool(causal), window_size=(int(left), int(right)),
                softcap=None if softcap == 0 else float(softcap), alibi_slopes=alibi_slopes)


def _run(fn, *args, **kwargs) -> Tensor:
    """Our op; its argument errors raised as flash-attn's."""
    try:
        return fn(*args, **kwargs)
    except (ValueError, TypeError) as error:
        if isinstance(error, FlashAttnArgumentError):
            raise
        raise FlashAttnArgumentError(str(error)) from error


def _uniform_cu_seqlens(batch: int, seqlen: int, device) -> Tensor:
    return torch.arange(batch + 1, dtype=torch.int32, device=device) * seqlen


def _dense_lse(q: Tensor, k: Tensor, key_start: Tensor, key_end: Tensor, scale: float | None, causal: bool,
               window_size, softcap: float | None, alibi_slopes: Tensor | None) -> Tensor:
    """flash-attn's ``softmax_lse`` ``[B, H, Sq]`` (float32, natural log, ``+inf`` for a row
    that sees no key) of ``q`` ``[B, Sq, H, D]`` against rows of keys ``k`` ``[B, Sk, Hkv, D]``
    of which ``key_start[b] <= j < key_end[b]`` exist; query ``i`` sits at key index
    ``key_end[b] - Sq + i``."""
    batch, seqlen_q, num_heads, _ = q.shape
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    keys = k.to(compute).repeat_interleave(num_heads // k.shape[2], dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q.to(compute), keys) * ops.attention.default_scale(scale, q.shape[-1])
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    j = torch.arange(k.shape[1], device=q.device)
    pos = key_end.view(batch, 1) - seqlen_q + torch.arange(seqlen_q, device=q.device)  # [B, Sq]
    dist = pos[:, :, None] - j  # [B, Sq, Sk]
    visible = (j >= key_start.view(batch, 1, 1)) & (j < key_end.view(batch, 1, 1))
    left, right = window_size
    if causal:
        visible = visible & (dist >= 0)
    if left >= 0:
        visible = visible & (dist <= left)
    if right >= 0:
        visible = visible & (dist >= -right)
    if alibi_slopes is not None:
        scores = scores - alibi_slopes.to(compute).view(1, num_heads, 1, 1) * dist.abs()[:, None].to(compute)
    lse = torch.logsumexp(scores.masked_fill(~visible[:, None], float("-inf")), dim=-1)
    return torch.where(torch.isneginf(lse), torch.inf, lse).float()


# --- contiguous inputs ---------------------------------------------------------------------


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Attention of a dense batch, as ``flash_attn.flash_attn_func``.

    Args:
        q: ``(batch_size, seqlen_q, nheads, headdim)``; k, v: ``(batch_size, seqlen_k,
            nheads_k, headdim)``; float16/bfloat16/float32, ``nheads % nheads_k == 0``,
            headdim as :func:`compiled_attn.ops.varlen_attention` allows.
        dropout_p: must be 0.0 (``NotImplementedError`` otherwise).
        softmax_scale: default ``headdim ** -0.5``.
        causal: bottom-right aligned causal mask.
        window_size: ``(left, right)``, ``-1`` unbounded.
        softcap: ``> 0``: ``softcap * tanh(score / softcap)``.
        alibi_slopes: ``(nheads,)`` float32: ``-slope * |i + seqlen_k - seqlen_q - j|`` added.
        deterministic: no effect.
        return_attn_probs: also return ``softmax_lse`` ``(batch_size, nheads, seqlen_q)``
            and ``None`` (flash-attn's dropout mask).

    Returns:
        ``out`` ``(batch_size, seqlen_q, nheads, headdim)``, or ``(out, softmax_lse, None)``.
        Differentiable in q, k, v.

    Raises:
        FlashAttnArgumentError: shapes, dtypes or strides flash-attn rejects.
        NotImplementedError: ``dropout_p > 0``, per-batch ALiBi slopes.
    """
    _check_common(q, k, v, dropout_p, alibi_slopes)
    _check(q.dim() == 4 and k.dim() == 4 and q.shape[0] == k.shape[0],
           f"q must be (batch_size, seqlen_q, nheads, headdim) and k, v (batch_size, seqlen_k, nheads_k, headdim), "
           f"got {tuple(q.shape)} and {tuple(k.shape)}")
    batch, seqlen_q, num_heads, head_size = q.shape
    seqlen_k = k.shape[1]
    options = _options(q, softmax_scale, causal, window_size, softcap, alibi_slopes)
    out = _run(ops.varlen_attention, q.reshape(batch * seqlen_q, num_heads, head_size), k.flatten(0, 1),
               v.flatten(0, 1), _uniform_cu_seqlens(batch, seqlen_q, q.device),
               _uniform_cu_seqlens(batch, seqlen_k, q.device), **options).view(q.shape)
    if not return_attn_probs:
        return out
    key_end = torch.full((batch,), seqlen_k, device=q.device)
    lse = _dense_lse(q, k, torch.zeros_like(key_end), key_end, options["scale"], options["causal"],
                     options["window_size"], options["softcap"], alibi_slopes)
    return out, lse, None


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """Attention of packed sequences, as ``flash_attn.flash_attn_varlen_func``.

    Args:
        q: ``(total_q, nheads, headdim)``; sequence ``b`` owns rows
            ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``.
        k, v: ``(total_k, nheads_k, headdim)`` with ``cu_seqlens_k``; or, with
            ``block_table``, paged caches ``(num_blocks, page_block_size, nheads_k,
            headdim)`` where sequence ``b`` has ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]``
            keys in blocks ``block_table[b]``.
        cu_seqlens_q, cu_seqlens_k: ``(batch_size + 1,)`` int32.
        max_seqlen_q, max_seqlen_k: ints, bounds of the lengths (our kernels do not need
            them; the ``softmax_lse`` pass does not either).
        block_table: ``(batch_size, max_num_blocks_per_seq)`` int32, or ``None``.
        Others: as :func:`flash_attn_func`.

    Returns:
        ``out`` ``(total_q, nheads, headdim)``, or ``(out, softmax_lse, None)`` with
        ``softmax_lse`` ``(nheads, total_q)`` (eager only). Differentiable without
        ``block_table``.

    Raises:
        FlashAttnArgumentError: as :func:`flash_attn_func`, and cu_seqlens that are not
        int32 or not ``batch_size + 1`` long, a block table too small for the keys.
        NotImplementedError: as :func:`flash_attn_func`; ``return_attn_probs`` while compiling.
    """
    _check_common(q, k, v, dropout_p, alibi_slopes)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check(isinstance(cu, Tensor) and cu.dtype == torch.int32 and cu.dim() == 1,
               f"{name} must be a 1-D int32 tensor, got {getattr(cu, 'dtype', type(cu).__name__)}")
    _check(cu_seqlens_q.shape == cu_seqlens_k.shape,
           f"cu_seqlens_q and cu_seqlens_k must both be (batch_size + 1,), got {tuple(cu_seqlens_q.shape)} and "
           f"{tuple(cu_seqlens_k.shape)}")
    options = _options(q, softmax_scale, causal, window_size, softcap, alibi_slopes)
    if not torch.compiler.is_compiling() and values_readable(cu_seqlens_q) and cu_seqlens_q.numel():
        # flash-attn allows buffers longer than the tokens (rows past cu_seqlens[-1], e.g.
        # padding to a static shape); eagerly they are left out and their output is zeros
        # (compiled, our ops leave those rows unspecified, as flash-attn does).
        used_q, used_k = int(cu_seqlens_q[-1]), int(cu_seqlens_k[-1])
        if used_q < q.shape[0] or (block_table is None and used_k < k.shape[0]):
            keys = slice(None) if block_table is not None else slice(0, used_k)
            out = flash_attn_varlen_func(q[:used_q], k[keys], v[keys], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, 0.0, softmax_scale, causal, window_size, softcap,
                                         alibi_slopes, deterministic, return_attn_probs, block_table)
            out, rest = (out, ()) if not return_attn_probs else (out[0], out[1:])
            full = torch.cat((out, out.new_zeros(q.shape[0] - used_q, *out.shape[1:])))
            if not return_attn_probs:
                return full
            lse = torch.cat((rest[0], rest[0].new_full((rest[0].shape[0], q.shape[0] - used_q), torch.inf)), dim=1)
            return full, lse, None
    if block_table is None:
        out = _run(ops.varlen_attention, q, k, v, cu_seqlens_q, cu_seqlens_k, **options)
    else:
        _check(block_table.dtype == torch.int32, f"block_table must have dtype torch.int32, got {block_table.dtype}")
        seq_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
        out = _run(ops.paged_attention, q, k, v, cu_seqlens_q, seq_lens, block_table, **options)
    if not return_attn_probs:
        return out
    if torch.compiler.is_compiling():
        raise NotImplementedError("return_attn_probs=True in flash_attn_varlen_func is eager-only "
                                  "(its softmax_lse pass loops over sequences on the host)")
    lse = []
    for b, (q0, q1, k0, k1) in enumerate(zip(cu_seqlens_q.tolist(), cu_seqlens_q[1:].tolist(),
                                             cu_seqlens_k.tolist(), cu_seqlens_k[1:].tolist())):
        if block_table is None:
            keys = k[k0:k1]
        else:
            keys = k[block_table[b].long()].flatten(0, 1)[: k1 - k0]
        end = torch.tensor([k1 - k0], device=q.device)
        lse.append(_dense_lse(q[None, q0:q1], keys[None], torch.zeros_like(end), end, options["scale"],
                              options["causal"], options["window_size"], options["softcap"], alibi_slopes)[0])
    return out, torch.cat(lse, dim=1), None


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` of ``qkv`` ``(batch_size, seqlen, 3, nheads, headdim)``."""
    q, k, v = qkv.unbind(dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` of ``kv`` ``(batch_size, seqlen_k, 2, nheads_k, headdim)``."""
    k, v = kv.unbind(dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """:func:`flash_attn_varlen_func` of ``qkv`` ``(total, 3, nheads, headdim)``."""
    q, k, v = qkv.unbind(dim=1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_varlen_func` of ``kv`` ``(total_k, 2, nheads_k, headdim)``."""
    k, v = kv.unbind(dim=1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


# --- KV cache -------------------------------------------------------------------------------


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Attention against a KV cache, appending new keys first, as
    ``flash_attn.flash_attn_with_kvcache``.

    Sequence ``b`` reads cache row ``cache_batch_idx[b]`` (default ``b``), or the blocks
    ``block_table[b]`` of a paged cache. If ``k``/``v`` are given they are written into the
    cache in place at positions ``cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1``;
    then ``q`` attends to the keys ``cache_leftpad[b] .. cache_seqlens[b] + seqlen_new - 1``
    (bottom-right aligned when causal), rows beyond ignored.

    Args:
        q: ``(batch_size, seqlen_q, nheads, headdim)``.
        k_cache, v_cache: ``(batch_size_cache, seqlen_cache, nheads_k, headdim)``, or paged
            ``(num_blocks, page_block_size, nheads_k, headdim)`` with ``block_table``.
        k, v: ``(batch_size, seqlen_new, nheads_k, headdim)`` or ``None``.
        rotary_cos, rotary_sin: must be ``None`` (``NotImplementedError``; apply rotary
            before the call); rotary_interleaved: then unused.
        cache_seqlens: int or ``(batch_size,)`` int32 cached lengths (before ``k``); ``None``
            (without ``k`` only): the whole row, ``seqlen_cache`` or the whole block table.
        cache_batch_idx: ``(batch_size,)`` int32 rows of a non-paged cache.
        cache_leftpad: ``(batch_size,)`` int32 first valid cache position (non-paged, cache
            contiguous in its first two dims).
        block_table: ``(batch_size, max_num_blocks_per_seq)`` int32.
        softmax_scale, causal, window_size, softcap, alibi_slopes: as :func:`flash_attn_func`.
        num_splits: no effect.
        return_softmax_lse: also return ``softmax_lse`` ``(batch_size, nheads, seqlen_q)``.

    Returns:
        ``out`` ``(batch_size, seqlen_q, nheads, headdim)``, or ``(out, softmax_lse)``.

    Raises:
        FlashAttnArgumentError: shapes or dtypes flash-attn rejects, ``block_table`` with
        ``cache_batch_idx`` or ``cache_leftpad``, and (eager) keys beyond the cache or the
        block table.
        NotImplementedError: rotary arguments, per-batch ALiBi slopes.
    """
    if rotary_cos is not None or rotary_sin is not None:
        raise NotImplementedError("rotary_cos/rotary_sin: compiled_attn applies no rotary inside "
                                  "flash_attn_with_kvcache; rotate q and k before the call")
    _check_common(q, k_cache, v_cache, 0.0, alibi_slopes)
    _check(q.dim() == 4 and k_cache.dim() == 4,
           f"q must be (batch_size, seqlen_q, nheads, headdim) and k_cache 4-D, got {tuple(q.shape)} and "
           f"{tuple(k_cache.shape)}")
    _check((k is None) == (v is None), "k and v must be given together")
    batch, seqlen_q, num_heads, head_size = q.shape
    paged = block_table is not None
    device = q.device
    if paged:
        _check(cache_batch_idx is None, "Paged KVcache does not support cache_batch_idx")
        _check(cache_leftpad is None, "Paged KVcache does not support cache_leftpad")
        _check(block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == batch,
               f"block_table must be (batch_size={batch}, max_num_blocks_per_seq) int32, got "
               f"{tuple(block_table.shape)} {block_table.dtype}")
    seqlen_new = 0 if k is None else k.shape[1]
    if k is not None:
        _check_common(q, k, v, 0.0, None)
        _check(k.dim() == 4 and k.shape[0] == batch and k.shape[2:] == k_cache.shape[2:],
               f"k must be (batch_size={batch}, seqlen_new, {k_cache.shape[2]}, {head_size}), got {tuple(k.shape)}")
    if cache_seqlens is None:  # flash-attn: every row full (a paged row: its whole block table)
        _check(k is None, "If key is supplied, cache_seqlens must also be passed in")
        full = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
        cache_seqlens = torch.full((batch,), full, dtype=torch.int32, device=device)
    elif isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    _check(cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (batch,),
           f"cache_seqlens must be an int or (batch_size={batch},) int32, got {tuple(cache_seqlens.shape)} "
           f"{cache_seqlens.dtype}")
    key_end = cache_seqlens + seqlen_new  # [B]: keys 0 .. end - 1 of each row
    positions = cache_seqlens.long()[:, None] + torch.arange(seqlen_new, device=device)  # new keys' positions
    if paged:
        page = k_cache.shape[1]
        table, blocks, capacity = block_table, k_cache, block_table.shape[1] * page
        if seqlen_new:
            slots = (block_table.long().gather(1, (positions // page).clamp(max=block_table.shape[1] - 1)) * page
                     + positions % page)
    else:
        rows = (torch.arange(batch, device=device) if cache_batch_idx is None else cache_batch_idx).to(torch.int32)
        capacity = k_cache.shape[1]
        if cache_leftpad is None:  # each row one block of seqlen_cache tokens
            table, blocks = rows[:, None], k_cache
        else:  # one block per token, so that a row's keys may start at cache_leftpad[b]
            _check(k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1)
                   and v_cache.stride(0) == v_cache.shape[1] * v_cache.stride(1),
                   "cache_leftpad needs k_cache and v_cache contiguous in their first two dims")
            table = (rows[:, None] * k_cache.shape[1] + cache_leftpad[:, None]
                     + torch.arange(k_cache.shape[1], device=device, dtype=torch.int32))
            table = table.clamp(max=k_cache.shape[0] * k_cache.shape[1] - 1).to(torch.int32)
            blocks = k_cache.view(-1, 1, *k_cache.shape[2:])
            key_end = key_end - cache_leftpad
        if seqlen_new:
            slots = rows.long()[:, None] * k_cache.shape[1] + positions
    if not torch.compiler.is_compiling() and values_readable(cache_seqlens):
        if cache_batch_idx is not None and batch:
            _check(cache_batch_idx.dtype == torch.int32 and bool(((cache_batch_idx >= 0)
                                                                 & (cache_batch_idx < k_cache.shape[0])).all()),
                   f"cache_batch_idx must be int32 rows in [0, {k_cache.shape[0]}), got {cache_batch_idx.tolist()}")
        if cache_leftpad is not None and batch:
            _check(bool(((cache_leftpad >= 0) & (cache_leftpad <= cache_seqlens)).all()),
                   f"cache_leftpad must lie in [0, cache_seqlens]; got {cache_leftpad.tolist()} for cache_seqlens "
                   f"{cache_seqlens.tolist()}")
        longest = int((cache_seqlens + seqlen_new).max()) if batch else 0
        _check(longest <= capacity, f"cache_seqlens + seqlen_new reaches {longest} keys, beyond the "
                                    f"{'block table' if paged else 'cache'} ({capacity} keys)")
    if seqlen_new:  # slots of the cache viewed as blocks: a non-paged row is one block of seqlen_cache
        _run(ops.reshape_and_cache, k.flatten(0, 1), v.flatten(0, 1), k_cache, v_cache, slots.flatten())
    options = _options(q, softmax_scale, causal, window_size, softcap, alibi_slopes)
    v_blocks = v_cache.view(blocks.shape)
    out = _run(ops.paged_attention, q.reshape(batch * seqlen_q, num_heads, head_size), blocks, v_blocks,
               _uniform_cu_seqlens(batch, seqlen_q, device), key_end.to(torch.int32), table, **options)
    out = out.view(q.shape)
    if not return_softmax_lse:
        return out
    keys = blocks[table.long()].flatten(1, 2)  # [B, width * page, Hkv, D] in key order
    lse = _dense_lse(q, keys, torch.zeros_like(key_end), key_end, options["scale"], options["causal"],
                     options["window_size"], options["softcap"], alibi_slopes)
    return out, lse
