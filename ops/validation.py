"""Shape, dtype and option checks of the ``compiled_attn`` ops (no tensor values read).

``check_*_args`` look only at shapes, dtypes and Python scalars. They run in the fake
implementations (so ``torch.compile`` reports bad input at trace time) and in the public
functions when called eagerly. :func:`check_call_options` checks only Python types, which
tracing can afford; :func:`check_scalars` reads the float options and runs eagerly only (a
comparison on a traced float would specialize the graph on its value). Checks that read
metadata values live in :mod:`.value_checks`.

Every failure is a ``TypeError`` (wrong dtype or type) or ``ValueError`` (wrong shape or
value) naming the argument, what was given and what is allowed.
"""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPE = torch.float8_e4m3fn
"""The quantized KV-cache dtype (vLLM's ``kv_cache_dtype="fp8"`` / ``"fp8_e4m3"``)."""
CACHE_DTYPES = (*FLOAT_DTYPES, FP8_DTYPE)
"""What a paged KV cache may hold: a float dtype of the model, or float8_e4m3fn."""
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value; quantized keys and values saturate to +-448."""
MAX_HEAD_SIZE = 256


def check_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    check_tensor(name, tensor)
    if tensor.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise TypeError(f"{name} must have dtype in ({names}), got {tensor.dtype}")


def check_tensor(name: str, value) -> None:
    """``value`` is a tensor (raises TypeError naming ``name`` otherwise)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def check_ndim(name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(tensor.shape)}")


def check_head_size(name: str, head_size: int) -> None:
    """Any head size from 1 to ``MAX_HEAD_SIZE``, as flash-attn (the kernels pad it)."""
    if not 1 <= head_size <= MAX_HEAD_SIZE:
        raise ValueError(
            f"{name}: head size {head_size} is not supported; allowed: any int from 1 to "
            f"{MAX_HEAD_SIZE} (as flash-attn)"
        )


def check_heads(num_heads: int, num_kv_heads: int, differential: bool) -> None:
    if num_kv_heads < 1 or num_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if differential and (num_heads % 2 or num_kv_heads % 2):
        raise ValueError(
            "differential attention needs an even number of query and KV heads "
            f"(interleaved pairs), got num_heads={num_heads}, num_kv_heads={num_kv_heads}"
        )


def check_same_device(**tensors: torch.Tensor | None) -> None:
    present = {k: t for k, t in tensors.items() if t is not None}
    devices = {t.device for t in present.values()}
    if len(devices) > 1:
        where = ", ".join(f"{k} on {t.device}" for k, t in present.items())
        raise ValueError(f"all tensors must be on one device, got {where}")


def _shown(value) -> str:
    """``value`` for an error message: a tensor by its type and shape only (printing its
    values would break tracing), anything else as its repr."""
    if isinstance(value, torch.Tensor):
        return f"Tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"


def check_call_options(scale, window_size, softcap, causal=True) -> tuple[int, int]:
    """Types of the public attention functions' options; returns ``window_size`` as
    ``(left, right)``. Reads no float value, so it runs while tracing too.

    Raises:
        TypeError: ``scale`` or ``softcap`` not a real number or ``None``,
            ``window_size`` not a pair of ints, ``causal`` not a bool.
    """
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None, got {_shown(scale)}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))):
        raise TypeError(f"softcap must be a float or None, got {_shown(softcap)}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {_shown(causal)}")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(w, bool) or not isinstance(w, (int, torch.SymInt)) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    return window_size[0], window_size[1]


def check_scalars(scale: float, softcap: float) -> None:
    """Values of the float options (eagerly only).

    Raises:
        ValueError: ``scale`` not finite and > 0, ``softcap`` not finite and >= 0.
    """
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be finite and > 0, got {scale}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be finite and >= 0 (0 disables it), got {softcap}")


def check_options(window_left: int, window_right: int, softcap: float) -> None:
    if window_left < -1 or window_right < -1:
        raise ValueError(
            f"window_size must be (left, right) with each >= 0 or -1 (unbounded), "
            f"got ({window_left}, {window_right})"
        )
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 disables it), got {softcap}")


def check_extras(num_heads: int, lambda_full, alibi_slopes, scale_softcap) -> None:
    if alibi_slopes is not None:
        check_dtype("alibi_slopes", alibi_slopes, (torch.float32,))
        if tuple(alibi_slopes.shape) != (num_heads,):
            raise ValueError(
                f"alibi_slopes must have shape [num_heads]=[{num_heads}], got {tuple(alibi_slopes.shape)}"
            )
    if lambda_full is not None:
        check_dtype("lambda_full", lambda_full, FLOAT_DTYPES)
        if lambda_full.numel() not in (1, num_heads // 2) or lambda_full.dim() > 1:
            raise ValueError(
                f"lambda_full must have shape [] or [num_heads // 2]=[{num_heads // 2}], "
                f"got {tuple(lambda_full.shape)}"
            )
    if scale_softcap is not None:
        check_dtype("scale_softcap", scale_softcap, (torch.float32,))
        if tuple(scale_softcap.shape) != (2,):
            raise ValueError(f"scale_softcap must have shape [2] (scale, softcap), got {tuple(scale_softcap.shape)}")


def check_kv_scales(key_cache: torch.Tensor, k_scale, v_scale) -> None:
    """``k_scale``/``v_scale`` (each ``None`` or a float32 tensor of one element, ``[]`` or
    ``[1]``) of a ``float8_e4m3fn`` cache; ``None`` means 1. (Devices: ``check_same_device``;
    values: :func:`~.value_checks.check_kv_scale_values`.)

    Raises:
        TypeError: a scale that is not a float32 tensor.
        ValueError: a scale of more than one element, or given with a cache that is not
            float8_e4m3fn (the scales are those of vLLM's fp8 KV cache).
    """
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            continue
        check_dtype(name, scale, (torch.float32,))
        if scale.dim() > 1 or scale.numel() != 1:
            raise ValueError(f"{name} must be a float32 tensor of shape [] or [1], got shape {tuple(scale.shape)}")
        if key_cache.dtype != FP8_DTYPE:
            raise ValueError(
                f"{name} applies to a {FP8_DTYPE} KV cache only (kv_cache_dtype 'fp8'); the cache is "
                f"{key_cache.dtype}: pass {name}=None"
            )


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    check_dtype("key_cache", key_cache, CACHE_DTYPES)
    check_ndim("key_cache", key_cache, 4, "[num_blocks, block_size, num_kv_heads, head_size]")
    check_tensor("value_cache", value_cache)
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"value_cache must match key_cache, got {tuple(value_cache.shape)} {value_cache.dtype} "
            f"vs {tuple(key_cache.shape)} {key_cache.dtype}"
        )


def check_paged_args(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table,
                     lambda_full, window_left, window_right, softcap, alibi_slopes,
                     scale_softcap=None, k_scale=None, v_scale=None) -> None:
    """Shape and dtype checks of paged attention (plain or differential). The cache holds
    the query's dtype, or float8_e4m3fn with any query dtype (scales: :func:`check_kv_scales`)."""
    check_dtype("query", query, FLOAT_DTYPES)
    check_ndim("query", query, 3, "[num_tokens, num_heads, head_size]")
    check_cache_pair(key_cache, value_cache)
    if key_cache.dtype not in (query.dtype, FP8_DTYPE):
        raise TypeError(f"key_cache dtype {key_cache.dtype} must equal query dtype {query.dtype} "
                        f"or be {FP8_DTYPE} (an fp8 KV cache)")
    check_kv_scales(key_cache, k_scale, v_scale)
    if key_cache.shape[3] != query.shape[2]:
        raise ValueError(
            f"head_size of key_cache ({key_cache.shape[3]}) must equal query's ({query.shape[2]})"
        )
    check_head_size("query", query.shape[2])
    check_heads(query.shape[1], key_cache.shape[2], lambda_full is not None)
    check_dtype("cu_seqlens_q", cu_seqlens_q, (torch.int32,))
    check_ndim("cu_seqlens_q", cu_seqlens_q, 1, "[num_seqs + 1]")
    check_dtype("seq_lens", seq_lens, (torch.int32,))
    check_ndim("seq_lens", seq_lens, 1, "[num_seqs]")
    check_dtype("block_table", block_table, (torch.int32,))
    check_ndim("block_table", block_table, 2, "[num_seqs, max_blocks_per_seq]")
    num_seqs = seq_lens.shape[0]
    if cu_seqlens_q.shape[0] != num_seqs + 1 or block_table.shape[0] != num_seqs:
        raise ValueError(
            f"cu_seqlens_q must have num_seqs + 1 entries and block_table num_seqs rows; got "
            f"num_seqs={num_seqs} (seq_lens), cu_seqlens_q {tuple(cu_seqlens_q.shape)}, "
            f"block_table {tuple(block_table.shape)}"
        )
    check_options(window_left, window_right, softcap)
    check_extras(query.shape[1], lambda_full, alibi_slopes, scale_softcap)
    check_same_device(query=query, key_cache=key_cache, value_cache=value_cache,
                      cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, block_table=block_table,
                      lambda_full=lambda_full, alibi_slopes=alibi_slopes, scale_softcap=scale_softcap,
                      k_scale=k_scale, v_scale=v_scale)


def check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full,
                      window_left, window_right, softcap, alibi_slopes, scale_softcap=None) -> None:
    """Shape and dtype checks of varlen attention over contiguous k/v."""
    check_dtype("q", q, FLOAT_DTYPES)
    check_ndim("q", q, 3, "[total_q, num_heads, head_size]")
    check_tensor("k", k)
    check_ndim("k", k, 3, "[total_k, num_kv_heads, head_size]")
    check_tensor("v", v)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"head_size of k ({k.shape[2]}) must equal q's ({q.shape[2]})")
    check_head_size("q", q.shape[2])
    check_heads(q.shape[1], k.shape[1], lambda_full is not None)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_dtype(name, cu, (torch.int32,))
        check_ndim(name, cu, 1, "[num_seqs + 1]")
        if cu.shape[0] < 1:
            raise ValueError(f"{name} must have num_seqs + 1 >= 1 entries (a leading 0), got shape {tuple(cu.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} "
            "must have the same length num_seqs + 1"
        )
    check_options(window_left, window_right, softcap)
    check_extras(q.shape[1], lambda_full, alibi_slopes, scale_softcap)
    check_same_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      lambda_full=lambda_full, alibi_slopes=alibi_slopes, scale_softcap=scale_softcap)


def check_cache_write_args(key, value, key_cache, value_cache, slot_mapping, k_scale=None,
                           v_scale=None) -> None:
    """Shape and dtype checks of ``reshape_and_cache``: key and value of one float dtype,
    the cache's, or any float dtype for a float8_e4m3fn cache (scales: :func:`check_kv_scales`)."""
    check_dtype("key", key, FLOAT_DTYPES)
    check_ndim("key", key, 3, "[num_tokens, num_kv_heads, head_size]")
    check_cache_pair(key_cache, value_cache)
    if value.shape != key.shape:
        raise ValueError(f"value must have key's shape {tuple(key.shape)}, got {tuple(value.shape)}")
    if value.dtype != key.dtype or (key.dtype != key_cache.dtype and key_cache.dtype != FP8_DTYPE):
        raise TypeError(
            f"key/value dtype ({key.dtype}, {value.dtype}) must equal the cache dtype {key_cache.dtype} "
            f"(or, for a {FP8_DTYPE} cache, be one float dtype among {', '.join(map(str, FLOAT_DTYPES))})"
        )
    check_kv_scales(key_cache, k_scale, v_scale)
    if tuple(key.shape[1:]) != tuple(key_cache.shape[2:]):
        raise ValueError(
            f"key heads/head_size {tuple(key.shape[1:])} must match the cache's {tuple(key_cache.shape[2:])}"
        )
    check_dtype("slot_mapping", slot_mapping, (torch.int64,))
    if slot_mapping.shape != key.shape[:1]:
        raise ValueError(
            f"slot_mapping must have one entry per token ({key.shape[0]}), got shape {tuple(slot_mapping.shape)}"
        )
    check_same_device(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                      slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale)


def check_distinct_destinations(block_mapping: torch.Tensor) -> None:
    """Every ``dst`` of ``block_mapping`` at most once (eager only: reads the mapping)."""
    if block_mapping.numel() and not torch.compiler.is_compiling():
        dst = block_mapping[:, 1]
        if dst.unique().numel() != dst.numel():
            raise ValueError(f"block_mapping destinations must be distinct, got {dst.tolist()[:16]}")


def check_block_mapping(block_mapping: torch.Tensor, num_src: int, num_dst: int) -> None:
    check_dtype("block_mapping", block_mapping, (torch.int64,))
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [num_pairs, 2] (src, dst), got {tuple(block_mapping.shape)}")
    if block_mapping.numel() and not torch.compiler.is_compiling():
        src, dst = block_mapping[:, 0], block_mapping[:, 1]
        if bool((src < 0).any() | (src >= num_src).any() | (dst < 0).any() | (dst >= num_dst).any()):
            raise ValueError(
                f"block_mapping ids must lie in [0, {num_src}) for src and [0, {num_dst}) for dst, "
                f"got {block_mapping.tolist()[:8]}"
            )
