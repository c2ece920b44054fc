"""KV-cache ops: ``reshape_and_cache``, ``copy_blocks`` and ``swap_blocks``.

Ops of the ``compiled_attn`` namespace (defined as :mod:`.library` says) that write the
paged cache in place (their schemas mark the written tensors ``(a!)``), with the reference
of :mod:`compiled_attn.ops.reference` on every device; faster kernels register on top.
Semantics follow vLLM's ``reshape_and_cache_flash``, ``copy_blocks`` and ``swap_blocks``;
a cache may be float8_e4m3fn (vLLM's ``kv_cache_dtype="fp8"``), written with the
``k_scale``/``v_scale`` arguments of ``reshape_and_cache``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import reference
from .library import define_op
from .validation import (
    CACHE_DTYPES,
    check_block_mapping,
    check_cache_pair,
    check_cache_write_args,
    check_distinct_destinations,
    check_dtype,
    check_ndim,
)
from .value_checks import check_kv_scale_values, check_slot_values, should_check

PAD_SLOT_ID = -1
"""Slot of a token that must not be written (padding rows of a captured batch)."""


def _reshape_and_cache_fake(key, value, key_cache, value_cache, slot_mapping, k_scale=None,
                            v_scale=None) -> None:
    check_cache_write_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


RESHAPE_AND_CACHE = define_op(
    "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slot_mapping, Tensor? k_scale=None, Tensor? v_scale=None) -> ()",
    reference.reshape_and_cache, _reshape_and_cache_fake)

COPY_BLOCKS = define_op(
    "copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping) -> ()",
    reference.copy_blocks, lambda key_caches, value_caches, block_mapping: None)

SWAP_BLOCKS = define_op(
    "swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()",
    reference.swap_blocks, lambda src, dst, block_mapping: None)


def reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                      slot_mapping: Tensor, *, k_scale: Tensor | None = None,
                      v_scale: Tensor | None = None) -> None:
    """Write new keys and values into the paged cache (in place).

    Token ``t`` goes to block ``slot_mapping[t] // block_size``, offset
    ``slot_mapping[t] % block_size``; a slot of ``PAD_SLOT_ID`` (-1) is skipped.

    A float8_e4m3fn cache (vLLM's fp8 KV cache, ``reshape_and_cache_flash`` with
    ``kv_cache_dtype="fp8"``, ``k_scale``, ``v_scale``) stores
    ``(key / k_scale).to(float8_e4m3fn)`` computed in float32, saturating to +-448 (the
    nearest float8 value, ties to even; NaN stays NaN), and the same for values with
    ``v_scale``; :func:`~compiled_attn.ops.paged_attention` reads it back as
    ``cache.to(float32) * k_scale``.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_size]``, the cache's dtype, or for a
            float8_e4m3fn cache one dtype among float16, bfloat16, float32.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``,
            float16, bfloat16, float32 or float8_e4m3fn.
        slot_mapping: ``[num_tokens]`` int64.
        k_scale, v_scale: float8_e4m3fn caches only: float32 ``[]`` or ``[1]`` tensors,
            finite and > 0, on the cache's device, or ``None`` (1).

    Raises:
        TypeError: wrong dtypes. ValueError: shapes that disagree, scales given with a
        cache that is not fp8 and, when eager, slots outside ``[-1, num_blocks *
        block_size)``, scales not finite and > 0.
    """
    if not torch.compiler.is_compiling():
        check_cache_write_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        if should_check(slot_mapping):
            check_slot_values(key_cache, slot_mapping)
            check_kv_scale_values(k_scale, v_scale)
    RESHAPE_AND_CACHE(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def copy_blocks(key_caches: list[Tensor], value_caches: list[Tensor], block_mapping: Tensor) -> None:
    """Copy whole blocks inside every layer's cache: ``cache[dst] = cache[src]``.

    Copy-on-write when a sequence forks (parallel sampling, beam search).

    Args:
        key_caches, value_caches: per layer, ``[num_blocks, block_size, Hkv, D]``.
        block_mapping: ``[num_pairs, 2]`` int64 rows ``(src, dst)``; destinations distinct.

    Raises:
        TypeError, ValueError: bad ``block_mapping`` dtype, shape or ids, repeated
        destinations, a value cache unlike its key cache, caches of different block counts.
    """
    for name, caches in (("key_caches", key_caches), ("value_caches", value_caches)):
        if not isinstance(caches, (list, tuple)) or not all(isinstance(c, Tensor) for c in caches):
            raise TypeError(f"{name} must be a list of per-layer cache tensors, got {type(caches).__name__}")
    if len(key_caches) != len(value_caches) or not key_caches:
        raise ValueError(
            f"key_caches and value_caches must be non-empty lists of equal length, got "
            f"{len(key_caches)} and {len(value_caches)}"
        )
    for layer, (key_cache, value_cache) in enumerate(zip(key_caches, value_caches)):
        try:
            check_cache_pair(key_cache, value_cache)
        except (TypeError, ValueError) as error:
            raise type(error)(f"layer {layer} (key_caches[{layer}], value_caches[{layer}]): {error}") from None
    num_blocks = {c.shape[0] for c in (*key_caches, *value_caches)}
    if len(num_blocks) != 1:
        raise ValueError(f"all caches must have the same number of blocks, got {sorted(num_blocks)}")
    (n,) = num_blocks
    check_block_mapping(block_mapping, n, n)
    check_distinct_destinations(block_mapping)
    COPY_BLOCKS(key_caches, value_caches, block_mapping)


def swap_blocks(src: Tensor, dst: Tensor, block_mapping: Tensor) -> None:
    """Copy blocks between two caches, typically GPU <-> CPU: ``dst[d] = src[s]``.

    Args:
        src, dst: ``[num_blocks_*, block_size, Hkv, D]`` of one dtype (float16, bfloat16,
            float32 or float8_e4m3fn), any devices.
        block_mapping: ``[num_pairs, 2]`` int64 rows ``(s, d)``, on the CPU or ``src``'s
            device.

    Raises:
        TypeError, ValueError: caches not tensors of a float dtype, dtype or per-block shape
            mismatch, caches not 4-D, bad ``block_mapping``, repeated destinations.
    """
    for name, cache in (("src", src), ("dst", dst)):
        check_dtype(name, cache, CACHE_DTYPES)
        check_ndim(name, cache, 4, "[num_blocks, block_size, num_kv_heads, head_size]")
    if src.dtype != dst.dtype:
        raise TypeError(f"src and dst must share a dtype, got {src.dtype} and {dst.dtype}")
    if src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"src and dst blocks differ: {tuple(src.shape)} vs {tuple(dst.shape)}")
    check_block_mapping(block_mapping, src.shape[0], dst.shape[0])
    check_distinct_destinations(block_mapping)
    SWAP_BLOCKS(src, dst, block_mapping)
