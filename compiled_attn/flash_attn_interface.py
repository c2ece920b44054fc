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
embedding inside :func:`flash_attn_with_kvcache`, per-batch ALiBi slopes ``(batch, nheads)``,
``cache_leftpad`` with a cache not contiguous in its first two dims.
``softmax_lse`` (``return_attn_probs`` / ``return_softmax_lse``) is computed by a second,
dense pass in plain PyTorch (memory ``batch * nheads * seqlen_q * seqlen_k`` floats); the
varlen one loops over sequences on the host, so it is eager-only. ``deterministic`` and
``num_splits`` are accepted and have no effect (our forward and backward are deterministic;
splits are chosen from shapes). As in flash-attn, q/k/v not contiguous in the last dim are
made contiguous, and the number options take any real (NumPy's too) or integral number.

Checks that read tensor values on the host (``cache_seqlens`` against the cache, row and
padding indices, ``cu_seqlens``) run, as our ops' value checks, only when
:func:`compiled_attn.ops.value_checks.should_check` says so: eagerly, not while a CUDA
graph is captured, and not with ``COMPILED_ATTN_CHECK_VALUES=0``.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from . import ops
from .ops.value_checks import should_check

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


def _shown(value) -> str:
    """``value`` for an error message (a tensor by its shape and dtype, not its values)."""
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)} {value.dtype}"
    return f"{type(value).__name__} {value!r}"


def _is_int(value) -> bool:
    return isinstance(value, (numbers.Integral, torch.SymInt)) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (numbers.Real, torch.SymInt, torch.SymFloat)) and not isinstance(value, bool)


def _python(value, kind: type):
    """``value`` (a NumPy number, say) as ``kind``; ints, floats and symbolic numbers as they are."""
    return value if isinstance(value, (int, float, torch.SymInt, torch.SymFloat)) else kind(value)


def _contiguous(t):
    """flash-attn's ``maybe_contiguous``: a tensor with a contiguous last dim."""
    return t.contiguous() if isinstance(t, Tensor) and t.dim() and t.stride(-1) != 1 else t


def _check_devices(q: Tensor, **tensors) -> None:
    for name, t in tensors.items():
        if isinstance(t, Tensor) and t.device != q.device:
            raise FlashAttnArgumentError(f"{name} must be on q's device {q.device}, got {name} on {t.device}")


def _check_common(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, alibi_slopes: Tensor | None,
                  names: tuple[str, str, str] = ("q", "k", "v")) -> None:
    """flash-attn's checks shared by every function (before any kernel runs); ``names``:
    the arguments ``q``, ``k``, ``v`` as the caller passed them."""
    if dropout_p:
        raise NotImplementedError(f"dropout_p={dropout_p}: compiled_attn has no attention dropout (use 0.0)")
    if alibi_slopes is not None and alibi_slopes.dim() != 1:
        raise NotImplementedError(f"alibi_slopes of shape {tuple(alibi_slopes.shape)}: only (nheads,) slopes "
                                  "are supported, not per-batch (batch_size, nheads)")
    q_name, k_name, v_name = names
    for name, t in zip(names, (q, k, v)):
        _check(isinstance(t, Tensor), f"{name} must be a tensor, got {type(t).__name__}")
        _check(t.dtype in (torch.float16, torch.bfloat16, torch.float32),
               f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    _check(q.dtype == k.dtype == v.dtype, f"query and key/value must have the same dtype, got {q_name} {q.dtype}, "
                                          f"{k_name} {k.dtype}, {v_name} {v.dtype}")
    _check(k.shape == v.shape, f"{k_name} and {v_name} must have the same shape, got {tuple(k.shape)} and "
                               f"{tuple(v.shape)}")
    _check(q.shape[-1] == k.shape[-1],
           f"{q_name} and {k_name} must have the same head size, got {q.shape[-1]} and {k.shape[-1]}")
    _check(q.shape[-2] % k.shape[-2] == 0, f"Number of heads in key/value ({k_name}: {k.shape[-2]}) must divide "
                                           f"number of heads in query ({q_name}: {q.shape[-2]})")
    _check_devices(q, **{k_name: k, v_name: v}, alibi_slopes=alibi_slopes)


def _options(softmax_scale, causal, window_size, softcap, alibi_slopes) -> dict:
    """Keyword arguments of our ops for flash-attn's options (numbers as Python numbers).
    Its defaults (no scale, softcap 0) stay defaults (``None``), so that a compiled call
    can reach the flash-attn backend (``ops.varlen_attention``'s ``softcap``)."""
    # (messages built only on failure: traced numbers have no repr while compiling)
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(map(_is_int, window_size))):
        raise FlashAttnArgumentError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    if not (softmax_scale is None or _is_real(softmax_scale)):
        raise FlashAttnArgumentError(f"softmax_scale must be a real number or None, got {_shown(softmax_scale)}")
    if not _is_real(softcap):
        raise FlashAttnArgumentError(f"softcap must be a real number, got {_shown(softcap)}")
    return dict(scale=None if softmax_scale is None else _python(softmax_scale, float), causal=bool(causal),
                window_size=tuple(_python(w, int) for w in window_size),
                softcap=None if softcap == 0 else _python(softcap, float), alibi_slopes=alibi_slopes)


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
        FlashAttnArgumentError: shapes, dtypes, devices or options flash-attn rejects.
        NotImplementedError: ``dropout_p > 0``, per-batch ALiBi slopes.
    """
    q, k, v = (_contiguous(t) for t in (q, k, v))
    _check_common(q, k, v, dropout_p, alibi_slopes)
    _check(q.dim() == 4 and k.dim() == 4 and q.shape[0] == k.shape[0],
           f"q must be (batch_size, seqlen_q, nheads, headdim) and k, v (batch_size, seqlen_k, nheads_k, headdim), "
           f"got {tuple(q.shape)} and {tuple(k.shape)}")
    batch, seqlen_q, num_heads, head_size = q.shape
    seqlen_k = k.shape[1]
    options = _options(softmax_scale, causal, window_size, softcap, alibi_slopes)
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
        cu_seqlens_q, cu_seqlens_k: ``(batch_size + 1,)`` int32 (``[0]``: no sequence).
            q, k, v may hold rows past ``cu_seqlens[-1]`` (padding to a static shape):
            their output is zeros (``softmax_lse`` ``+inf``) when values are checked
            (see the module docstring: finding the rows reads ``cu_seqlens[-1]``),
            otherwise unspecified on CUDA, as flash-attn's (zeros on the CPU).
        max_seqlen_q, max_seqlen_k: ints, bounds of the lengths (our kernels do not need
            them; the ``softmax_lse`` pass does not either).
        block_table: ``(batch_size, max_num_blocks_per_seq)`` int32, or ``None``.
        Others: as :func:`flash_attn_func`.

    Returns:
        ``out`` ``(total_q, nheads, headdim)``, or ``(out, softmax_lse, None)`` with
        ``softmax_lse`` ``(nheads, total_q)`` (eager only: it reads ``cu_seqlens`` on the
        host, also with ``COMPILED_ATTN_CHECK_VALUES=0``). Differentiable without
        ``block_table``.

    Raises:
        FlashAttnArgumentError: as :func:`flash_attn_func`, and cu_seqlens that are not
        1-D int32 tensors of ``batch_size + 1 >= 1`` entries, a block table of the wrong
        shape or (values checked) too small for the keys.
        NotImplementedError: as :func:`flash_attn_func`; ``return_attn_probs`` while compiling.
    """
    q, k, v = (_contiguous(t) for t in (q, k, v))
    _check_common(q, k, v, dropout_p, alibi_slopes)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not (isinstance(cu, Tensor) and cu.dtype == torch.int32 and cu.dim() == 1 and cu.numel() >= 1):
            raise FlashAttnArgumentError(f"{name} must be a 1-D int32 tensor of batch_size + 1 >= 1 entries, "
                                         f"got {_shown(cu)}")
    _check(cu_seqlens_q.shape == cu_seqlens_k.shape,
           f"cu_seqlens_q and cu_seqlens_k must both be (batch_size + 1,), got {tuple(cu_seqlens_q.shape)} and "
           f"{tuple(cu_seqlens_k.shape)}")
    batch = cu_seqlens_q.shape[0] - 1
    if not (block_table is None or (isinstance(block_table, Tensor) and block_table.dtype == torch.int32
                                    and block_table.dim() == 2 and block_table.shape[0] == batch)):
        raise FlashAttnArgumentError(f"block_table must be an int32 tensor of shape (batch_size={batch}, "
                                     f"max_num_blocks_per_seq), got {_shown(block_table)}")
    _check_devices(q, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, block_table=block_table)
    options = _options(softmax_scale, causal, window_size, softcap, alibi_slopes)
    q_used, k_used, v_used = q, k, v
    if should_check(cu_seqlens_q):  # leave out rows past the tokens (a host read)
        used_q, used_k = int(cu_seqlens_q[-1]), int(cu_seqlens_k[-1])
        q_used = q[:used_q]
        if block_table is None:
            k_used, v_used = k[:used_k], v[:used_k]
    if block_table is None:
        out = _run(ops.varlen_attention, q_used, k_used, v_used, cu_seqlens_q, cu_seqlens_k, **options)
    else:
        seq_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
        out = _run(ops.paged_attention, q_used, k, v, cu_seqlens_q, seq_lens, block_table, **options)
    if out.shape[0] < q.shape[0]:
        out = torch.cat((out, out.new_zeros(q.shape[0] - out.shape[0], *out.shape[1:])))
    if not return_attn_probs:
        return out
    if torch.compiler.is_compiling():
        raise NotImplementedError("return_attn_probs=True in flash_attn_varlen_func is eager-only "
                                  "(its softmax_lse pass loops over sequences on the host)")
    lse = torch.full((q.shape[1], q.shape[0]), torch.inf, device=q.device)  # rows of no sequence: +inf
    for b, (q0, q1, k0, k1) in enumerate(zip(cu_seqlens_q.tolist(), cu_seqlens_q[1:].tolist(),
                                             cu_seqlens_k.tolist(), cu_seqlens_k[1:].tolist())):
        if block_table is None:
            keys = k[k0:k1]
        else:
            keys = k[block_table[b].long()].flatten(0, 1)[: k1 - k0]
        end = torch.tensor([k1 - k0], device=q.device)
        lse[:, q0:q1] = _dense_lse(q[None, q0:q1], keys[None], torch.zeros_like(end), end, options["scale"],
                                   options["causal"], options["window_size"], options["softcap"], alibi_slopes)[0]
    return out, lse, None


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


def _check_kvcache_values(cache_seqlens: Tensor, seqlen_new: int, capacity: int, where: str,
                          cache_batch_idx: Tensor | None, cache_rows: int, cache_leftpad: Tensor | None) -> None:
    """flash_attn_with_kvcache's bounds on the values of its metadata (host reads: called
    only where :func:`~compiled_attn.ops.value_checks.should_check`)."""
    if not bool(((cache_seqlens >= 0) & (cache_seqlens + seqlen_new <= capacity)).all()):
        raise FlashAttnArgumentError(
            f"cache_seqlens must be >= 0 and cache_seqlens + seqlen_new ({seqlen_new}) must fit the {where} "
            f"({capacity} keys), got cache_seqlens {cache_seqlens.tolist()}")
    if cache_batch_idx is not None and not bool(((cache_batch_idx >= 0) & (cache_batch_idx < cache_rows)).all()):
        raise FlashAttnArgumentError(f"cache_batch_idx must hold rows of k_cache in [0, {cache_rows}), got "
                                     f"{cache_batch_idx.tolist()}")
    if cache_leftpad is not None and not bool(((cache_leftpad >= 0) & (cache_leftpad <= cache_seqlens)).all()):
        raise FlashAttnArgumentError(f"cache_leftpad must lie in [0, cache_seqlens]; got {cache_leftpad.tolist()} "
                                     f"for cache_seqlens {cache_seqlens.tolist()}")


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
    (bottom-right aligned when causal), rows beyond ignored. No gradient, as flash-attn's
    kvcache function: ``k``/``v`` are written detached and the output carries no autograd
    graph (also for a ``q`` that requires grad).

    Args:
        q: ``(batch_size, seqlen_q, nheads, headdim)``.
        k_cache, v_cache: ``(batch_size_cache, seqlen_cache, nheads_k, headdim)``, or paged
            ``(num_blocks, page_block_size, nheads_k, headdim)`` with ``block_table``;
            contiguous last dim.
        k, v: ``(batch_size, seqlen_new, nheads_k, headdim)`` or ``None``.
        rotary_cos, rotary_sin: must be ``None`` (``NotImplementedError``; apply rotary
            before the call); rotary_interleaved: then unused.
        cache_seqlens: int or ``(batch_size,)`` int32 cached lengths (before ``k``); ``None``
            (without ``k`` only): the whole row, ``seqlen_cache`` or the whole block table.
        cache_batch_idx: ``(batch_size,)`` int32 rows of a non-paged cache; default row
            ``b`` (then ``batch_size <= batch_size_cache``).
        cache_leftpad: ``(batch_size,)`` int32 first valid cache position (non-paged, cache
            contiguous in its first two dims).
        block_table: ``(batch_size, max_num_blocks_per_seq)`` int32.
        softmax_scale, causal, window_size, softcap, alibi_slopes: as :func:`flash_attn_func`.
        num_splits: no effect.
        return_softmax_lse: also return ``softmax_lse`` ``(batch_size, nheads, seqlen_q)``.
        Tensors are on q's device.

    Returns:
        ``out`` ``(batch_size, seqlen_q, nheads, headdim)``, or ``(out, softmax_lse)``.

    Raises:
        FlashAttnArgumentError: shapes, dtypes or devices flash-attn rejects, ``block_table``
        with ``cache_batch_idx`` or ``cache_leftpad``, and (values checked, see the module
        docstring) ``cache_seqlens`` negative or reaching beyond the cache or the block
        table, ``cache_batch_idx`` outside the cache, ``cache_leftpad`` outside
        ``[0, cache_seqlens]``.
        NotImplementedError: rotary arguments, per-batch ALiBi slopes, ``cache_leftpad``
        with a cache not contiguous in its first two dims.
    """
    if rotary_cos is not None or rotary_sin is not None:
        raise NotImplementedError("rotary_cos/rotary_sin: compiled_attn applies no rotary inside "
                                  "flash_attn_with_kvcache; rotate q and k before the call")
    q, k, v = (_contiguous(t) for t in (q, k, v))
    _check_common(q, k_cache, v_cache, 0.0, alibi_slopes, names=("q", "k_cache", "v_cache"))
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check(cache.stride(-1) == 1, f"{name} must have contiguous last dimension, got strides {cache.stride()}")
    _check(q.dim() == 4 and k_cache.dim() == 4,
           f"q must be (batch_size, seqlen_q, nheads, headdim) and k_cache 4-D, got {tuple(q.shape)} and "
           f"{tuple(k_cache.shape)}")
    _check((k is None) == (v is None), "k and v must be given together")
    batch, seqlen_q, num_heads, head_size = q.shape
    paged = block_table is not None
    device = q.device
    _check_devices(q, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                   block_table=block_table)
    for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if not (t is None or (isinstance(t, Tensor) and t.dtype == torch.int32 and t.shape == (batch,))):
            raise FlashAttnArgumentError(f"{name} must be an int32 tensor of shape (batch_size,) = ({batch},), "
                                         f"got {_shown(t)}")
    if paged:
        _check(cache_batch_idx is None, "Paged KVcache does not support cache_batch_idx")
        _check(cache_leftpad is None, "Paged KVcache does not support cache_leftpad")
        if not (isinstance(block_table, Tensor) and block_table.dtype == torch.int32 and block_table.dim() == 2
                and block_table.shape[0] == batch):
            raise FlashAttnArgumentError(f"block_table must be (batch_size={batch}, max_num_blocks_per_seq) int32, "
                                         f"got {_shown(block_table)}")
    else:
        _check(cache_batch_idx is not None or batch <= k_cache.shape[0],
               f"k_cache has {k_cache.shape[0]} rows (batch_size_cache) for batch_size {batch}: sequence b reads "
               "row b, unless cache_batch_idx picks the rows")
    if cache_leftpad is not None and not all(c.stride(0) == c.shape[1] * c.stride(1) for c in (k_cache, v_cache)):
        raise NotImplementedError(f"cache_leftpad with k_cache/v_cache not contiguous in their first two dims "
                                  f"(strides {k_cache.stride()}, {v_cache.stride()}) is not supported")
    seqlen_new = 0 if k is None else k.shape[1]
    if k is not None:
        _check_common(q, k, v, 0.0, None)
        _check(k.dim() == 4 and k.shape[0] == batch and k.shape[2:] == k_cache.shape[2:],
               f"k must be (batch_size={batch}, seqlen_new, {k_cache.shape[2]}, {head_size}), got {tuple(k.shape)}")
    if cache_seqlens is None:  # flash-attn: every row full (a paged row: its whole block table)
        _check(k is None, "If key is supplied, cache_seqlens must also be passed in")
        cache_seqlens = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    if _is_int(cache_seqlens):
        cache_seqlens = torch.full((batch,), _python(cache_seqlens, int), dtype=torch.int32, device=device)
    if not (isinstance(cache_seqlens, Tensor) and cache_seqlens.dtype == torch.int32
            and cache_seqlens.shape == (batch,)):
        raise FlashAttnArgumentError(f"cache_seqlens must be an int or an int32 tensor of shape (batch_size,) = "
                                     f"({batch},), got {_shown(cache_seqlens)}")
    # No autograd, as flash-attn: the cache is written with, and attention runs on, detached tensors.
    q, k_cache, v_cache, k, v, alibi_slopes = (None if t is None else t.detach()
                                               for t in (q, k_cache, v_cache, k, v, alibi_slopes))
    options = _options(softmax_scale, causal, window_size, softcap, alibi_slopes)
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
            table = (rows[:, None] * k_cache.shape[1] + cache_leftpad[:, None]
                     + torch.arange(k_cache.shape[1], device=device, dtype=torch.int32))
            table = table.clamp(max=k_cache.shape[0] * k_cache.shape[1] - 1).to(torch.int32)
            blocks = k_cache.view(-1, 1, *k_cache.shape[2:])
            key_end = key_end - cache_leftpad
        if seqlen_new:
            slots = rows.long()[:, None] * k_cache.shape[1] + positions
    if should_check(cache_seqlens):
        _check_kvcache_values(cache_seqlens, seqlen_new, capacity, "block table" if paged else "cache",
                              cache_batch_idx, k_cache.shape[0], cache_leftpad)
    if seqlen_new:  # slots of the cache viewed as blocks: a non-paged row is one block of seqlen_cache
        _run(ops.reshape_and_cache, k.flatten(0, 1), v.flatten(0, 1), k_cache, v_cache, slots.flatten())
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
