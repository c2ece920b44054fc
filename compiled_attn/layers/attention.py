"""Multi-head attention (MHA / GQA / MQA) over the ``compiled_attn`` ops.

The layer projects Q/K/V with one GEMM (``qkv_proj``, rows ``[Q | K | V]``, as vLLM's
``QKVParallelLinear``), applies RoPE, writes K/V into its paged cache with
``reshape_and_cache`` and attends with one op call: ``varlen_attention`` over the fresh
K/V when the batch is a pure prefill (or there is no cache), ``paged_attention`` over the
cache otherwise (decode, chunked prefill, prefix hits, mixed batches). A layer that
*shares* another layer's cache (cross-layer / YOCO KV sharing, as vLLM's
``kv_sharing_target_layer_name``) projects only Q, with a plain ``q_proj``, and reads that
cache.

A layer's cache is ``(key_cache, value_cache)`` or, for an fp8 KV cache (vLLM's
``kv_cache_dtype="fp8"``), ``(key_cache, value_cache, k_scale, v_scale)``: float8_e4m3fn
caches and their float32 scales travel together, so a layer that shares the cache reads it
with the scales it was written with. With an fp8 cache every batch, pure prefills too,
attends over the (quantized) cache, as vLLM V1 does: a prompt's outputs then do not depend
on whether it was prefilled whole, in chunks or from the prefix cache.
"""

from __future__ import annotations

import torch
from torch import nn

from ..metadata import AttentionMetadata
from ..ops.attention import PAGED_ATTENTION, VARLEN_ATTENTION
from ..ops.cache import RESHAPE_AND_CACHE
from ..ops.validation import check_head_size, check_heads
from ..distributed import TensorParallel
from .linear import linear, row_parallel_linear
from .norm import RMSNorm
from .rotary import RotaryEmbedding

KVCacheLayer = tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""``(key_cache, value_cache)``, or ``(key_cache, value_cache, k_scale, v_scale)`` for an fp8 cache."""


class Attention(nn.Module):
    """Attention layer; input and output ``[T, hidden_size]``.

    Parameters: ``qkv_proj`` (weight ``[(Hq + 2 * Hkv) * D, hidden_size]``, rows Q, K, V;
    vLLM ``QKVParallelLinear``), or only ``q_proj`` (``[Hq * D, hidden_size]``) when
    ``shares_kv_cache``; ``o_proj`` (``[hidden_size, Hq * D]``).

    Args:
        hidden_size: model width.
        num_heads: query heads ``Hq``.
        num_kv_heads: key/value heads ``Hkv`` (``Hq % Hkv == 0``).
        head_size: ``D`` (default ``hidden_size // num_heads``), from 1 to 256 (as flash-attn).
        rope_theta: RoPE base, or ``None`` for no rotary embedding.
        bias: bias on the Q/K/V/O projections.
        sliding_window: attend to at most this many most recent tokens (self included),
            i.e. flash-attn ``window_size=(sliding_window - 1, 0)``; ``None`` = global.
        softcap: logit softcap (0 = off).
        alibi_slopes: ``[Hq]`` ALiBi slopes or ``None``.
        causal: causal mask (``False`` for encoders).
        shares_kv_cache: project only Q and read another layer's cache.

    Raises:
        ValueError: head counts or head size the ops don't support, bad window.

    ``tp``: ``None``, or the :class:`~compiled_attn.distributed.TensorParallel` of a
    sharded layer (set by :func:`compiled_attn.models.sharding.shard_model`; its head
    counts are then this rank's).
    """

    tp: TensorParallel | None = None

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_size: int | None = None, *,
        rope_theta: float | None = 10000.0, bias: bool = False, sliding_window: int | None = None,
        softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None, causal: bool = True,
        shares_kv_cache: bool = False,
    ) -> None:
        super().__init__()
        check_heads(num_heads, num_kv_heads, differential=False)
        head_size = head_size or hidden_size // num_heads
        check_head_size("head_size", head_size)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.shares_kv_cache = shares_kv_cache
        q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
        if shares_kv_cache:
            self.q_proj = nn.Linear(hidden_size, q_size, bias=bias)
        else:
            self.qkv_proj = nn.Linear(hidden_size, q_size + 2 * kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, hidden_size, bias=bias)
        self.rotary = RotaryEmbedding(head_size, rope_theta) if rope_theta is not None else None
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0 if causal else sliding_window - 1)
        # The ops' (scale, causal, window_left, window_right, softcap): constants of the layer.
        self.attn_options = (head_size ** -0.5, causal, *window, softcap)

    def project(self, hidden: torch.Tensor, positions: torch.Tensor, input_norm: RMSNorm | None = None):
        """Q ``[T, Hq, D]`` and, unless the cache is shared, K/V ``[T, Hkv, D]``, rotated;
        ``input_norm`` (the block's pre-attention RMSNorm) is fused into the projection.

        Without RoPE Q and K, and V always, are strided views of the one ``qkv_proj`` output
        (the ops read strides).
        """
        if self.shares_kv_cache:
            q = linear(hidden, self.q_proj, input_norm).unflatten(-1, (self.num_heads, self.head_size))
            return (*self._rotate(positions, q), None, None)
        # Heads first, then split: a view of a non-contiguous split would specialize T != 1.
        qkv = linear(hidden, self.qkv_proj, input_norm).unflatten(-1, (-1, self.head_size))
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        q, k = self._rotate(positions, q, k)
        return q, k, v

    def _rotate(self, positions, *heads):
        return heads if self.rotary is None else self.rotary(positions, *heads)

    def attend(self, q, k, v, md: AttentionMetadata, kv_cache: KVCacheLayer | None,
               lambda_full: torch.Tensor | None = None) -> torch.Tensor:
        """Cache write + one attention op; returns the op's output (see the ops).

        The ops are called directly (``torch.ops.compiled_attn.*``): the shortest path to the
        kernel, with the layer's options as constants. Their metadata values are not
        checked here: :func:`~compiled_attn.metadata.build_metadata` checks what it builds.
        """
        options = (*self.attn_options, self.alibi_slopes, None)
        if kv_cache is None:
            if k is None:
                raise ValueError("a layer that shares another layer's KV cache needs kv_cache")
            return VARLEN_ATTENTION(q, k, v, md.cu_seqlens_q, md.cu_seqlens_q, lambda_full, *options)
        key_cache, value_cache, *scales = kv_cache
        k_scale, v_scale = scales or (None, None)
        if k is not None:
            RESHAPE_AND_CACHE(k, v, key_cache, value_cache, md.slot_mapping, k_scale, v_scale)
            if md.prefill_only and key_cache.dtype != torch.float8_e4m3fn:
                return VARLEN_ATTENTION(q, k, v, md.cu_seqlens_q, md.cu_seqlens_q, lambda_full, *options)
        return PAGED_ATTENTION(q, key_cache, value_cache, md.cu_seqlens_q, md.seq_lens, md.block_table,
                               lambda_full, *options, k_scale, v_scale)

    def forward(self, hidden: torch.Tensor, md: AttentionMetadata, kv_cache: KVCacheLayer | None = None,
                input_norm: RMSNorm | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, hidden_size]`` -> ``residual + attn(input_norm(hidden))`` ``[T, hidden_size]``
        (norm and residual optional, fused into the projections); writes this step's K/V
        to ``kv_cache``."""
        q, k, v = self.project(hidden, md.positions, input_norm)
        return row_parallel_linear(self.attend(q, k, v, md, kv_cache).flatten(1), self.o_proj, residual, self.tp)
